"""structlog JSON logs; session, call and trace ids are bound as context variables."""

from __future__ import annotations

import logging
import re
import sys

import structlog
from talaria.shared.tracing import session_trace_id, trace_id_hex


# Credentials a library's log line may quote (aiohttp logs a malformed request's raw header
# line): an Authorization / x-api-key value, a bearer token, a generated key, a URL password.
_SECRETS = [
    (re.compile(r"(?i)((?:proxy-)?authorization|x-api-key)(['\"]?\s*[:=,]\s*['\"]?)[^\r\n'\"]*"), r"\1\2[redacted]"),
    (re.compile(r"(?i)(bearer\s+)[^\s'\"]+"), r"\1[redacted]"),
    (re.compile(r"\btk-[A-Za-z0-9_-]{8,}"), "tk-[redacted]"),
    (re.compile(r"(://[^:/@\s]+:)[^@\s]+@"), r"\1[redacted]@"),
]


def redact(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    """On the stdlib handler: no API key or password reaches a log file, whoever logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def _redacting_stdlib_handler() -> None:
    root = logging.getLogger()
    if not any(isinstance(f, RedactSecrets) for h in root.handlers for f in h.filters):
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(RedactSecrets())
        root.addHandler(handler)


class SparingPrintLogger(structlog.PrintLogger):
    """A log line that cannot be written (a full disk under the log file: ENOSPC) is dropped
    and counted, never raised into the code that logged it: the call being served matters
    more than its log line."""

    dropped = 0  # lines lost to write errors, in this process

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except OSError:
            SparingPrintLogger.dropped += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class SparingPrintLoggerFactory:
    def __init__(self, file) -> None:
        self._file = file

    def __call__(self, *args) -> SparingPrintLogger:
        return SparingPrintLogger(self._file)


def configure(service: str, level: str = "info", json: bool = True, file=None) -> structlog.BoundLogger:
    """Log lines as JSON to `file` (stderr: `talaria up` sends it to the service's log file)."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    _redacting_stdlib_handler()
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
        logger_factory=SparingPrintLoggerFactory(file or sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(service=service)


def get(service: str) -> structlog.BoundLogger:
    return structlog.get_logger().bind(service=service)


def call_context(session_id: str, call_id: str):
    """Bind session, call and trace ids to every log line inside the `with` block."""
    return structlog.contextvars.bound_contextvars(
        session_id=session_id, call_id=call_id, trace_id=trace_id_hex(session_trace_id(session_id))
    )
