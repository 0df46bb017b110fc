"""Session traces: the normalised JSONL format, converters, and gap models.

- `format`  — `TraceCall`/`Session`, `load_trace` (validated, errors name line and field).
- `weka`    — streaming converter from the WEKA kv-cache-tester traces.
- `gaps`    — recorded / rescaled / paper-lognormal gap models.
"""

from talaria.traces.format import Session, TraceCall, TraceFormatError, load_trace
from talaria.traces.gaps import GapModel, parse_gap_model

__all__ = ["GapModel", "Session", "TraceCall", "TraceFormatError", "load_trace", "parse_gap_model"]
