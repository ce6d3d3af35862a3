"""`redjax serve`: the whole stack on one machine.

An embedded Redis (`embedded_redis`, restarted if it dies) unless a URL is given, N worker
processes, and the API with the dashboard mounted at /dashboard (and /metrics) in this process.
Ctrl-C stops everything: the API first, then the workers (SIGTERM: they drain), then the
embedded Redis. A worker that crashes while serving (its last heartbeat said so) is started
again under a new name, up to `--worker-restarts` times in RESTART_WINDOW_S for the stack: its requests wait
in Redis, and it (or another worker) claims and resumes them once the dead one's heartbeat has
expired. A worker that exits otherwise (a model that fails to load, a crash while starting, a
SIGTERM from outside: it drained), or past that budget, leaves the others serving; when none is
left the stack stops the same way, with exit status 1: an API without workers would queue
requests that nothing runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from worker.contract import WorkerState
from worker.service.cores import children_on, split_cores
from worker.service.embedded_redis import EmbeddedRedis, die_with_parent

RESTART_WINDOW_S = 600.0  # `--worker-restarts N`: at most N restarts of crashed serving workers in this many seconds


def serve(args, model_dir: str, engine_overrides: dict) -> int:
    from api.config import ApiConfig
    from api.server import exit_on_sigterm, run_api
    from worker.cli import _dashboard_mounts

    embedded = None
    redis_url = args.redis or os.environ.get("REDJAX_REDIS_URL")
    if not redis_url:
        embedded = EmbeddedRedis()
        redis_url = embedded.url
    api_config = ApiConfig.from_env({"model_dir": model_dir, "redis_url": redis_url, "host": args.host,
                                     "port": args.port, "served_model_name": args.served_model_name,
                                     "sampling_defaults": args.sampling_defaults})
    if (busy := _unbindable(api_config.host, api_config.port)) is not None:  # not after a minute of warm-up
        print(f"redjax: cannot serve the API on {api_config.host}:{api_config.port}: {busy}", file=sys.stderr,
              flush=True)  # fmt: skip
        if embedded is not None:
            embedded.shutdown()
        return 1
    cores = split_cores(sorted(os.sched_getaffinity(0)), args.workers)  # None: every worker on every core

    def start(i: int, generation: int = 0) -> subprocess.Popen:
        return _start_worker(i, generation, model_dir, redis_url, args, engine_overrides, cores and cores[i])

    workers = [start(i) for i in range(args.workers)]
    demo = Path(model_dir).resolve() == (Path(__file__).parent.parent / "demo_model").resolve()
    print(f"redjax: model {api_config.model_name}{' (the demo model shipped with redjax)' if demo else ''}", flush=True)
    pinned = f", each on its own cores ({'; '.join(','.join(map(str, run)) for run in cores)})" if cores else ""
    print(f"redjax: redis {'embedded at ' if embedded else ''}{_display(redis_url)}; {len(workers)} worker(s){pinned}",
          flush=True)
    print(f"redjax: API       http://{api_config.host}:{api_config.port}/v1", flush=True)
    print(f"redjax: dashboard http://{api_config.host}:{api_config.port}/dashboard/", flush=True)
    watch = WorkerWatch(workers, start, redis_url, Restarts(args.worker_restarts))
    stopping = watch.stopping
    threading.Thread(target=_announce_ready, args=(redis_url, api_config.model_name, stopping), daemon=True,
                     name="announce-ready").start()
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # from now on, as uvicorn will leave it: a clean stop
    if embedded is not None:
        embedded.watch()  # a new one if it dies
    for i in range(len(workers)):
        threading.Thread(target=watch.watch, args=(i,), daemon=True, name=f"watch-w{i}").start()
    status = 0
    try:
        run_api(api_config, mounts=_dashboard_mounts(redis_url, api_config.api_key))
    except SystemExit as exc:  # SIGTERM (a watcher's or anyone's): stopped as on Ctrl-C, status 0
        status = exc.code if isinstance(exc.code, int) else 1  # uvicorn's startup failure: 3
    finally:
        with watch.lock:  # no watcher starts a worker after this
            stopping.set()
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 40
        for proc in workers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if embedded is not None:
            embedded.shutdown()
        print("redjax: stopped", flush=True)
    if len(watch.exited) == len(workers) or (embedded is not None and embedded.failed):
        return 1  # it stopped because no worker was left, or its Redis kept dying
    return status


def _unbindable(host: str, port: int) -> str | None:
    """Why the API could not listen on host:port (another server holds it, a host this machine
    does not have), or None. Binding as uvicorn will (SO_REUSEADDR), then letting go."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


