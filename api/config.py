"""ApiConfig: the API process's settings, read once (CLI flags, then `REDJAX_*` env) and passed down."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# Environment variable of each field. redis_url, model_dir and served_model_name are shared with
# the worker; host and port carry an API_ prefix so they do not clash with the dashboard's.
ENV_NAMES = {
    "redis_url": "REDJAX_REDIS_URL",
    "model_dir": "REDJAX_MODEL_DIR",
    "served_model_name": "REDJAX_SERVED_MODEL_NAME",
    "api_key": "REDJAX_API_KEY",
    "max_model_len": "REDJAX_MAX_MODEL_LEN",
    "max_queue_len": "REDJAX_MAX_QUEUE_LEN",
    "max_body_bytes": "REDJAX_MAX_BODY_BYTES",
    "max_prompts_per_request": "REDJAX_MAX_PROMPTS_PER_REQUEST",
    "request_timeout_s": "REDJAX_REQUEST_TIMEOUT_S",
    "no_worker_timeout_s": "REDJAX_NO_WORKER_TIMEOUT_S",
    "sse_ping_s": "REDJAX_SSE_PING_S",
    "shutdown_grace_s": "REDJAX_API_SHUTDOWN_GRACE_S",
    "host": "REDJAX_API_HOST",
    "port": "REDJAX_API_PORT",
    "log_level": "REDJAX_LOG_LEVEL",
    "sampling_defaults": "REDJAX_SAMPLING_DEFAULTS",
}

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SAMPLING_DEFAULTS = ("model", "openai")


@dataclass(frozen=True)
class ApiConfig:
    model_dir: str  # local Hugging Face model folder: tokenizer files and config.json
    redis_url: str = "redis://127.0.0.1:6379/0"  # the Redis every process of the fleet shares
    served_model_name: str = ""  # name clients send as `model`; "" means the model folder's name
    api_key: str | None = field(default=None, repr=False)  # Bearer key for /v1/*; None: open. Never logged
    max_model_len: int | None = None  # context limit; None: config.json max_position_embeddings
    max_queue_len: int = 1024  # 429 once this many requests wait or run (XLEN of the request stream)
    max_body_bytes: int = 8 * 1024 * 1024  # 413 above this request body size
    max_prompts_per_request: int = 64  # a completions `prompt` list fans out to at most this many requests
    request_timeout_s: float = 600.0  # a request still unfinished after this is cancelled (504)
    no_worker_timeout_s: float = 30.0  # a waiting request with no live worker (starting ones count) this long: 503
    sse_ping_s: float = 15.0  # keep-alive comment interval on streams
    shutdown_grace_s: float = 10.0  # on SIGTERM: open responses (streams too) may finish for this long
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    # sampling fields a request leaves out: "model", the checkpoint's generation_config.json values
    # where it sets any (as vLLM and transformers); "openai", the OpenAI API's (temperature 1, ...)
    sampling_defaults: str = "model"

    def __post_init__(self) -> None:
        checks = {
            "model_dir must be set": bool(self.model_dir),
            "redis_url must be a redis://, rediss:// or unix:// URL": self.redis_url.startswith(
                ("redis://", "rediss://", "unix://")
            ),
            "api_key must be non-empty when set": self.api_key is None or bool(self.api_key),
            "max_model_len must be >= 1": self.max_model_len is None or self.max_model_len >= 1,
            "max_queue_len must be >= 1": self.max_queue_len >= 1,
            "max_body_bytes must be >= 1024": self.max_body_bytes >= 1024,
            "max_prompts_per_request must be >= 1": self.max_prompts_per_request >= 1,
            "request_timeout_s must be > 0": self.request_timeout_s > 0,
            "no_worker_timeout_s must be > 0": self.no_worker_timeout_s > 0,
            "sse_ping_s must be > 0": self.sse_ping_s > 0,
            "shutdown_grace_s must be >= 0": self.shutdown_grace_s >= 0,
            "port must be in [0, 65535]": 0 <= self.port <= 65535,
            f"log_level must be one of {LOG_LEVELS}": self.log_level in LOG_LEVELS,
            f"sampling_defaults must be one of {SAMPLING_DEFAULTS}": self.sampling_defaults in SAMPLING_DEFAULTS,
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        """The name clients and worker heartbeats use for the model."""
        return self.served_model_name or Path(self.model_dir.rstrip("/")).name

    @classmethod
    def from_env(
        cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> "ApiConfig":
        """Flags (`overrides`; None values ignored) win over `REDJAX_*` variables, which win over defaults."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, env_name in ENV_NAMES.items():
            if environ.get(env_name, "") != "":
                values[name] = _parse(fields[name].type, environ[env_name], env_name)
        for name, value in (overrides or {}).items():
            if name not in fields:
                raise ValueError(f"unknown API setting: {name}")
            if value is not None:
                values[name] = value
        if "model_dir" not in values:
            raise ValueError(f"model_dir must be set (flag or {ENV_NAMES['model_dir']})")
        return cls(**values)


def _parse(type_name: str, raw: str, env_name: str) -> Any:
    """Convert an environment string to the field's declared type."""
    try:
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{env_name}={raw!r} is not a valid {type_name.split()[0]}") from None
    return raw
