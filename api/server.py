"""run_api: serve the API with uvicorn (what `redjax api` calls)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

from starlette.routing import BaseRoute

from api.config import ApiConfig
from api.open_files import raise_open_files_limit


def run_api(config: ApiConfig, mounts: Sequence[BaseRoute] = ()) -> None:
    """Load the tokenizer, then serve until SIGINT/SIGTERM. Logs ids and counts, never text or keys."""
    import uvicorn

    from api.app import create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit()  # a connection each: past the soft limit clients are reset unseen
    app = create_app(config, mounts=mounts)
    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler that was in place
        # before: with the default one the process dies by the signal (exit -15) and callers' cleanup
        # (`redjax serve` stopping its workers) never runs. Exit normally instead.
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    # on SIGTERM: no new connections; open responses get shutdown_grace_s to finish, then are cancelled
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=config.shutdown_grace_s)  # fmt: skip


def exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)
