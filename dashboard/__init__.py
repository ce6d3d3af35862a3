"""The redjax dashboard: Starlette + jinja2 pages and /metrics fed by Redis alone (never JAX)."""

from dashboard.app import create_dashboard
from dashboard.config import DashboardConfig
from dashboard.metrics import metrics_route
from dashboard.server import run_dashboard

__all__ = ["DashboardConfig", "create_dashboard", "metrics_route", "run_dashboard"]
