"""Typed, frozen settings, read once from the environment and validated with clear errors."""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from talaria.shared.ablations import ABLATIONS
from talaria.shared.api_keys import InvalidKeyEntry, parse_key_entry
from talaria.shared.catalog import BUILTIN_MODELS, Catalogue, ModelSpec
from talaria.shared.hf_config import CheckpointError, load_spec, parse_models
from talaria.shared.subjects import Deployment

# TALARIA_DTYPE's values (engine/dtypes.py decides what each means; named here so a bad one
# is refused at start-up, not when the engine thread builds its models).
DTYPES = ("auto", "float32", "bfloat16")


class SettingsError(ValueError):
    """A configuration value is missing or malformed; the message names the variable."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r}: expected {expected}")
        self.variable = variable
        self.value = value
        self.expected = expected


def async_database_url(url: str) -> str:
    """Accept plain `postgresql://` / `postgres://` URLs as well as SQLAlchemy ones."""
    for prefix in ("postgresql+asyncpg://", "postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    raise SettingsError("TALARIA_DATABASE_URL", url, "a postgresql:// URL")


def asyncpg_dsn(url: str) -> str:
    """The same URL in the form asyncpg itself accepts."""
    return "postgresql://" + async_database_url(url)[len("postgresql+asyncpg://") :]


def _default_instance_id() -> str:
    return f"agent-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class CommonSettings:
    """What every service needs: where the deployment's NATS and Postgres are, its name, how to
    authenticate, the models it serves, where its data and telemetry go."""

    # The named configuration every service runs (services/configs.py; TALARIA_POLICY is its
    # older alias) and knobs of it overridden by name, `knob=value` (TALARIA_CONFIG_SET)
    config: str = ""  # "": TALARIA_POLICY's, else talaria
    config_set: tuple[str, ...] = ()
    nats_url: str | None = None  # None: `talaria up` starts an embedded server; a cluster: comma-separated
    nats_replicas: int = 1  # replicas of each JetStream stream (3 on a 3-node cluster: one node may die)
    database_url: str | None = None  # None: `talaria up` starts an embedded PostgreSQL
    data_dir: Path = Path(".talaria")
    deployment: Deployment = Deployment()  # TALARIA_DEPLOYMENT: prefixes every NATS subject and stream
    nats_user: str | None = None  # NATS credentials: user+password, token, nkey seed file or creds file
    nats_password: str | None = None
    nats_token: str | None = None
    nats_nkey_seed: Path | None = None
    nats_creds: Path | None = None
    models: tuple[str, ...] = ("qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny")
    # Hugging Face directories among the models: TALARIA_MODELS entries `name=/path` (hf_config.py)
    model_dirs: tuple[tuple[str, str], ...] = ()
    log_level: str = "info"
    log_json: bool = True
    traces_dir: Path | None = None  # spans as JSON lines when no OTLP endpoint is set
    otlp_endpoint: str | None = None  # OTEL_EXPORTER_OTLP_ENDPOINT
    # GET /metrics (shared/metrics.py) on its own port for every service (the gateway also
    # serves it on its API port, behind an API key): unset = no listener, 0 = a free port
    # (logged and written to <data_dir>/metrics/<service>.url). Localhost unless configured.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if isinstance(self.deployment, str):  # `with_(deployment="blue")`
            object.__setattr__(self, "deployment", _deployment(self.deployment))
        names, dirs = parse_models(tuple(self.models))
        object.__setattr__(self, "models", names)
        object.__setattr__(self, "model_dirs", tuple({**dict(self.model_dirs), **dirs}.items()))

    @property
    def traces_path(self) -> Path:
        return self.traces_dir or (self.data_dir / "traces")

    def checkpoints(self) -> tuple[ModelSpec, ...]:
        """The Hugging Face checkpoints among the models, read from their directories."""
        specs = []
        for name, path in self.model_dirs:
            try:
                specs.append(load_spec(name, path))
            except CheckpointError as exc:
                raise SettingsError("TALARIA_MODELS", f"{name}={path}", f"a servable checkpoint: {exc}") from None
        return tuple(specs)

    def catalogue(self) -> Catalogue:
        """The models this deployment can name: the built-ins and its checkpoints. Reads the
        checkpoint directories, so a service builds it once at start and hands it on."""
        return BUILTIN_MODELS.with_(*self.checkpoints())

    def models_env(self) -> str:
        """TALARIA_MODELS for child processes: names, with `=path` for checkpoint directories."""
        dirs = dict(self.model_dirs)
        return ",".join(f"{m}={dirs[m]}" if m in dirs else m for m in self.models)

    def nats_options(self) -> dict[str, object]:
        """Keyword arguments for `nats.connect` that authenticate this service."""
        if self.nats_user:
            return {"user": self.nats_user, "password": self.nats_password}
        if self.nats_token:
            return {"token": self.nats_token}
        if self.nats_nkey_seed:
            return {"nkeys_seed": str(self.nats_nkey_seed)}
        if self.nats_creds:
            return {"user_credentials": str(self.nats_creds)}
        return {}

    def bus_options(self) -> dict[str, object]:
        """Keyword arguments for `bus.connect`: this deployment, its replicas and disk, the credentials."""
        return {"deployment": self.deployment, "replicas": self.nats_replicas, "data_dir": self.data_dir,
                **self.nats_options()}

    def validate(self) -> None:
        if self.database_url is not None:
            async_database_url(self.database_url)
        if self.nats_url is not None and not all(u.strip().startswith(("nats://", "tls://", "ws://", "wss://"))
                                                 for u in self.nats_url.split(",")):
            raise SettingsError("TALARIA_NATS_URL", self.nats_url, "a nats:// URL (a cluster's: comma-separated)")
        if not 1 <= self.nats_replicas <= 5:  # JetStream's limit
            raise SettingsError("TALARIA_NATS_REPLICAS", str(self.nats_replicas), "1 to 5 replicas")
        methods = [n for n in ("nats_user", "nats_token", "nats_nkey_seed", "nats_creds") if getattr(self, n)]
        if len(methods) > 1:
            raise SettingsError(f"TALARIA_{methods[1].upper()}", str(getattr(self, methods[1])),
                                f"one NATS credential, not both {methods[0]} and {methods[1]}")
        if self.nats_user and not self.nats_password:
            raise SettingsError("TALARIA_NATS_PASSWORD", "", "a password for TALARIA_NATS_USER")
        if self.nats_password and not self.nats_user:
            raise SettingsError("TALARIA_NATS_USER", "", "a user for TALARIA_NATS_PASSWORD")
        for name in ("nats_nkey_seed", "nats_creds"):
            _check_file(name, getattr(self, name))
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise SettingsError("TALARIA_METRICS_PORT", str(self.metrics_port), "a TCP port, or 0 for a free one")
        known = set(BUILTIN_MODELS) | {name for name, _ in self.model_dirs}
        unknown = [m for m in self.models if m not in known]
        if unknown or not self.models:
            raise SettingsError("TALARIA_MODELS", ",".join(self.models),
                                f"models from the catalogue ({', '.join(sorted(BUILTIN_MODELS))})")
        self.checkpoints()  # a directory that is no servable checkpoint fails at start


@dataclass(frozen=True)
class GatewaySettings:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    call_timeout_s: float = 300.0
    # How long an Idempotency-Key is remembered (gateway/idempotency.py): Stripe's 24 h. It must
    # outlast the call timeout, or a retry of a call still running could run it again.
    idempotency_window_s: float = 86400.0
    # A keyed call whose every waiting client went away runs this long for a retry to attach,
    # then is cancelled (gateway/idempotency.py). The openai and anthropic SDKs retry a dropped
    # connection after at most 8 s of backoff and give the new connection 5 s; 2 s more for the
    # retried request to reach a gateway and claim its key.
    idempotent_orphan_s: float = 15.0
    api_keys: tuple[str, ...] = ()  # `tenant:sha256:<hex>` (or `tenant:<key>`, hashed on load)
    api_keys_file: Path | None = None  # one `tenant sha256:<hex>` per line
    prefix_sharing: str = "tenant"  # KV prefix reuse scope: tenant, session or global
    # -- limits (issue 25; services/gateway/connection_limits.py) ---------------------------
    # Go's http.Server guidance (ReadHeaderTimeout ~10 s); nginx's client_body_timeout is 60 s.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0
    http_max_connections: int = 0  # 0: the open-file limit less what the gateway itself needs
    http_max_connections_per_address: int = 256  # an agent runtime's concurrent sessions, with room
    # Admission control (gateway/admission.py): the queueing delay accepted before new calls are
    # refused with Retry-After (the limit adapts online to keep calls under it); 0: never refused.
    admission_target_queue_s: float = 2.0
    min_free_disk_mb: int = 0  # new calls refused below this free on the data dir's disk; 0: 5%, <= 1 GiB
    # A call naming no session continues the live session it repeats (gateway/session_inference.py);
    # a session's turn is forgotten this long after its answer. 0: every such call is its own session.
    session_inference_horizon_s: float = 3600.0

    def validate(self) -> None:
        if not 0 < self.http_port < 65536 and self.http_port != 0:
            raise SettingsError("TALARIA_HTTP_PORT", str(self.http_port), "a TCP port")
        if self.call_timeout_s <= 0:
            raise SettingsError("TALARIA_CALL_TIMEOUT_S", str(self.call_timeout_s), "a positive number")
        if self.idempotent_orphan_s < 0:  # 0: no grace
            raise SettingsError("TALARIA_IDEMPOTENT_ORPHAN_S", str(self.idempotent_orphan_s), "zero or more seconds")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_max_connections_per_address"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"TALARIA_{name.upper()}", str(getattr(self, name)), "a positive number")
        for name in ("admission_target_queue_s", "min_free_disk_mb", "session_inference_horizon_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"TALARIA_{name.upper()}", str(getattr(self, name)), "zero or more")
        if self.http_max_connections < 0:
            raise SettingsError("TALARIA_HTTP_MAX_CONNECTIONS", str(self.http_max_connections),
                                "zero (the open-file limit) or a positive number")
        if self.idempotency_window_s <= self.call_timeout_s:
            raise SettingsError("TALARIA_IDEMPOTENCY_WINDOW_S", str(self.idempotency_window_s),
                                f"more seconds than TALARIA_CALL_TIMEOUT_S ({self.call_timeout_s:g})")
        _check_file("api_keys_file", self.api_keys_file)
        if self.prefix_sharing not in ("tenant", "session", "global"):
            raise SettingsError("TALARIA_PREFIX_SHARING", self.prefix_sharing, "tenant, session or global")
        for entry in self.api_keys:
            try:
                parse_key_entry(entry)
            except InvalidKeyEntry as exc:
                raise SettingsError("TALARIA_API_KEYS", _redact_key(entry), str(exc)) from None


@dataclass(frozen=True)
class RouterSettings:
    # Older spellings of the configuration's choices (services/configs.py); unset: the configuration's.
    policy: str = ""  # alias of TALARIA_CONFIG
    lease_timeout_s: float | None = None  # 0: no leases
    adaptive_lease: bool | None = None
    overload: str | None = None
    # The router sizes the hot pools from measured demand (services/router/hot_pools.py): it
    # tells cold agents which model to keep resident (PoolPinned); `--hot` agents stay fixed.
    hot_pools: bool = False
    # -- router replicas (docs/operating.md "More than one router"; services/router/ownership.py) -------------
    # The routers of a deployment split the sessions: 64 session slots grouped into this many
    # partitions (a divisor of 64; every router must agree: checked against the KV bucket), each
    # owned by one router through a KV key that expires this long after its last renewal (6
    # service heartbeats: a dead router's partitions are taken over within about that long).
    router_partitions: int = 8
    router_ownership_ttl_s: float = 3.0
    router_id: str = ""  # "": a fresh id per process; a restart under the same id adopts its claims
    # Memory the session table may take (services/router/state.py: SESSION_ROW_BYTES a row,
    # measured); past it the least recently routed idle sessions are forgotten.
    router_session_table_bytes: int = 128 << 20

    def validate(self) -> None:
        if self.router_session_table_bytes < 1 << 20:
            raise SettingsError("TALARIA_ROUTER_SESSION_TABLE_BYTES", str(self.router_session_table_bytes),
                                "at least 1 MiB (1048576)")
        if self.overload is not None and self.overload not in ("reject", "queue"):
            raise SettingsError("TALARIA_OVERLOAD", self.overload, "reject or queue")
        if self.router_partitions < 1 or 64 % self.router_partitions:
            raise SettingsError("TALARIA_ROUTER_PARTITIONS", str(self.router_partitions), "a divisor of 64")
        if self.router_ownership_ttl_s <= 0:
            raise SettingsError("TALARIA_ROUTER_OWNERSHIP_TTL_S", str(self.router_ownership_ttl_s),
                                "a positive number")
        if self.router_id and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.router_id):
            raise SettingsError("TALARIA_ROUTER_ID", self.router_id, "1-64 letters, digits, '_' or '-'")
        if self.lease_timeout_s is not None and self.lease_timeout_s < 0:
            raise SettingsError("TALARIA_LEASE_TIMEOUT_S", str(self.lease_timeout_s), "a positive number")


@dataclass(frozen=True)
class AgentSettings:
    instance_id: str = field(default_factory=_default_instance_id)
    pool: str = "cold"
    engine: str = "torch"  # engine/engine_registry.py; an unknown name fails the agent at start
    device: str = "cpu"
    # weights and KV type, every engine: auto (the checkpoint's where the hardware computes it
    # natively, engine/dtypes.py) | float32 | bfloat16
    dtype: str = ""
    ablation: str = ""  # which of Talaria's mechanisms are on (shared/ablations.py); "": the configuration's
    heartbeat_s: float = 0.5
    watchdog_min_s: float = 10.0  # the agent watchdog's floor for "stuck" (services/instance_agent/watchdog.py)
    torch_threads: int = 1
    # TALARIA_ENGINE=vllm / sglang (docs/engines.md); 0 or "": the adapter's default
    vllm_switch: str = ""  # resident | sleep | release
    vllm_kv_bytes: int = 0  # KV cache per model on CPU
    vllm_host_kv_bytes: int = 0  # the KV connector's host pages per model
    vllm_max_model_len: int = 0
    vllm_block: int = 0
    vllm_batch_tokens: int = 0
    sglang_switch: str = ""  # memory | weights
    # KV page server peers pull a moved session's pages from (docs/migration.md); port 0: any free
    page_host: str = "127.0.0.1"
    page_port: int = 0
    # how the page bytes move: auto (Mooncake's transfer engine where it imports and starts, else
    # TCP) | tcp; Mooncake's protocol (tcp | rdma) and its RDMA NICs ("": its own discovery)
    page_transport: str = "auto"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""

    def engine_options(self) -> dict[str, object]:
        """The chosen engine's own options, as its constructor takes them (unset ones left out)."""
        if self.engine == "vllm":
            opts = {"switch_mode": self.vllm_switch, "kv_cache_bytes": self.vllm_kv_bytes,
                    "host_kv_bytes": self.vllm_host_kv_bytes, "max_model_len": self.vllm_max_model_len,
                    "block_size": self.vllm_block, "max_num_batched_tokens": self.vllm_batch_tokens}
        elif self.engine == "sglang":
            opts = {"switch_mode": self.sglang_switch}
        else:
            opts = {}
        opts["dtype"] = self.dtype
        return {k: v for k, v in opts.items() if v}

    def validate(self) -> None:
        if self.ablation and self.ablation not in ABLATIONS:
            raise SettingsError("TALARIA_ABLATION", self.ablation, f"one of {', '.join(ABLATIONS)}")
        if self.pool not in ("hot", "cold"):
            raise SettingsError("TALARIA_POOL", self.pool, "hot or cold")
        if not 0 <= self.page_port <= 65535:
            raise SettingsError("TALARIA_PAGE_PORT", str(self.page_port), "a TCP port, or 0 for a free one")
        if self.page_transport not in ("auto", "tcp"):
            raise SettingsError("TALARIA_PAGE_TRANSPORT", self.page_transport, "auto or tcp")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise SettingsError("TALARIA_MOONCAKE_PROTOCOL", self.mooncake_protocol, "tcp or rdma")
        if self.dtype and self.dtype.lower() not in DTYPES:
            raise SettingsError("TALARIA_DTYPE", self.dtype, f"one of {', '.join(DTYPES)}")
        for name in ("heartbeat_s", "watchdog_min_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"TALARIA_{name.upper()}", str(getattr(self, name)), "a positive number")


@dataclass(frozen=True)
class TelemetrySettings:
    session_idle_s: float = 60.0  # a session's span closes after this long without a call
    # After a batch that did not fill, telemetry waits this long before fetching the next, so
    # it wakes once per interval, not once per event (rows lag by about this much more; a
    # backlog is projected without waiting).
    projection_interval_s: float = 0.1

    def validate(self) -> None:
        if self.session_idle_s <= 0:
            raise SettingsError("TALARIA_SESSION_IDLE_S", str(self.session_idle_s), "a positive number")
        if self.projection_interval_s < 0:  # 0: no wait
            raise SettingsError("TALARIA_PROJECTION_INTERVAL_S", str(self.projection_interval_s),
                                "zero or more seconds")


@dataclass(frozen=True)
class CliSettings:
    """The `talaria` command's own: what only an operator's or a client's tool uses."""

    database_admin_url: str | None = None  # `talaria migrate`: sets up the application role first
    api_key: str | None = None  # a client's own key (`talaria replay --nats` against a running stack)


PARTS = {"common": CommonSettings, "gateway": GatewaySettings, "router": RouterSettings,
         "agent": AgentSettings, "telemetry": TelemetrySettings, "cli": CliSettings}
# Each field's part: field names are unique across the parts, and TALARIA_<NAME> is its variable.
_PART_OF = {f.name: part for part, cls in PARTS.items() for f in fields(cls)}
ENV_NAMES = {"otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT"}


def env_var(name: str) -> str:
    """The environment variable of a settings field."""
    return ENV_NAMES.get(name, f"TALARIA_{name.upper()}")


@dataclass(frozen=True)
class Settings:
    """A deployment's whole configuration, read from the environment in one place (`from_env`);
    each service is handed `common` and its own part, never the others'."""

    common: CommonSettings = field(default_factory=CommonSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    cli: CliSettings = field(default_factory=CliSettings)

    @classmethod
    def of(cls, **values) -> "Settings":
        """Settings from field names, whatever part each belongs to (the rest default)."""
        return cls().with_(**values)

    def with_(self, **changes) -> "Settings":
        """A copy with fields changed by name (each routed to its part)."""
        by_part: dict[str, dict[str, object]] = {}
        for name, value in changes.items():
            if name not in _PART_OF:
                raise TypeError(f"no setting named {name!r}")
            by_part.setdefault(_PART_OF[name], {})[name] = value
        return replace(self, **{part: replace(getattr(self, part), **vals) for part, vals in by_part.items()})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        parts = {}
        for part, part_cls in PARTS.items():
            values: dict[str, object] = {}
            for f in fields(part_cls):
                if f.name == "model_dirs":  # filled from TALARIA_MODELS' name=/path entries
                    continue
                var = env_var(f.name)
                raw = env.get(var)
                if raw is None or raw == "":
                    continue
                values[f.name] = _parse(var, raw, f.type)
            parts[part] = part_cls(**values)
        settings = cls(**parts)
        settings.validate()
        return settings

    def validate(self) -> None:
        for part in PARTS:
            validate = getattr(getattr(self, part), "validate", None)
            if validate is not None:
                validate()
        if self.agent.pool == "hot" and len(self.common.models) != 1:
            raise SettingsError("TALARIA_MODELS", ",".join(self.common.models), "exactly one model on a hot instance")


def _deployment(name: str) -> Deployment:
    try:
        return Deployment(name)
    except ValueError:
        raise SettingsError("TALARIA_DEPLOYMENT", name,
                            "1-32 lowercase letters, digits, '_' or '-', starting with a letter") from None


def _check_file(name: str, path: Path | None) -> None:
    if path is not None and not Path(path).is_file():
        raise SettingsError(f"TALARIA_{name.upper()}", str(path), "an existing file")


def _redact_key(entry: str) -> str:
    tenant, _, rest = entry.partition(":")
    return f"{tenant}:{'sha256:…' if rest.startswith('sha256:') else '…'}"


def redact_url(url: str | None) -> str | None:
    """The URL with its password replaced by '***' (for logs and printed output)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def _parse(var: str, raw: str, typ: object) -> object:
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if name == "Deployment":
        return _deployment(raw)  # its own error, saying what a name may hold
    try:
        if name.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if name.startswith("int"):
            return int(raw)
        if name.startswith("float"):
            return float(raw)
        if name.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if "Path" in name:
            return Path(raw)

        return raw
    except ValueError:
        raise SettingsError(var, raw, name.replace(" | None", "")) from None
