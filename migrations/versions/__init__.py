"""Alembic revisions, one logical change each (Alembic skips this file)."""
