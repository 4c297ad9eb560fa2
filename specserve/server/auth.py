"""Who is calling: the API keys, the admin key, and what each may do.

- ``--api-key K1[,K2,...]``: the client keys. Each key is a separate client (its own rid namespace: a client can
  abort only its own requests, and reusing another client's live rid neither collides nor reveals it).
  Unset: the client endpoints are open and every caller is the one anonymous client.
- ``--admin-api-key A``: the admin. It opens every endpoint, and is the only key for the admin endpoints
  (``/flush_cache``; ``/abort_request`` with ``abort_all`` or another client's rid) and for paths and pids in
  ``/get_server_info``, ``/get_model_info`` and ``/v1/models``. Unset: every holder of a client key is an admin
  (no key at all: every caller is), as in SGLang.
- ``/health``, ``/health_generate`` and ``/metrics`` need no key (load balancers and scrapers).

The middleware resolves the bearer key into a ``Caller`` kept in the ASGI scope's state; handlers read it with
``caller(request)``. Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from specserve.server.errors import APIError, error_response

PUBLIC_PREFIXES = ("/health", "/metrics")  # /health and /health_generate; SGLang leaves them open too


@dataclass(frozen=True)
class Caller:
    principal: str | None  # the client's rid namespace ("admin", a key's tag, or None: the anonymous client)
    admin: bool


OPEN = Caller(None, True)  # no keys configured: everyone may do everything


class Keys:
    """The configured keys, as the exact ``Authorization`` header values they are sent in."""

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self.clients = [(f"Bearer {k.strip()}".encode(), _tag(k.strip())) for k in (api_key or "").split(",")
                        if k.strip()]
        self.admin = f"Bearer {admin_api_key}".encode() if admin_api_key else None

    @property
    def configured(self) -> bool:
        return bool(self.clients) or self.admin is not None

    def resolve(self, header: bytes) -> Caller | None:
        """The caller behind an Authorization header; None when the header opens nothing (401)."""
        if self.admin is not None and hmac.compare_digest(header, self.admin):
            return Caller("admin", True)
        for expected, tag in self.clients:
            if hmac.compare_digest(header, expected):
                return Caller(tag, self.admin is None)
        if not self.clients:  # open client endpoints: a wrong or absent key is the anonymous client
            return Caller(None, False)
        return None


def _tag(key: str) -> str:
    """A client's rid namespace: a short digest of its key (the key itself never leaves the middleware)."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:12]


class AuthMiddleware:
    """Pure ASGI middleware (it must not wrap the receive channel: disconnects are watched there)."""

    def __init__(self, app, keys: Keys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        who = self.keys.resolve(header)
        if who is None and (scope["method"] == "OPTIONS" or scope["path"].startswith(PUBLIC_PREFIXES)):
            who = Caller(None, False)
        if who is None:
            message = "missing API key" if not header else "incorrect API key"
            response = error_response(APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                               code="invalid_api_key"))
            return await response(scope, receive, send)
        scope.setdefault("state", {})["caller"] = who
        return await self.app(scope, receive, send)


def caller(request: Request) -> Caller:
    """The request's caller (OPEN when the app runs without keys)."""
    return request.scope.get("state", {}).get("caller", OPEN)


def require_admin(request: Request, what: str) -> None:
    if not caller(request).admin:
        raise APIError(403, f"{what} needs the admin key (--admin-api-key)", code="forbidden")
