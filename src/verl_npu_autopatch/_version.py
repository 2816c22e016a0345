"""The package version, read by the package root (``__version__``) and the CLI."""

__version__ = "0.1.0"
