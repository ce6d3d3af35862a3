"""DashboardConfig: the dashboard's settings, read once from flags, then `REDJAX_*` environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# Environment variable for each field; a flag given explicitly (not None) wins over it.
ENV_NAMES = {
    "redis_url": "REDJAX_REDIS_URL",
    "api_key": "REDJAX_API_KEY",
    "host": "REDJAX_DASHBOARD_HOST",
    "port": "REDJAX_DASHBOARD_PORT",
    "refresh_s": "REDJAX_DASHBOARD_REFRESH_S",
}


@dataclass(frozen=True)
class DashboardConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"  # the fleet's Redis; the dashboard's only data source
    api_key: str | None = field(default=None, repr=False)  # when set, pages, data and /metrics need it
    host: str = "127.0.0.1"  # bind address of `redjax dashboard`
    port: int = 8001  # bind port of `redjax dashboard`
    refresh_s: float = 1.0  # seconds between live updates pushed to each browser

    def __post_init__(self) -> None:
        checks = {
            "redis_url must start with redis://, rediss:// or unix://": self.redis_url.startswith(
                ("redis://", "rediss://", "unix://")
            ),
            "api_key must be non-empty when set": self.api_key is None or len(self.api_key) > 0,
            "port must be in [0, 65535]": 0 <= self.port <= 65535,
            "refresh_s must be in [0.1, 1.0] (the page updates at least once a second)": 0.1 <= self.refresh_s <= 1.0,
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "DashboardConfig":
        """Flags (None means not given) first, then the environment, then the defaults above."""
        flags = dict(flags or {})
        environ = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, env_name in ENV_NAMES.items():
            value = flags.get(name)
            if value is None:
                value = environ.get(env_name) or None
            if value is None:
                continue
            values[name] = {"int": int, "float": float}.get(types[name], str)(value)
        return cls(**values)

    @property
    def redis_display(self) -> str:
        """The Redis address without credentials, safe to show and log."""
        scheme, _, rest = self.redis_url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"
