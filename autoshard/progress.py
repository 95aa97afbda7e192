"""Progress on stderr for the commands that take longer than a couple of seconds (capture, search, profile,
measure): a `rich` spinner with the current step and its elapsed time, or a bar when the number of steps is
known. Shown only when stderr is a terminal, and never with --quiet or --json, so that piped and scripted runs
see nothing but their output; it is transient (cleared when the command ends).

The planner and the runtime report through plain callables (`progress(message)`, `progress(done, total)`);
a `Progress` is one of those, and so is `list.append` in the tests.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """`progress(message)` shows message as the current step; `progress.steps(label)` returns a
    `(done, total)` callable that draws a bar. Does nothing when disabled or stderr is not a terminal."""

    def __init__(self, enabled: bool = True, *, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and _is_terminal(self._stream)
        self._live = None  # rich.live.Live while something is shown
        self._bar = None  # (rich.progress.Progress, task id) while a bar is shown
        self._t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        from rich.spinner import Spinner

        elapsed = time.perf_counter() - self._t0
        renderable = Spinner("dots", text=f"autoshard: {message} [dim]({elapsed:.0f} s)[/dim]")
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(renderable, console=Console(file=self._stream), transient=True,
                              refresh_per_second=8)
            self._live.start()
        else:
            self._live.update(renderable)

    def steps(self, label: str):
        """A `(done, total)` callable drawing a bar labelled `label` (None when disabled)."""
        if not self.enabled:
            return None

        def show(done: int, total: int) -> None:
            if self._bar is None:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as Bar

                self.close()
                bar = Bar(TextColumn(f"autoshard: {label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=Console(file=self._stream), transient=True)
                bar.start()
                self._bar = (bar, bar.add_task(label, total=total))
            bar, task = self._bar
            bar.update(task, completed=done, total=total)

        return show

    def close(self) -> None:
        """Clear whatever is shown (also on errors: the CLI closes it before printing one)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._bar is not None:
            self._bar[0].stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
