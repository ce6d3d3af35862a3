"""WorkerConfig: the worker process's settings, read once (CLI flags, then `REDJAX_*` env)."""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from worker.engine.config import EngineConfig

ENV_NAMES = {
    "redis_url": "REDJAX_REDIS_URL",
    "model_dir": "REDJAX_MODEL_DIR",
    "served_model_name": "REDJAX_SERVED_MODEL_NAME",
    "name": "REDJAX_WORKER_NAME",
    "drain_timeout_s": "REDJAX_DRAIN_TIMEOUT_S",
    "log_level": "REDJAX_LOG_LEVEL",
    "compile_cache_dir": "REDJAX_COMPILE_CACHE_DIR",
    "warmup": "REDJAX_WARMUP",
    "backlog": "REDJAX_BACKLOG",
    "stream_interval_ms": "REDJAX_STREAM_INTERVAL_MS",
    "log_stats_interval_s": "REDJAX_LOG_STATS_INTERVAL_S",
}
ENGINE_ENV_PREFIX = "REDJAX_"  # each EngineConfig field: REDJAX_<FIELD> (e.g. REDJAX_MAX_NUM_SEQS)


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str  # local Hugging Face model folder
    redis_url: str = "redis://127.0.0.1:6379/0"
    served_model_name: str = ""  # "" means the model folder's name (the API uses the same rule)
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")  # unique in the fleet
    drain_timeout_s: float = 30.0  # on SIGTERM: finish what is running for this long, then hand it back
    claim_interval_s: float = 2.0  # how often to look for requests left by dead workers
    log_level: str = "info"
    # persistent XLA compilation cache, so a restarted worker skips compiling its step shapes; "" disables
    compile_cache_dir: str = str(Path.home() / ".cache" / "redjax" / "xla")
    warmup: bool = True  # compile the decode step variants before taking requests (LLMEngine.warmup)
    # requests held beyond max_num_seqs, waiting in the engine: slots freed by finishing sequences
    # refill in the same step instead of a step later, after a round trip through Redis
    backlog: int = 16
    # a stream's tokens are held until this long after its last delta (its first and last go out at
    # once) while the worker runs max_num_seqs streams, in proportion less with fewer: steps that
    # admit prompts give every running stream a token each, ~20 ms apart on a CPU
    stream_interval_ms: float = 50.0
    # a log line of throughput, queue, KV pages and prefix-cache hits this often while there is work; 0: none
    log_stats_interval_s: float = 10.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must be set")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must be a redis://, rediss:// or unix:// URL")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.backlog < 0:
            raise ValueError("backlog must be >= 0")
        if self.stream_interval_ms < 0:
            raise ValueError("stream_interval_ms must be >= 0")
        if self.log_stats_interval_s < 0:
            raise ValueError("log_stats_interval_s must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir.rstrip("/")).name

    @classmethod
    def from_env(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "WorkerConfig":
        """Flags (`overrides`, None ignored) win over environment variables, which win over defaults."""
        environ = os.environ if environ is None else environ
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, env in ENV_NAMES.items():
            if env in environ:
                values[name] = _parse(types[name], environ[env], env)
        engine: dict[str, Any] = {}
        for f in dataclasses.fields(EngineConfig):
            env = ENGINE_ENV_PREFIX + f.name.upper()
            if env in environ:
                engine[f.name] = _parse(f.type, environ[env], env)
        engine.update(overrides.pop("engine", {}) or {})
        values.update(overrides)
        return cls(**values, engine=EngineConfig(**{k: v for k, v in engine.items() if v is not None}))


def _parse(type_name: str, raw: str, env: str) -> Any:
    if "None" in type_name and raw.strip().lower() in ("", "auto"):
        return None  # the field's automatic default
    if "bool" in type_name:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        if "int" in type_name and "float" not in type_name:
            return int(raw)
        if "float" in type_name:
            return float(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a number") from None
    return raw
