"""Postgres schema (SQLAlchemy 2 Core) and async engine helpers."""
