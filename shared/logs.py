"""structlog JSON logs; session, call and trace ids are bound as context variables."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, level: str = "info", json: bool = True) -> structlog.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(service=service)


def get(service: str) -> structlog.BoundLogger:
    return structlog.get_logger().bind(service=service)


def call_context(session_id: str, call_id: str):
    """Bind session, call and trace ids to every log line inside the `with` block."""
    from talaria.shared.tracing import session_trace_id, trace_id_hex

    return structlog.contextvars.bound_contextvars(
        session_id=session_id, call_id=call_id, trace_id=trace_id_hex(session_trace_id(session_id))
    )
