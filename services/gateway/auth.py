"""API keys and tenants: the one check every client-facing API calls (OpenAI HTTP, an
Anthropic-style API, the NATS API).

A key is only ever stored as its SHA-256 hash (`TALARIA_API_KEYS`, `TALARIA_API_KEYS_FILE`;
the entry format is shared/api_keys.py), bound to one tenant. A presented key is hashed and
looked up; unknown, missing or malformed keys raise `Unauthenticated`, which each API renders in its own error shape (401). With no
keys configured the gateway is open and every call belongs to the empty tenant "".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web

from talaria.services.gateway.error_bodies import anthropic_error_body, error_body
from talaria.shared.api_keys import hash_key, parse_key_entry, read_key_file
from talaria.shared.messages import ErrorReply

SCOPE_SEPARATOR = ":"  # tenant names cannot contain it, so `tenant:session` is unambiguous


class Unauthenticated(Exception):
    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.message = message
        self.status = status  # 400: a malformed request (two keys), not a wrong key


CREDENTIAL_HEADERS = ("Authorization", "x-api-key")


@dataclass
class KeyStore:
    tenants: dict[str, str] = field(default_factory=dict)  # key hash -> tenant

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    @classmethod
    def from_settings(cls, settings) -> "KeyStore":
        entries = [parse_key_entry(e) for e in settings.api_keys]
        if settings.api_keys_file is not None:
            entries += read_key_file(settings.api_keys_file)
        return cls({digest: tenant for tenant, digest in entries})

    def tenant_for_key(self, key: str | None) -> str:
        """The key's tenant; "" when no keys are configured."""
        if not self.enabled:
            return ""
        if not key:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        try:
            tenant = self.tenants.get(hash_key(key))
        except UnicodeEncodeError:  # invalid UTF-8 in the header (aiohttp keeps it as surrogates)
            raise Unauthenticated("malformed API key: not valid UTF-8") from None
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant

    def tenant_for(self, headers: Mapping[str, str]) -> str:
        """From `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key` (Anthropic-style).
        A header sent twice is refused: proxies and servers disagree on which copy counts."""
        getall = getattr(headers, "getall", None) if self.enabled else None
        for name in CREDENTIAL_HEADERS:
            if getall is not None and len(getall(name, ())) > 1:
                raise Unauthenticated(f"the `{name}` header is sent more than once; send one", status=400)
        key = headers.get("x-api-key") or headers.get("X-Api-Key")
        auth = headers.get("Authorization") or headers.get("authorization")
        if auth:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthenticated("the Authorization header must be `Bearer <key>`")
            key = value.strip()
        return self.tenant_for_key(key)


def scoped_session(tenant: str, session_id: str | None) -> str | None:
    """The session id as services see it: the same header value from two tenants is two
    sessions. None (the client named none) stays None."""
    if session_id is None:
        return None
    return f"{tenant}{SCOPE_SEPARATOR}{session_id}" if tenant else session_id


def client_session(tenant: str, session_id: str) -> str:
    """The session id as the client sent it."""
    prefix = f"{tenant}{SCOPE_SEPARATOR}" if tenant else ""
    return session_id[len(prefix):] if prefix and session_id.startswith(prefix) else session_id


def kv_scope(sharing: str, tenant: str, session_id: str) -> str:
    """The salt of a call's KV block hashes: prefix reuse happens only between calls with the
    same scope (`tenant`: a tenant's own sessions; `session`: one session; `global`: everyone)."""
    if sharing == "global":
        return ""
    if sharing == "session":
        return f"session{SCOPE_SEPARATOR}{session_id}"
    return f"tenant{SCOPE_SEPARATOR}{tenant}" if tenant else ""


def unauthenticated_reply(exc: Unauthenticated) -> ErrorReply:
    if exc.status == 400:
        return ErrorReply(400, "duplicate_header", exc.message)
    return ErrorReply(401, "invalid_api_key", exc.message)


# /metrics is not open here: on the API port it takes a key; open, it has its own listener
# (TALARIA_METRICS_PORT, on localhost by default).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
try:
    from aiohttp.web import RequestKey

    TENANT = RequestKey("tenant", str)
except ImportError:  # older aiohttp: plain string keys
    TENANT = "tenant"


def http_middleware(keys: KeyStore):
    """aiohttp middleware: every path but /healthz and /readyz needs a key when keys are configured; the
    tenant lands in `request[TENANT]`. 401s (and a doubled key header's 400) use the shape of the API the
    path belongs to."""
    @web.middleware
    async def authenticate(request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        try:
            request[TENANT] = keys.tenant_for(request.headers)
        except Unauthenticated as exc:
            if request.path.startswith("/v1/messages"):
                body = anthropic_error_body(exc.status, exc.message)
            else:
                body = error_body(unauthenticated_reply(exc))
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            return web.json_response(body, status=exc.status, headers=headers)
        return await handler(request)

    return authenticate
