"""`redjax bench stack --compare hf`: Hugging Face's own server as the serving baseline.

The baseline half of each pair runs `transformers serve --continuous-batching` (transformers'
paged KV cache and continuous-batching scheduler, in PyTorch on the CPU) on the same model
directory, and the same load generator sends it the same prompts with the same load: every request
at once, streamed, greedy, each to its max_tokens. transformers' server refuses the `ignore_eos`
extension (HTTP 422), so its requests carry instead a `generation_config` whose `eos_token_id` is
-1, its own spelling of "no end of sequence": both servers then produce exactly as many tokens.

Each server runs alone on the machine: started, warmed up with the same untimed load as redjax
serve, measured, stopped. transformers' server sizes its KV cache by its own defaults (a share of
the free memory) and runs its model in the checkpoint's dtype, or in `--dtype` where one is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import httpx

from worker.bench import cpu_usage

NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}  # every baseline request: runs to max_tokens
READY_TIMEOUT_S = 300.0


def hf_serve_once(run, seed: int) -> tuple[dict, dict | None]:
    """The baseline's measured report on the pair's prompts, and where the machine's CPU went
    during it (`run`: stack.StackRun)."""
    from worker.bench.serve import Load, bench_serve
    from worker.bench.stack import _free_port, _prompts, _stop, warm_up

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(hf_serve_argv(run.model_dir, port, run.engine_argv), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})  # a local directory: never the hub
        try:
            wait_listening(proc, url, out)
            warm_up(url, run, seed, ignore_eos=False, extra_body=NO_EOS)
            roles = {"transformers serve": [proc.pid], "load generator": [os.getpid()]}
            before = cpu_usage.take(roles)
            report = bench_serve(url, None, _prompts(run, seed), Load(run.num_prompts, output_len=run.output_len,
                                                                      seed=seed, ignore_eos=False, extra_body=NO_EOS))
            return report, cpu_usage.between(before, cpu_usage.take(roles))
        finally:
            _stop(proc)


def hf_serve_argv(model_dir: str, port: int, engine_argv: tuple[str, ...]) -> list[str]:
    """`transformers serve` with continuous batching on the CPU, pinned to `model_dir`, in the
    engine's --dtype where the engine flags give one."""
    flags = list(engine_argv)
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else "auto"
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", "--continuous-batching", "--device", "cpu",
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model_dir]


def wait_listening(proc: subprocess.Popen, url: str, out) -> None:
    """Until the server lists its model; its own output where it exits first."""
    from worker.bench.stack import wait_up

    wait_up(proc, out, "transformers serve", lambda: httpx.get(url + "/v1/models", timeout=2.0).status_code == 200,
            READY_TIMEOUT_S)
