"""The FastAPI application: routers, OpenAI-style errors, the API keys, and the worker's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from specserve.server import native_api, openai_api
from specserve.server.auth import AuthMiddleware, Keys
from specserve.server.errors import install_error_handlers
from specserve.server.manager import RequestManager
from specserve.server.openapi import install_openapi


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
    # what parse_body needs: the body size limit, and the event that cuts body reads short when draining starts
    app.state.max_request_bytes = manager.args.max_request_bytes
    app.state.stop_reading = manager.drain_started
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    install_openapi(app)
    keys = Keys(manager.args.api_key, manager.args.admin_api_key)
    if keys.configured:
        app.add_middleware(AuthMiddleware, keys=keys)
    return app


def _version() -> str:
    import specserve

    return specserve.__version__
