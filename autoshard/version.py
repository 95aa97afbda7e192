"""The package version (read by the graph cache without importing the package's entry points)."""

__version__ = "0.1.0"
