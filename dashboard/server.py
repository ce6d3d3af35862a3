"""run_dashboard(config): `redjax dashboard` — the dashboard alone under uvicorn."""

from __future__ import annotations

import uvicorn

from dashboard.app import create_dashboard
from dashboard.config import DashboardConfig


def run_dashboard(config: DashboardConfig) -> None:
    """Serve the dashboard (page, SSE, /metrics) on config.host:config.port until interrupted."""
    print(f"redjax dashboard on http://{config.host}:{config.port}/ reading {config.redis_display}", flush=True)
    uvicorn.run(
        create_dashboard(config),
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=3,  # live pages keep connections open; do not wait on them forever
    )
