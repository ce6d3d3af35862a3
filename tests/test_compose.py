"""docker-compose.yml and the Dockerfile agree with the code.

There is no container engine in the test environment, so this checks structure, not a running
stack: the services and their Redis wiring, that every command is a real `redjax` subcommand
(parsed by the CLI's own parser, so a renamed flag breaks the test), and that every `REDJAX_*`
variable handed to a process is one the code reads and is accepted by that process's config.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from api.config import ENV_NAMES as API_ENV
from api.config import ApiConfig
from dashboard.config import ENV_NAMES as DASHBOARD_ENV
from dashboard.config import DashboardConfig
from worker.cli import parser
from worker.engine.config import EngineConfig
from worker.service.config import ENGINE_ENV_PREFIX, WorkerConfig
from worker.service.config import ENV_NAMES as WORKER_ENV

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

ENGINE_ENV = {ENGINE_ENV_PREFIX + f.name.upper() for f in dataclasses.fields(EngineConfig)}
# What each process reads; every name is also in README.md's configuration table.
READS = {
    "api": set(API_ENV.values()),
    "dashboard": set(DASHBOARD_ENV.values()),
    "worker": set(WORKER_ENV.values()) | ENGINE_ENV,
}
KNOWN_ENV = set().union(*READS.values())
# Variables only docker compose itself interpolates (never reach a process under their own name).
COMPOSE_ONLY = {"REDJAX_WORKERS", "REDJAX_MODEL_DIR_HOST", "REDJAX_JAX_EXTRA"}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def interpolate(value, environ: dict[str, str] | None = None):
    """Compose's `${VAR}` / `${VAR:-default}` with an empty shell environment (defaults apply)."""
    environ = environ or {}
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda m: environ.get(m.group(1)) or (m.group(2) or ""), value)
    return value


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(interpolate(v)) for k, v in env.items()}


def test_four_services(services):
    assert set(services) == {"redis", "api", "worker", "dashboard"}


def test_redis_is_durable_and_checked(compose, services):
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    command = shlex.split(command) if isinstance(command, str) else command
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    volume = redis["volumes"][0]
    name, target = (volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"]))
    assert target == "/data" and name in compose["volumes"]
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


@pytest.mark.parametrize("name", ["api", "worker", "dashboard"])
def test_command_is_a_real_subcommand(services, name):
    command = services[name]["command"]
    command = shlex.split(command) if isinstance(command, str) else command
    assert command[0] == "redjax"
    args = parser().parse_args(command[1:])  # SystemExit (a failure) on an unknown subcommand or flag
    assert args.command == name


@pytest.mark.parametrize("name", ["api", "worker", "dashboard"])
def test_waits_for_a_healthy_redis_and_uses_it(services, name):
    service = services[name]
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert environment(service)["REDJAX_REDIS_URL"] == "redis://redis:6379/0"


def test_every_redjax_variable_is_read_by_the_code(services):
    text = COMPOSE.read_text()
    for name, service in services.items():
        for key in environment(service):
            if key.startswith("REDJAX_"):
                assert key in READS.get(name, set()), f"{name}: {key} is not read by `redjax {name}`"
    named = set(re.findall(r"\bREDJAX_[A-Z0-9_]+\b", text))
    unknown = named - KNOWN_ENV - COMPOSE_ONLY
    assert not unknown, f"docker-compose.yml names variables no code reads: {sorted(unknown)}"


def test_each_process_accepts_its_environment(services, tmp_path):
    """The defaults compose resolves to (REDJAX_API_KEY empty among them) build valid configs."""
    api_env = environment(services["api"])
    api = ApiConfig.from_env(environ=api_env)
    assert (api.host, api.port, api.model_dir, api.api_key) == ("0.0.0.0", 8000, "/models/model", None)
    dash = DashboardConfig.from_flags(environ=environment(services["dashboard"]))
    assert (dash.host, dash.port, dash.api_key) == ("0.0.0.0", 8001, None)
    worker = WorkerConfig.from_env(environ=environment(services["worker"]))
    assert worker.model_dir == "/models/model" and worker.redis_url == "redis://redis:6379/0"
    # and with a key set in the shell, both the API and the dashboard require it
    keyed = {k: str(interpolate(v, {"REDJAX_API_KEY": "sekrit"})) for k, v in services["api"]["environment"].items()}
    assert ApiConfig.from_env(environ=keyed).api_key == "sekrit"


def test_ports_and_healthchecks(services):
    assert "8000:8000" in [str(p) for p in services["api"]["ports"]]
    assert "8001:8001" in [str(p) for p in services["dashboard"]["ports"]]
    api_check = " ".join(services["api"]["healthcheck"]["test"])
    assert "python" in api_check and "127.0.0.1:8000/health" in api_check  # slim images have no curl
    dash_check = " ".join(services["dashboard"]["healthcheck"]["test"])
    assert "python" in dash_check and "127.0.0.1:8001/" in dash_check
    assert "healthcheck" in services["redis"]


def test_model_is_mounted_read_only(services):
    for name in ("api", "worker"):
        (volume,) = services[name]["volumes"]
        if isinstance(volume, str):
            source, target, mode = volume.rsplit(":", 2)
            read_only = mode == "ro"
        else:
            source, target, read_only = volume["source"], volume["target"], volume.get("read_only")
        assert target == environment(services[name])["REDJAX_MODEL_DIR"] == "/models/model"
        assert read_only and interpolate(source) == "./worker/demo_model"


def test_worker_replicas_and_gpu_block(services):
    worker = services["worker"]
    assert worker["deploy"]["replicas"] == "${REDJAX_WORKERS:-1}"
    assert int(interpolate(worker["deploy"]["replicas"])) == 1
    assert "resources" not in worker["deploy"], "the GPU reservation stays commented out by default"
    text = COMPOSE.read_text()
    assert re.search(r"#\s*- driver: nvidia", text), "the documented (commented) GPU block is missing"


def test_dockerfile_runs_a_real_subcommand():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"pip install \.", text)
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    argv: list[str] = []
    for instruction in ("ENTRYPOINT", "CMD"):
        found = re.findall(rf"^{instruction}\s+(.+)$", text, re.M)
        if found:
            value = found[-1].strip()
            argv += json.loads(value) if value.startswith("[") else shlex.split(value)
    assert argv[0] == "redjax"
    assert parser().parse_args(argv[1:]).command == "serve"
    for name in re.findall(r"\bREDJAX_[A-Z0-9_]+\b", text):
        assert name in KNOWN_ENV, f"Dockerfile names {name}, which no code reads"
