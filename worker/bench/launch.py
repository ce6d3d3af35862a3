"""`redjax bench launch`: how long a compiled step takes to launch, by what it is handed.

The engine's step takes a few hundred arrays a call: llama3-8b passes 291 weight arrays and 64 KV
page arrays (one per layer and kind, the pages donated). Until session 40 it also passed the batch
as ~26 host arrays; it now packs them into one (`batch.pack`). On an H200 that call took ~8 ms to
return (session 34: 8.5 ms a call of 16 fused decode steps, 12.6 % of the decode phase at 128/128,
over issue 7's 10 % host target), against ~1.5 ms for the same number of arrays on this
project's CPUs. This bench times the launch alone, with the device idle and each argument tiny,
so the figure is the runtime's cost per argument: a call with one of each kind, then with each
kind grown to the engine's count, then all together, with the batch as 26 host arrays and as the
engine now hands it, one. The rows say which kind to cut.

Each row: microseconds from the call to its return (the asynchronous launch; the outputs are waited
for before the next call), the median and the minimum of `--repeats` calls, and the microseconds
per added argument over the first row.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from worker.bench import roofline

ENGINE = (291, 64, 26)  # llama3-8b's step: weight arrays, page arrays (donated), host arrays unpacked
# (name, weight arrays, page arrays, host arrays) of each row
ROWS = (("one of each", 1, 1, 1), ("weights", ENGINE[0], 1, 1), ("pages, donated", 1, ENGINE[1], 1),
        ("host arrays", 1, 1, ENGINE[2]), ("all, batch unpacked", *ENGINE), ("all, as the engine", *ENGINE[:2], 1))


def _step(weights: tuple, pages: tuple, host: tuple):
    """A stand-in for the engine's step: reads every argument, updates every page array."""
    s = sum(w[0, 0] for w in weights) + sum(h[0] for h in host).astype(jnp.float32)
    return tuple((p + s).astype(p.dtype) for p in pages), s


def launch_us(weights: int, pages: int, host: int, repeats: int) -> list[float]:
    """Microseconds each of `repeats` launches took, with the device idle before each."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ws = tuple(jax.device_put(jnp.ones((16, 16), jnp.bfloat16), device) for _ in range(weights))
    ps = tuple(jax.device_put(jnp.zeros((16, 16), jnp.bfloat16), device) for _ in range(pages))
    hs = tuple(np.ones(16, np.int32) for _ in range(host))
    step = jax.jit(_step, donate_argnums=(1,)).lower(ws, ps, hs).compile()
    times = []
    for _ in range(repeats + 3):  # the first calls warm the runtime's caches
        t = time.perf_counter()
        ps, s = step(ws, ps, hs)
        times.append((time.perf_counter() - t) * 1e6)
        jax.block_until_ready((ps, s))
    return times[3:]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redjax bench launch",
                                description="a compiled step's launch time by argument kind, on this machine's backend")
    p.add_argument("--repeats", type=int, default=200, help="launches timed per row (default 200)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    rows = []
    for name, weights, pages, host in ROWS:
        times = launch_us(weights, pages, host, args.repeats)
        rows.append({"name": name, "weights": weights, "pages": pages, "host": host,
                     "median_us": float(np.median(times)), "min_us": float(min(times))})
    base = rows[0]
    for row in rows[1:]:
        added = row["weights"] + row["pages"] + row["host"] - 3
        row["us_per_added_argument"] = (row["median_us"] - base["median_us"]) / added
    report = {"device_name": roofline.device_name(), "repeats": args.repeats, "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"launch of a compiled step on {report['device_name']} ({args.repeats} calls a row, the device idle)")
    for row in rows:
        extra = f", {row['us_per_added_argument']:.2f} us per added argument" if "us_per_added_argument" in row else ""
        print(f"  {row['name']:<20} {row['weights']:>3} weights, {row['pages']:>2} pages, {row['host']:>2} host arrays: "
              f"{row['median_us']:8.1f} us (min {row['min_us']:.1f}){extra}")
    return 0
