"""Session traces: the normalised JSONL format, converters, and gap models.

- `format`  — `TraceCall`/`Session`, validated line by line (errors name line and field).
- `load`    — `load_trace`: a normalised file, or a raw WEKA one converted on the way in.
- `weka`    — streaming converter from the WEKA kv-cache-tester traces.
- `gaps`    — recorded / rescaled / paper-lognormal gap models.
"""

from talaria.traces.format import Session, TraceCall, TraceFormatError
from talaria.traces.load import load_trace
from talaria.traces.gaps import GapModel, parse_gap_model

__all__ = ["GapModel", "Session", "TraceCall", "TraceFormatError", "load_trace", "parse_gap_model"]