class Restarts:
    """The stack's budget of worker restarts: at most `limit` within RESTART_WINDOW_S."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.times: deque[float] = deque()

    def take(self) -> bool:
        now = time.monotonic()
        while self.times and now - self.times[0] > RESTART_WINDOW_S:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


class WorkerWatch:
    """One thread a worker waits for it to exit (`watch`). One that crashed while serving is started
    again, within the stack's budget. Otherwise, while others still run, they go on serving (and
    claim what it held once its heartbeat expires); when it was the last, the stack stops (SIGTERM
    to this process: the API shuts down as on Ctrl-C)."""

    def __init__(self, workers: list[subprocess.Popen], start, redis_url: str, restarts: Restarts) -> None:
        self.workers = workers  # worker i's process now; a restart replaces it
        self.start = start  # start(i, generation) -> a new process for worker i
        self.redis_url = redis_url
        self.restarts = restarts
        self.stopping = threading.Event()
        self.exited: list[int] = []  # workers gone for good
        self.lock = threading.Lock()  # one watcher at a time counts who is left, or starts a worker

    def watch(self, i: int) -> None:
        generation = 0
        while True:
            proc = self.workers[i]
            proc.wait()
            was_serving = proc.returncode != 0 and _last_state(self.redis_url, proc) == WorkerState.SERVING.value
            with self.lock:
                if self.stopping.is_set():
                    return
                if was_serving and self.restarts.take():
                    generation += 1
                    self.workers[i] = self.start(i, generation)
                    print(f"redjax: worker {i} crashed while serving (status {proc.returncode}); starting it "
                          "again (its requests resume once its heartbeat has expired)", file=sys.stderr, flush=True)
                    continue
                self.exited.append(i)
                left = len(self.workers) - len(self.exited)  # each watcher counts its own exit once: one sees 0
            why = " while serving, past the stack's restart budget" if was_serving else ""
            what = f"{left} still serving" if left else "no worker left; stopping"
            print(f"redjax: worker {i} exited (status {proc.returncode}){why}; {what}", file=sys.stderr, flush=True)
            if not left:
                os.kill(os.getpid(), signal.SIGTERM)
            return


def _last_state(redis_url: str, proc: subprocess.Popen) -> str:
    """The state in the last heartbeat of the worker `proc` ran ("" if none is left: it never beat,
    it deleted its own on a clean stop, or Redis does not answer)."""
    import redis

    from worker import contract

    name = proc.args[proc.args.index("--name") + 1]
    try:
        with redis.Redis.from_url(redis_url, socket_timeout=5) as client:
            state = client.hget(contract.worker_key(name), "state")
    except redis.RedisError:
        return ""
    return state.decode() if state else ""


def _announce_ready(redis_url: str, model: str, stopping: threading.Event) -> None:
    """One line once a worker serves the model: until then requests wait in the queue while the
    workers load the model and compile (the heartbeat's "starting")."""
    import redis

    from worker import contract
    from worker.contract import WorkerState, WorkerStats

    client = redis.Redis.from_url(redis_url)
    started = time.monotonic()
    while not stopping.wait(0.5):
        try:
            names = [n.decode() for n in client.smembers(contract.WORKERS)]
            states = [WorkerStats.decode(h) for h in (client.hgetall(contract.worker_key(n)) for n in names) if h]
        except redis.RedisError:
            continue
        serving = sum(s.model == model and s.state == WorkerState.SERVING.value for s in states)
        if serving:
            print(f"redjax: ready after {time.monotonic() - started:.0f} s ({serving} worker(s) serving)", flush=True)
            return


def _start_worker(i: int, generation: int, model_dir: str, redis_url: str, args, engine_overrides: dict,
                  cores: tuple[int, ...] | None) -> subprocess.Popen:
    """Worker i, on `cores` alone when given (its engine's thread pools size themselves to them).
    A restarted one (generation > 0) takes a name of its own: the requests pending on its dead
    predecessor's name are claimed from a consumer whose heartbeat has expired."""
    from worker.cli import engine_argv

    again = f"r{generation}" if generation else ""
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--model", model_dir, "--redis", redis_url,
           "--name", f"{os.uname().nodename}-w{i}{again}-{os.getpid()}"]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    cmd += engine_argv(engine_overrides)
    # a session of its own: a terminal's Ctrl-C reaches this process alone, which stops the API and
    # then the workers in order (and the watcher never mistakes that for a crash)
    with children_on(cores):
        return subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent)


def _display(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
