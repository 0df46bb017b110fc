"""Alembic revisions for the Talaria schema (`shared/db/schema.py`)."""
