"""Packaging: layer groups (EROFS images split into chunks) and templates."""
