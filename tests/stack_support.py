"""A tiny but real servable model folder (random Llama weights + a trained tokenizer) and a live stack.

The stack is the real thing: `redjax worker` processes and an API server started by the CLI,
against the test session's redis-server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import transformers

from tests.api_support import make_model_dir
from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent


def make_served_model(path: Path, seed: int = 0) -> Path:
    """Tokenizer and chat template from the API tests, plus random Llama weights sized to its vocabulary."""
    make_model_dir(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits so greedy choices are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return path


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra or {})
    return env


def start_worker(model_dir: Path, redis_url: str, name: str, *extra: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--model", str(model_dir), "--redis", redis_url,
           "--name", name, "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--page-size", "8",
           "--num-pages", "128", *extra]
    return subprocess.Popen(cmd, env=_env(env), cwd=REPO)


def start_api(model_dir: Path, redis_url: str, *extra: str, env: dict[str, str] | None = None,
              port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "worker.cli", "api", "--model", str(model_dir), "--redis", redis_url,
           "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, env=_env(env), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, 60)
    return proc, url


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def wait_until(check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"condition not met in {timeout_s}s (last error: {last!r})")


def run_worker_while(worker, watch) -> None:
    """Run `worker` (a service.worker.Worker) on this thread until `watch`, on a thread of its own,
    returns or raises; then it drains as after a SIGTERM, and the signal handlers its run()
    installed are put back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def watched() -> None:
        try:
            watch()
        finally:
            worker._on_signal(signal.SIGTERM, None)  # drains, and run() returns

    watcher = threading.Thread(target=watched, daemon=True)
    watcher.start()
    try:
        assert worker.run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    watcher.join(timeout=10)


def jax_cache_env(folder: Path) -> dict[str, str]:
    """Environment for workers sharing one persistent JAX compilation cache (saves recompiling per process)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(folder), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def stop_mid_request(client, worker: subprocess.Popen, request_id: str) -> bool:
    """SIGSTOP `worker` now; true when `request_id` has published output but not finished.

    When it had already finished, the worker is resumed and the caller retries with a new request
    (the tiny test model is fast, so a request is caught half done only most of the time).
    """
    from worker import contract
    from worker.contract import OutputDelta

    os.kill(worker.pid, signal.SIGSTOP)
    entries = client.xrange(contract.out_stream(request_id))
    if entries and not any(OutputDelta.decode(f).done for _, f in entries):
        return True
    os.kill(worker.pid, signal.SIGCONT)
    return False


def stop_when_in_flight(client, worker: subprocess.Popen, timeout_s: float = 60) -> str | None:
    """Watch Redis closely for the next request and SIGSTOP `worker` once it has output but is not done.

    Run it in a thread started before the request is sent; returns the request id (worker stopped)
    or None when the request finished first (worker left running).
    """
    from worker import contract
    from worker.contract import RequestMessage

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = client.xrange(contract.REQUESTS, count=1)
        if entries:
            request_id = RequestMessage.decode(entries[0][1]).id
            break
    else:
        raise TimeoutError("no request was enqueued")
    from worker.contract import OutputDelta

    stream = contract.out_stream(request_id)
    while not any(OutputDelta.decode(f).text for _, f in client.xrange(stream)):  # text: the API answers 200
        if time.monotonic() > deadline:
            raise TimeoutError("the request produced no output")
    return request_id if stop_mid_request(client, worker, request_id) else None
