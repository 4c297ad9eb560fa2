"""The FastAPI application: routers, OpenAI-style errors, the API-key check, and the worker's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi import FastAPI

from specserve.server import native_api, openai_api
from specserve.server.errors import APIError, error_response, install_error_handlers
from specserve.server.manager import RequestManager
from specserve.server.openapi import install_openapi

# Paths served without the API key (SGLang exempts health checks and metrics too)
PUBLIC_PREFIXES = ("/health", "/metrics")


class APIKeyMiddleware:
    """Pure ASGI middleware (it must not wrap the receive channel: disconnects are watched there)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(PUBLIC_PREFIXES):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "missing API key" if not given else "incorrect API key"
        response = error_response(APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                           code="invalid_api_key"))
        await response(scope, receive, send)


def create_app(manager: RequestManager) -> FastAPI:
    """The app for a started RequestManager; the worker is stopped when the app shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        manager.attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="specserve", version=_version(), lifespan=lifespan)
    app.state.manager = manager
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    install_openapi(app)
    if manager.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=manager.args.api_key)
    return app


def _version() -> str:
    import specserve

    return specserve.__version__
