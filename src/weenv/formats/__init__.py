"""Formats: the manifest models and digest helpers (``manifest.py``) and the read
limits (``limits.py``) every layer above shares; they import nothing of weenv's
but :mod:`weenv.errors`."""
