"""The package version, importable without the read side (the writer records it in the store attrs)."""
__version__ = "0.1.0"
