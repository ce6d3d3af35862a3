"""run_api: serve the API with uvicorn (what `redjax api` calls)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.routing import BaseRoute

from api.config import ApiConfig


def run_api(config: ApiConfig, mounts: Sequence[BaseRoute] = ()) -> None:
    """Load the tokenizer, then serve until SIGINT/SIGTERM. Logs ids and counts, never text or keys."""
    import uvicorn

    from api.app import create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config, mounts=mounts)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=10)
