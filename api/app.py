"""create_app: the OpenAI-compatible Starlette application."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Route

from api import routes
from api.config import ApiConfig
from api.errors import EXCEPTION_HANDLERS
from api.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from api.model_info import ModelInfo
from api.services import ApiServices
from worker.heap import freeze_startup_heap

log = logging.getLogger("redjax.api")


def create_app(config: ApiConfig, *, model: ModelInfo | None = None, mounts: Sequence[BaseRoute] = ()) -> Starlette:
    """The API app. `model` defaults to loading config.model_dir; `mounts` are extra routes or
    `starlette.routing.Mount`s (e.g. the dashboard) served after the API's own routes, under the
    same middleware (the API key guards /v1/* only)."""
    model = model or ModelInfo.load(config.model_dir, config.model_name, config.max_model_len,
                                    generation_defaults=config.sampling_defaults == "model")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        services = ApiServices.create(config, model)
        app.state.services = services
        await services.start()
        freeze_startup_heap()  # collections then skip the tokenizer and everything else loaded so far
        log.info("api serving %s (max_model_len %d) on redis %s", model.name, model.max_model_len,
                 _without_password(config.redis_url))  # fmt: skip
        if model.sampling_defaults:
            log.info("sampling defaults from the model's generation_config.json, where a request sets none: %s "
                     "(--sampling-defaults openai: the OpenAI API's)",
                     ", ".join(f"{k}={v}" for k, v in model.sampling_defaults.items()))
        try:
            yield
        finally:
            await services.stop()

    api_routes = [
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/ready", routes.ready, methods=["GET"]),
    ]
    middleware = [Middleware(RequestIdMiddleware)]
    if config.api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    middleware.append(Middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes))
    app = Starlette(
        routes=[*api_routes, *mounts], middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan
    )
    app.state.config = config
    app.state.started_at = int(time.time())
    return app


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}"
