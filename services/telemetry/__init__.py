"""Telemetry: projects the event stream into Postgres and emits session spans."""
