"""The package version, importable from any layer (the offline tools stamp it into what they write)."""

__version__ = "0.1.0"
