"""The package version (one place: specserve/__init__.py and the server report it)."""

__version__ = "0.1.0"
