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
