"""Gateway: OpenAI-compatible HTTP and the NATS request API; validates and submits calls."""
