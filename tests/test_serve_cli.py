"""`redjax serve` and the other engine commands as a user starts them: bad engine settings are
usage errors before anything starts, a worker that crashes while serving is started again, and a
stack whose workers are all gone stops instead of queueing requests that nothing runs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis as redis_client

from tests.conftest import free_port
from tests.stack_support import REPO, _env, make_served_model, wait_until
from worker.service.embedded_redis import CRASH_LOOP_S as EMBEDDED_CRASH_LOOP_S

SMALL_ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--page-size", "8", "--num-pages", "64"]


@pytest.mark.parametrize("argv,env,message", [
    (["serve", "--max-num-batched-tokens", "4"], {}, "max_num_batched_tokens must be >= max_num_seqs"),
    (["serve"], {"REDJAX_MAX_NUM_SEQS": "many"}, "REDJAX_MAX_NUM_SEQS='many' is not a number"),
    (["serve", "--workers", "0"], {}, "--workers must be at least 1"),
    (["worker", "--page-size", "3"], {}, "page_size must be a power of two"),
    (["serve"], {"REDJAX_QUANTIZATION": "int3"}, "quantization must be int8, int4 or None"),
    (["serve", "--quantization", "fp8"], {}, "invalid choice: 'fp8'"),
    (["serve", "--kv-cache-dtype", "int4"], {}, "invalid choice: 'int4'"),
    (["serve"], {"REDJAX_KV_CACHE_DTYPE": "fp8"}, "kv_cache_dtype must be float32, bfloat16 or int8"),
    (["generate", "--prompt", "x", "--max-num-batched-tokens", "4"], {}, "max_num_batched_tokens must be >= max_num_seqs"),
    (["bench", "offline", "--dummy", "llama-tiny", "--max-num-batched-tokens", "4"], {},
     "max_num_batched_tokens must be >= max_num_seqs"),
])  # fmt: skip
def test_bad_engine_settings_are_usage_errors_before_anything_starts(argv, env, message):
    out = subprocess.run([sys.executable, "-m", "worker.cli", *argv], cwd=REPO, env=_env(env), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert "redjax: API" not in out.stdout  # serve started nothing


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_served_model(tmp_path_factory.mktemp("model"))


@contextlib.contextmanager
def running_serve(model: Path, workers: int = 1, *extra: str):
    """`redjax serve` on a free port (with `extra` arguments), ready (its workers serving, and the
    stack has said so on stdout); yields (process, its worker's pid, or their pids with workers > 1,
    its embedded redis-server's pid)."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "worker.cli", "serve", "--model", str(model), "--port", str(port),
                              "--workers", str(workers), *SMALL_ENGINE, *extra], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group, as in a terminal
    try:
        def up() -> bool:  # every worker's heartbeat in, and past loading and compiling
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
            return f"redjax:workers_serving {float(workers)}" in metrics
        wait_until(up, 180)
        while not (line := serve.stdout.readline()).startswith("redjax: ready after"):  # within its 0.5 s poll
            assert line, "redjax serve ended its output without saying it was ready"
        children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(serve.pid)}
        pids = sorted(pid for pid, cmd in children.items() if b"worker.cli" in cmd)
        [redis] = [pid for pid, cmd in children.items() if b"redis-server" in cmd]
        yield serve, (pids[0] if workers == 1 else pids), redis
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_serve_restarts_crashed_workers_goes_on_while_one_is_left_and_stops_when_none_is(model):
    """Workers that crash while serving are started again within `--worker-restarts` (here 1);
    past it, the others go on serving, and when none is left the stack stops with status 1."""
    with running_serve(model, 2, "--worker-restarts", "1") as (serve, workers, _):
        mine = sorted(os.sched_getaffinity(0))
        runs = [sorted(os.sched_getaffinity(pid)) for pid in workers]
        if len(mine) >= 2:  # each worker its own run of the cores, together all of them
            assert sorted(runs[0] + runs[1]) == mine and not set(runs[0]) & set(runs[1]), runs
        else:
            assert runs == [mine, mine]
        for pid in workers:  # the pages are given outright: no share of the memory fraction to pass on
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"--num-pages" in argv and b"--kv-cache-memory-fraction" not in argv
        os.kill(workers[0], signal.SIGKILL)  # serving: started again, on its cores, under a new name
        again = _new_worker(serve.pid, set(workers))
        assert sorted(os.sched_getaffinity(again)) == runs[0]
        assert re.search(rb"--name\0[^\0]*-w0r1-", Path(f"/proc/{again}/cmdline").read_bytes())
        url = serve.args[serve.args.index("--port") + 1]
        out = httpx.post(f"http://127.0.0.1:{url}/v1/completions", timeout=60,
                         json={"model": model.name, "prompt": "hello world", "max_tokens": 4, "temperature": 0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
        os.kill(workers[1], signal.SIGKILL)  # the budget is spent: not started again
        wait_until(lambda: not _alive(workers[1]), 30)
        os.kill(again, signal.SIGKILL)
        out, err = serve.communicate(timeout=90)
    assert serve.returncode == 1, err[-2000:]
    assert "worker 0 crashed while serving (status -9); starting it again" in err
    # the last two exits in either order (their watchers race): one leaves the other, then none is left
    ends = re.findall(r"worker (\d) exited \(status -9\)([^;\n]*); (1 still serving|no worker left; stopping)", err)
    assert sorted(end for _, _, end in ends) == ["1 still serving", "no worker left; stopping"], err[-3000:]
    assert ("1", " while serving, past the stack's restart budget") in [(i, why) for i, why, _ in ends]
    assert "redjax: stopped" in out


def test_a_stream_survives_its_only_worker_crashing():
    """The only worker SIGKILLed while a stream runs: the stack starts it again, the new worker
    claims the request once the dead one's heartbeat expires and resumes it from the tokens already
    sent, and the client (the official SDK) reads the same greedy text as a run left alone. The demo
    model, whose text is whole words (a random model's bytes split across tokens may not decode
    alike in pieces)."""
    import openai

    from worker.cli import DEMO_MODEL

    with running_serve(DEMO_MODEL) as (serve, worker, _):
        port = serve.args[serve.args.index("--port") + 1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=180)
        ask = dict(model=DEMO_MODEL.name, prompt="It is a truth universally", max_tokens=400, temperature=0,
                   extra_body={"ignore_eos": True})
        alone = client.completions.create(**ask).choices[0].text
        parts = []
        for event in client.completions.create(**ask, stream=True):
            parts.append(event.choices[0].text if event.choices else "")
            if len(parts) == 1:
                os.kill(worker, signal.SIGKILL)
        assert _new_worker(serve.pid, {worker})
        os.killpg(serve.pid, signal.SIGINT)
        out, err = serve.communicate(timeout=90)
    assert "worker 0 crashed while serving (status -9); starting it again" in err, err[-3000:]
    assert "from a dead worker" in err  # the new worker claimed the request: it was cut short
    assert "".join(parts) == alone and len(parts) > 2  # streamed in pieces, the later ones by the new worker
    assert serve.returncode == 0, err[-2000:]


def _new_worker(serve: int, old: set[int], timeout_s: float = 60) -> int:
    """The pid of serve's worker child once it is not one of `old`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _children(serve):
            with contextlib.suppress(FileNotFoundError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if pid not in old and argv[1:4] == [b"-m", b"worker.cli", b"worker"]:
                    return pid
        time.sleep(0.02)
    raise TimeoutError(f"no new worker under {serve} in {timeout_s} s")


def test_serve_with_int4_projections_and_int8_kv_pages_answers_the_openai_client(model):
    import openai

    with running_serve(model, 1, "--kv-cache-dtype", "int8", "--quantization", "int4") as (serve, worker, redis):
        port = serve.args[serve.args.index("--port") + 1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=model.name, prompt="hello world", max_tokens=6, temperature=0)
        assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
        os.killpg(serve.pid, signal.SIGINT)
        out, err = serve.communicate(timeout=90)
    assert serve.returncode == 0, err[-2000:]
    assert re.search(r"KV pages: 64 of int8", err), err[-3000:]  # the worker says what it serves with
    assert re.search(r"quantization: int4 \((kernel|xla)\)", err), err[-3000:]


def test_ctrl_c_stops_the_stack_cleanly_and_a_killed_stack_leaves_nothing_behind(model):
    with running_serve(model) as (serve, worker, redis):
        os.killpg(serve.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
        out, err = serve.communicate(timeout=90)
    assert serve.returncode == 0, err[-2000:]
    assert "redjax: stopped" in out and "exited" not in err
    assert not _alive(worker) and not _alive(redis)
    with running_serve(model) as (serve, worker, redis):
        serve.kill()
        serve.wait()
        # both got SIGTERM when it died: the worker drained and left, Redis stopped
        try:
            wait_until(lambda: not _alive(worker) and not _alive(redis), 60)
        except TimeoutError:
            left = {name: pid for name, pid in (("worker", worker), ("redis-server", redis)) if _alive(pid)}
            for pid in left.values():  # not into the tests after this one
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"still running 60 s after redjax serve was killed: {left}")


def test_a_dead_embedded_redis_is_replaced_and_one_that_keeps_dying_stops_the_stack(model):
    """Its Redis killed, the stack starts a new one on the same socket: the worker reconnects and
    recreates its group, and requests are served again (those the old one had queued get a 503
    request_lost). One that dies again within seconds of its start is not replaced: the stack
    stops with status 1."""
    with running_serve(model) as (serve, worker, redis):
        port = serve.args[serve.args.index("--port") + 1]
        os.kill(redis, signal.SIGKILL)
        fresh = _new_redis(serve.pid, {redis})

        def served() -> bool:
            try:
                out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                 json={"model": model.name, "prompt": "hello", "max_tokens": 3, "temperature": 0})
            except httpx.HTTPError:
                return False
            return out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
        wait_until(served, 90)
        assert _alive(worker)  # the same worker, reconnected
        time.sleep(EMBEDDED_CRASH_LOOP_S)  # a later death is one more restart...
        os.kill(fresh, signal.SIGKILL)
        newest = _new_redis(serve.pid, {redis, fresh})
        # its argv (--unixsocket PATH), or the title redis-server gives itself once up (unixsocket:PATH)
        socket_path = re.search(rb"unixsocket[:\0]([^\0 ]+)", Path(f"/proc/{newest}/cmdline").read_bytes())[1].decode()
        wait_until(lambda: redis_client.Redis(unix_socket_path=socket_path).ping(), 4)  # started, then...
        os.kill(newest, signal.SIGKILL)  # ...dead within seconds of its start: the stack stops
        out, err = serve.communicate(timeout=90)
    assert serve.returncode == 1, err[-2000:]
    assert err.count("the embedded Redis exited (status -9); starting a new one") == 2
    assert "the embedded Redis exited (status -9) within 5 s of its start; stopping" in err
    assert "redjax: stopped" in out
    assert not _alive(worker)


def _new_redis(serve: int, old: set[int], timeout_s: float = 30) -> int:
    """The pid of serve's redis-server child once it is not one of `old`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _children(serve):
            with contextlib.suppress(FileNotFoundError):
                if pid not in old and b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        time.sleep(0.02)
    raise TimeoutError(f"no new redis-server under {serve} in {timeout_s} s")


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaps is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile (the stack's ready announcer)
            pass
    return out


def test_workers_size_their_kv_caches_from_their_share_of_the_memory_fraction(model):
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "worker.cli", "serve", "--model", str(model), "--port", str(port),
                              "--workers", "2", "--kv-cache-memory-fraction", "0.3", "--max-num-seqs", "4",
                              "--max-num-batched-tokens", "64", "--page-size", "8"], cwd=REPO, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def workers() -> list[list[bytes]]:
            cmds = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in _children(serve.pid)]
            # a worker's own command line: a child still between fork and exec shows serve's
            return [c for c in cmds if c[1:4] == [b"-m", b"worker.cli", b"worker"]]
        wait_until(lambda: len(workers()) == 2, 60)
        for argv in workers():
            assert argv[argv.index(b"--kv-cache-memory-fraction") + 1] == b"0.15"  # 0.3 shared by two
    finally:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()


def test_a_serving_install_without_torch_does_not_print_that_models_wont_be_available():
    """transformers warns at import when PyTorch is missing, as it is on a serving install; redjax
    runs its models in JAX, so its commands drop that one line and keep transformers' other warnings.
    torch is hidden here the way a missing package looks to importlib."""
    script = ("import logging, sys; sys.modules['torch'] = None\n"
              "from worker.cli import quiet_missing_torch_notice\n"
              "if sys.argv[1] == 'quiet': quiet_missing_torch_notice()\n"
              "import transformers\n"
              "logging.getLogger('transformers').warning('another transformers warning')\n")

    def stderr(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, mode], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "PyTorch was not found" in stderr("plain")  # what a user saw before
    quiet = stderr("quiet")
    assert "PyTorch was not found" not in quiet and "another transformers warning" in quiet
    # every command installs the filter first, before anything imports transformers
    with pytest.raises(SystemExit):
        from worker.cli import main

        main(["no-such-command"])
    import logging

    record = logging.LogRecord("transformers", logging.WARNING, __file__, 0, "PyTorch was not found. Models won't be "
                               "available", None, None)
    assert not logging.getLogger("transformers").filter(record)
