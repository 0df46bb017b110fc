"""Prometheus metrics: every series Talaria exports, defined here and nowhere else.

Names follow the peers so their dashboards carry over: the gateway's `talaria_frontend_*`
mirror Dynamo's `dynamo_frontend_*` (lib/llm/src/http/service/metrics.rs: requests_total,
inflight_requests, request_duration_seconds, time_to_first_token_seconds,
inter_token_latency_seconds, input/output_sequence_tokens, cached_tokens); an agent's
engine series mirror vLLM's `vllm:*` (vllm/v1/metrics/loggers.py: prompt_tokens_total,
generation_tokens_total, num_requests_running/waiting, request_queue_time_seconds,
time_to_first_token_seconds, kv_cache_usage_perc) under `talaria_agent_`.

Labels are bounded: model, instance_id, outcome, status, path, phase, tier. Never a session
or call id (one series per session would grow without end). `instance_id`, not `instance`:
Prometheus sets `instance` on every scraped series itself (the target's host:port). How a
service fills and serves its registry: `ServiceMetrics`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoundSummary,
    RoutingDecision,
    SwitchDone,
)
from talaria.shared.events import Event

# No `*_created` series: every service starts its counters with the process, and the extra
# series doubles what Prometheus stores for them.
disable_created_metrics()

# Seconds: 1 ms .. 5 min, log-spaced (a tiny CPU model's decode step is ~5 ms; a cold open or
# a call queued behind a long round is tens of seconds; the call timeout is 300 s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
# Sub-millisecond work (a routing decision, one engine step): 10 us .. 1 s.
FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
# Tokens per request: powers of 4 up to 1M (agentic prompts grow to the context length).
TOKEN_BUCKETS = tuple(float(4 ** k) for k in range(11))

# Ids remembered to count a retried record once (an agent republishes an unacked record).
SEEN_MEMORY = 4096


class ScrapeGauges(Collector):
    """Gauges read at scrape time from `read()` -> {label values: value}: the state a service
    already holds (leases, sessions' KV), never a second copy to keep in step."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], read: Callable[[], dict]) -> None:
        self.name, self.doc, self.labels, self.read = name, doc, labels, read

    def describe(self):
        return [GaugeMetricFamily(self.name, self.doc, labels=self.labels)]

    def collect(self):
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
        try:
            values = self.read()
        except Exception:  # a torn read of tables another thread writes: no sample this scrape
            values = {}
        for key, value in values.items():
            family.add_metric(list(key), float(value))
        yield family


class ServiceMetrics:
    """One service's registry; `render()` is the body of `GET /metrics`.

    Each service owns its own registry (tests run several services in one process), fills it
    from what it already computes (events it emits or folds, timings it measured) and serves it
    on `GET /metrics` (the gateway on its API port, the others on a small listener:
    `serve`). What an event means for a metric is decided in the `observe` methods, pure over
    the event, so the live services and the unit tests share them.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, doc, tuple(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, doc, tuple(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: Iterable[str] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, tuple(labels), buckets=buckets, registry=self.registry)

    def scrape_gauge(self, name: str, doc: str, labels: tuple[str, ...], read: Callable[[], dict]) -> None:
        self.registry.register(ScrapeGauges(name, doc, labels, read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Seen:
    """A bounded memory of ids: the first `add` of an id is True, a repeat False."""

    def __init__(self, size: int = SEEN_MEMORY) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def add(self, key: str) -> bool:
        if key in self._ids:
            return False
        self._ids[key] = None
        while len(self._ids) > self._size:
            self._ids.popitem(last=False)
        return True


# ---- gateway (frontend) -------------------------------------------------------------------


class FrontendMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        m = ("model",)
        self.requests = self.counter("talaria_frontend_requests_total",
                                     "Calls answered, by model, API and HTTP status", ("model", "endpoint", "status"))
        self.inflight = self.gauge("talaria_frontend_inflight_requests", "Calls submitted and not yet answered", m)
        self.duration = self.histogram("talaria_frontend_request_duration_seconds",
                                       "Submission to answer, as the gateway saw it", m)
        self.ttft = self.histogram("talaria_frontend_time_to_first_token_seconds",
                                   "Submission to first token: its arrival at the gateway for a streamed call, "
                                   "the agent's first-token time (from submission) otherwise", m)
        self.itl = self.histogram("talaria_frontend_inter_token_latency_seconds",
                                  "Between streamed tokens at the gateway (a non-streamed call: its mean)", m,
                                  buckets=FAST_BUCKETS + (2.5, 5.0))
        self.input_seq = self.histogram("talaria_frontend_input_sequence_tokens", "Prompt tokens per call", m,
                                        buckets=TOKEN_BUCKETS)
        self.output_seq = self.histogram("talaria_frontend_output_sequence_tokens", "Generated tokens per call", m,
                                         buckets=TOKEN_BUCKETS)
        self.cached_seq = self.histogram("talaria_frontend_cached_tokens",
                                         "Prompt tokens per call whose KV was reused (not computed)", m,
                                         buckets=TOKEN_BUCKETS)
        self.input_tokens = self.counter("talaria_frontend_input_tokens_total", "Prompt tokens of answered calls", m)
        self.output_tokens = self.counter("talaria_frontend_output_tokens_total", "Generated tokens", m)
        self.cached_tokens = self.counter("talaria_frontend_cached_input_tokens_total", "Prompt tokens reused from KV", m)
        self.sessions_inferred = self.counter(
            "talaria_frontend_inferred_sessions_total",
            "Calls that named no session, by what the gateway inferred: a new session, a continuation "
            "merged into a live one, or a fork of one", ("outcome",))
        self.http = self.counter("talaria_frontend_http_responses_total",
                                 "Every HTTP response by route and status, refusals before submission included "
                                 "(400, 401, 404, 413)", ("route", "status"))

    def http_middleware(self):
        """aiohttp middleware counting every response by its route's pattern (bounded: never
        the raw path) and status."""
        from aiohttp import web

        @web.middleware
        async def count(request, handler):
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            except asyncio.CancelledError:  # the client went away
                status = 499
                raise
            finally:
                resource = request.match_info.route.resource
                route = resource.canonical if resource is not None else "unmatched"
                self.http.labels(route, str(status)).inc()

        return count

    def call(self, model: str, endpoint: str, started: float | None = None) -> "FrontendCall":
        return FrontendCall(self, model, endpoint, time.monotonic() if started is None else started)


class FrontendCall:
    """One call's timeline at the gateway: `token()` per streamed chunk, `answered()` once."""

    def __init__(self, metrics: FrontendMetrics, model: str, endpoint: str, started: float) -> None:
        self.m, self.model, self.endpoint, self.started = metrics, model, endpoint, started
        self.first: float | None = None
        self.last: float | None = None
        self.done = False
        self._itl = metrics.itl.labels(model)  # looked up once: it is observed per token
        metrics.inflight.labels(model).inc()

    def token(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            self.m.ttft.labels(self.model).observe(now - self.started)
        elif self.last is not None:
            self._itl.observe(now - self.last)
        self.last = now

    def answered(self, status: int, usage=None, timings=None, now: float | None = None) -> None:
        """`usage`/`timings`: the CallResult's (None for an error answer)."""
        if self.done:
            return
        self.done = True
        now = time.monotonic() if now is None else now
        model, m = self.model, self.m
        m.inflight.labels(model).dec()
        m.requests.labels(model, self.endpoint, str(status)).inc()
        m.duration.labels(model).observe(now - self.started)
        if usage is None:
            return
        m.input_seq.labels(model).observe(usage.prompt_tokens)
        m.output_seq.labels(model).observe(usage.completion_tokens)
        m.cached_seq.labels(model).observe(usage.cached_tokens)
        m.input_tokens.labels(model).inc(usage.prompt_tokens)
        m.output_tokens.labels(model).inc(usage.completion_tokens)
        m.cached_tokens.labels(model).inc(usage.cached_tokens)
        if self.first is None and timings is not None:  # not streamed: the agent's timeline
            m.ttft.labels(model).observe(max(0.0, timings.ttft_s))
            if usage.completion_tokens > 1:
                m.itl.labels(model).observe(timings.decode_s / (usage.completion_tokens - 1))


# ---- router -------------------------------------------------------------------------------


def decision_path(d: RoutingDecision) -> str:
    """How a decision placed its call: on a lease (the session's reserved instance), where the
    session's KV is (device / host), with a cold model open, or by cost alone."""
    if d.action != "route":
        return "none"
    if d.lease_outcome == "consumed":
        return "lease"
    if d.expected_kv in ("device", "host", "migrated"):
        return f"kv_{d.expected_kv}"
    if d.model_opened:
        return "cold_open"
    return "cost"


PEER_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class RouterMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.decisions = self.counter("talaria_router_decisions_total", "Routing decisions by outcome and path",
                                      ("model", "outcome", "path"))
        self.cold_opens = self.counter("talaria_router_cold_opens_total",
                                       "Decisions that open a model on an instance (avoidable: a placement "
                                       "with the model resident existed)", ("model", "avoidable"))
        self.lease_events = self.counter("talaria_router_lease_events_total",
                                         "Lease transitions: issued, consumed, discarded, expired",
                                         ("model", "outcome"))
        self.phase = self.histogram("talaria_router_decision_seconds",
                                    "Time per routed call by phase: decide (policy), dispatch (fast copy to "
                                    "the agent), store (stream acks of the decision's events)",
                                    ("phase",), buckets=FAST_BUCKETS)
        self.queue_error = self.histogram("talaria_router_queue_estimate_error_seconds",
                                          "|predicted - measured| queue wait of a routed call, by direction "
                                          "(over: predicted more than it waited)", ("model", "direction"))
        self.predicted: OrderedDict[str, tuple[str, float]] = OrderedDict()  # call id -> (model, queue_s)
        self.checkpoint = self.histogram("talaria_router_checkpoint_seconds",
                                         "Time per state checkpoint to Postgres: encoding (the router waits) "
                                         "and write; saves space out past 5 % of the router's time")
        # Router replicas (services/router/ownership.py)
        self.takeovers = self.counter("talaria_router_partition_takeovers",
                                      "Intake partitions this router started consuming, by how (claimed, adopted)",
                                      ("how",))
        self.peer_lag = self.histogram("talaria_router_peer_placement_lag_seconds",
                                       "From another router's decision to this router folding its routed call "
                                       "(what a stale view lags by)", (), buckets=PEER_LAG_BUCKETS)

    def observe(self, event) -> None:
        """An event the router emitted (a decision, a lease transition) or folded (a completion)."""
        match event:
            case RoutingDecision():
                self.decisions.labels(event.model, event.action, decision_path(event)).inc()
                if event.model_opened:
                    self.cold_opens.labels(event.model, str(event.avoidable_cold_open).lower()).inc()
                chosen = next((c for c in event.candidates if c.instance_id == event.chosen), None)
                if event.action == "route" and chosen is not None:
                    self.predicted[event.call_id] = (event.model, chosen.queue_s)
                    while len(self.predicted) > SEEN_MEMORY:
                        self.predicted.popitem(last=False)
            case LeaseIssued():
                self.lease_events.labels(event.model, "issued").inc()
            case LeaseConsumed():
                self.lease_events.labels(event.model, "consumed").inc()
            case LeaseDiscarded():
                self.lease_events.labels(event.model, "discarded").inc()
            case LeaseExpired():
                self.lease_events.labels(event.model, "expired").inc()
            case CallCompleted():
                guess = self.predicted.pop(event.call_id, None)
                if guess is not None:
                    err = guess[1] - event.queue_s
                    self.queue_error.labels(guess[0], "over" if err >= 0 else "under").observe(abs(err))
            case CallFailed():
                self.predicted.pop(event.call_id, None)

    def observe_all(self, events) -> None:
        for event in events:
            self.observe(event)


# ---- instance agent -------------------------------------------------------------------------


class AgentMetrics(ServiceMetrics):
    def __init__(self, instance_id: str) -> None:
        super().__init__()
        self.instance_id = instance_id
        i, im = ("instance_id",), ("instance_id", "model")
        self.calls = self.counter("talaria_agent_calls_total", "Calls that ended here, by outcome",
                                  ("instance_id", "model", "outcome"))
        self.kv_source = self.counter("talaria_agent_call_kv_source_total",
                                      "Where a completed call's prompt prefix came from: device (kept), host "
                                      "(HKVR restore), migrated (pulled from another instance), recompute (evicted, computed again), "
                                      "none (new)",
                                      ("instance_id", "model", "source"))
        self.prompt_tokens = self.counter("talaria_agent_prompt_tokens_total", "Prompt tokens of completed calls", im)
        self.generation_tokens = self.counter("talaria_agent_generation_tokens_total", "Generated tokens", im)
        self.queue_time = self.histogram("talaria_agent_request_queue_time_seconds",
                                         "Submission to start of its prefill", im)
        self.ttft = self.histogram("talaria_agent_time_to_first_token_seconds", "Submission to first token", im)
        self.round = self.histogram("talaria_agent_round_seconds",
                                    "Round length by part: wall, active (engine work), switch", i + ("part",))
        self.switch = self.histogram("talaria_agent_switch_seconds", "Model switch time by path",
                                     i + ("path",))
        self.step = self.histogram("talaria_agent_engine_step_seconds", "Engine steps by kind", i + ("kind",),
                                   buckets=FAST_BUCKETS + (2.5, 5.0, 10.0, 30.0))
        self._seen = _Seen()
        self._steps: dict[str, object] = {}  # kind -> its histogram child (observed per step)

    def observe(self, event) -> None:
        """An event this agent emitted."""
        iid = self.instance_id
        match event:
            case CallCompleted():
                if not self._seen.add(event.call_id):
                    return  # a record stored again after a lost ack
                self.calls.labels(iid, event.model, "completed").inc()
                self.kv_source.labels(iid, event.model, event.kv_source).inc()
                self.prompt_tokens.labels(iid, event.model).inc(event.prompt_tokens)
                self.generation_tokens.labels(iid, event.model).inc(event.output_tokens)
                self.queue_time.labels(iid, event.model).observe(max(0.0, event.queue_s))
                self.ttft.labels(iid, event.model).observe(max(0.0, event.ttft_s))
            case CallFailed():
                if self._seen.add(event.call_id):
                    self.calls.labels(iid, event.model, "cancelled" if event.status == 499 else "failed").inc()
            case RoundSummary():
                self.round.labels(iid, "wall").observe(event.wall_s)
                self.round.labels(iid, "active").observe(event.active_s)
                self.round.labels(iid, "switch").observe(event.switch_s)
            case SwitchDone():
                self.switch.labels(iid, event.path).observe(event.total_s)

    def engine_step(self, kind: str, seconds: float) -> None:
        child = self._steps.get(kind)
        if child is None:
            child = self._steps[kind] = self.step.labels(self.instance_id, kind)
        child.observe(seconds)

    def snapshot_gauges(self, snapshot: Callable[[], object]) -> None:
        """Gauges from the agent's own snapshot (what its heartbeat reports), read per scrape."""
        iid = self.instance_id

        def kv_tiers() -> dict:
            tiers = {"device": 0, "host": 0}
            for s in snapshot().sessions:
                tiers[s.state] = tiers.get(s.state, 0) + s.kv_tokens
            return {(iid, tier): n for tier, n in tiers.items()}

        def load() -> dict:
            snap = snapshot()
            return {(iid, "running"): snap.running, (iid, "waiting"): sum(snap.queued.values())}

        def usage() -> dict:
            snap = snapshot()
            return {(iid,): snap.kv_used_tokens / snap.kv_capacity_tokens} if snap.kv_capacity_tokens else {}

        self.scrape_gauge("talaria_agent_session_kv_tokens", "Sessions' KV tokens held, by tier",
                          ("instance_id", "tier"), kv_tiers)
        self.scrape_gauge("talaria_agent_num_requests", "Calls running in the engine or waiting for it",
                          ("instance_id", "state"), load)
        self.scrape_gauge("talaria_agent_kv_cache_usage_perc", "Fraction of the device KV capacity in use",
                          ("instance_id",), usage)


# ---- telemetry ------------------------------------------------------------------------------


class TelemetryMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.lag = self.gauge("talaria_telemetry_projection_lag_seconds",
                              "Stream time of the newest projected event to its commit in Postgres")
        self.delay = self.histogram("talaria_telemetry_projection_delay_seconds",
                                    "Per batch: its oldest event's stream time to the batch's commit")
        self.pending = self.gauge("talaria_telemetry_events_pending",
                                  "Events in the stream not yet delivered to the projector")
        self.projected = self.counter("talaria_telemetry_events_projected_total", "Events committed to Postgres",
                                      ("type",))
        self.batches = self.counter("talaria_telemetry_batches_total", "Batches committed")

    def committed(self, msgs, now: float | None = None) -> None:
        """A batch of JetStream messages is committed (their metadata: stream time, pending)."""
        if not msgs:
            return
        now = time.time() if now is None else now
        stamps = [m.metadata.timestamp.timestamp() for m in msgs if m.metadata.timestamp is not None]
        if stamps:
            self.lag.set(max(0.0, now - max(stamps)))
            self.delay.observe(max(0.0, now - min(stamps)))
        self.pending.set(msgs[-1].metadata.num_pending or 0)
        self.batches.inc()
        for m in msgs:
            self.projected.labels(event_type(m.subject)).inc()


def _tags() -> tuple[str, ...]:
    return tuple(sorted((t.__struct_config__.tag for t in Event.__args__), key=len, reverse=True))


EVENT_TAGS = _tags()  # longest first: `call.routed` before a shorter tag it starts with


def event_type(subject: str) -> str:
    """The event type of a stream subject (`<deployment>.evt.<tag>[.<instance>]`): bounded by
    the event types, never an instance id; "other" for a subject no event type owns."""
    rest = subject.split(".evt.", 1)[-1]
    return next((t for t in EVENT_TAGS if rest == t or rest.startswith(t + ".")), "other")


# ---- the listener ---------------------------------------------------------------------------


def handler(metrics: ServiceMetrics):
    """An aiohttp handler serving `metrics` (the gateway mounts it on its API app)."""
    from aiohttp import web

    async def serve_metrics(request: web.Request) -> web.Response:
        resp = web.Response(body=metrics.render())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    return serve_metrics


async def serve(metrics: ServiceMetrics, name: str, settings, log):
    """`GET /metrics` on its own port (TALARIA_METRICS_PORT: unset = off, 0 = a free port); the
    runner to clean up, or None when off. Where it listens is logged and written to
    <data_dir>/metrics/<name>.url for a port chosen by the OS (name: `telemetry`, an agent's
    instance id, a router's id: the names stack.json uses)."""
    if settings.metrics_port is None:
        return None
    from aiohttp import web

    app = web.Application()
    app.add_routes([web.get("/metrics", handler(metrics))])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.metrics_host, settings.metrics_port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{settings.metrics_host}:{port}/metrics"
    try:
        where = settings.data_dir / "metrics"
        where.mkdir(parents=True, exist_ok=True)
        (where / f"{name}.url").write_text(url + "\n")
    except OSError as exc:  # a read-only data dir: the log still says where
        log.warning("could not record the metrics address", error=str(exc))
    log.info("metrics listening", url=url)
    return runner

