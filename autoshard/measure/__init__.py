"""Measuring: what the hardware does (`autoshard profile`), what a plan's step does (`autoshard measure`), and
the hand-written reference step the runtime is checked against (`reference_loop.py`)."""
