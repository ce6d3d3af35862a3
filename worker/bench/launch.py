"""`redjax bench launch`: how long a compiled step takes to launch, by what it is handed.

The engine's step takes a few hundred arrays a call: llama3-8b passes 291 weight arrays and 64 KV
page arrays (one per layer and kind, the pages donated). Until session 40 it also passed the batch
as ~26 host arrays; it now packs them into one (`batch.pack`). On an H200 that call took ~8 ms to
return (session 34: 8.5 ms a call of 16 fused decode steps, 12.6 % of the decode phase at 128/128,
over issue 7's 10 % host target), against ~1.5 ms for the same number of arrays on this
project's CPUs. This bench times the launch alone, with the device idle and each argument tiny,
so the figure is the runtime's cost per argument: a call with one of each kind, then with each
kind grown to the engine's count, then all together, with the batch as 26 host arrays and as the
engine now hands it, one. The rows say which kind to cut. The last row launches the engine's
arguments as the engine does, behind a call that keeps the device busy (~5 ms of square products)
and taking that call's output, as a step takes the previous step's tokens: on an H200 the engine's
own launch took ~7 ms against this bench's ~1.2 ms idle (session 42), and the row says whether a
busy device is the difference. The stand-in's program is a few kernels where a real step's is
hundreds; the two "products" rows hand over the same arguments to a program that multiplies
through every weight in turn, one product (one kernel) each, as a step's layers do: on a GPU, where
XLA records a program's kernels into command buffers (CUDA graphs) and must re-record them when an
address they use changes, as each call's batch does, these rows say what a program's size costs a
launch (run them again with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` for the op-by-op launch).

Each row: microseconds from the call to its return (the asynchronous launch; the outputs are waited
for before the next call), the median and the minimum of `--repeats` calls, and the microseconds
per added argument over the first row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from worker.bench import roofline

ENGINE = (291, 64, 26)  # llama3-8b's step: weight arrays, page arrays (donated), host arrays unpacked
BUSY_ROW = "all, as the engine, device busy"
PRODUCTS_ROW = "as the engine, products"
PRODUCTS_BUSY_ROW = "as the engine, products, busy"
BUSY = (BUSY_ROW, PRODUCTS_BUSY_ROW)  # rows launched behind a call still running whose output they take
# (name, weight arrays, page arrays, host arrays, products) of each row. The busy ones launch as the
# engine does, behind a call still running whose output they take (the previous step and its
# tokens); the products rows run a program of one product a weight (a real step's kernel count)
ROWS = (("one of each", 1, 1, 1, 0), ("weights", ENGINE[0], 1, 1, 0), ("pages, donated", 1, ENGINE[1], 1, 0),
        ("host arrays", 1, 1, ENGINE[2], 0), ("all, batch unpacked", *ENGINE, 0),
        ("all, as the engine", *ENGINE[:2], 1, 0), (BUSY_ROW, *ENGINE[:2], 1, 0),
        (PRODUCTS_ROW, *ENGINE[:2], 1, ENGINE[0]), (PRODUCTS_BUSY_ROW, *ENGINE[:2], 1, ENGINE[0]))
BUSY_S = 0.005  # how long the call in front of each busy launch runs, at least


def _step(weights: tuple, pages: tuple, host: tuple, pending: tuple = ()):
    """A stand-in for the engine's step: reads every argument, updates every page array."""
    s = sum(w[0, 0] for w in weights) + sum(h[0] for h in (*host, *pending)).astype(jnp.float32)
    return tuple((p + s).astype(p.dtype) for p in pages), s


def _products_step(weights: tuple, pages: tuple, host: tuple, pending: tuple = ()):
    """The stand-in with a real step's kernel count: a [16, 16] operand multiplied through every
    weight in turn (tanh between: one product, one kernel, each); the sum of its entries joins
    the host arrays' in what every page array gets."""
    y = jnp.full((16, 16), 0.5, weights[0].dtype)  # bf16[16, 16]
    for w in weights:
        y = jnp.tanh(y @ w)
    s = y.astype(jnp.float32).sum() + sum(h[0] for h in (*host, *pending)).astype(jnp.float32)
    return tuple((p + s).astype(p.dtype) for p in pages), s


def busy_call(device) -> tuple:
    """(call, x): `call(x) -> (x, i32[16])` keeps the device busy for at least BUSY_S, products of
    square matrices in a loop of fixed length (no host round trip between iterations)."""
    n = 512 if jax.default_backend() == "cpu" else 4096
    x = jax.device_put(jnp.full((n, n), 1e-3, jnp.float32), device)

    def work(x, loops: int):  # x f32[n, n]
        x = jax.lax.fori_loop(0, loops, lambda i, y: jnp.tanh(y @ y), x)
        return x, (x[0, :16] * 1e3).astype(jnp.int32)

    once = jax.jit(partial(work, loops=1))
    jax.block_until_ready(once(x))
    t = time.perf_counter()
    jax.block_until_ready(once(x))
    loops = max(1, math.ceil(BUSY_S / max(time.perf_counter() - t, 1e-6)))
    return jax.jit(partial(work, loops=loops)), x


def launch_us(weights: int, pages: int, host: int, repeats: int, busy: bool = False,
              products: bool = False) -> list[float]:
    """Microseconds each of `repeats` launches took: with the device idle before each, or (`busy`)
    right behind a call that keeps it busy, whose output the launch takes as an argument; the
    stand-in's program, or (`products`) one of a product a weight."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ws = tuple(jax.device_put(jnp.ones((16, 16), jnp.bfloat16), device) for _ in range(weights))
    ps = tuple(jax.device_put(jnp.zeros((16, 16), jnp.bfloat16), device) for _ in range(pages))
    hs = tuple(np.ones(16, np.int32) for _ in range(host))
    hog, x = busy_call(device) if busy else (None, None)
    pending = (jax.device_put(np.ones(16, np.int32), device),) if busy else ()
    step = jax.jit(_products_step if products else _step, donate_argnums=(1,)).lower(ws, ps, hs, pending).compile()
    times = []
    for _ in range(repeats + 3):  # the first calls warm the runtime's caches
        if busy:
            x, tokens = hog(x)  # launched, not waited for
            pending = (tokens,)
        t = time.perf_counter()
        ps, s = step(ws, ps, hs, pending)
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
    for name, weights, pages, host, products in ROWS:
        times = launch_us(weights, pages, host, args.repeats, busy=name in BUSY, products=products > 0)
        rows.append({"name": name, "weights": weights, "pages": pages, "host": host, "products": products,
                     "median_us": float(np.median(times)), "min_us": float(min(times))})
    base = rows[0]
    for row in rows[1:]:
        if row["name"] in BUSY or row["products"]:  # a row before it in another state, not more arguments
            continue
        added = row["weights"] + row["pages"] + row["host"] - 3
        row["us_per_added_argument"] = (row["median_us"] - base["median_us"]) / added
    report = {"device_name": roofline.device_name(), "repeats": args.repeats, "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"launch of a compiled step on {report['device_name']} ({args.repeats} calls a row, the device idle "
          "but where busy)")
    for row in rows:
        extra = f", {row['us_per_added_argument']:.2f} us per added argument" if "us_per_added_argument" in row else ""
        products = f", {row['products']} products" if row["products"] else ""
        print(f"  {row['name']:<20} {row['weights']:>3} weights, {row['pages']:>2} pages, {row['host']:>2} host arrays"
              f"{products}: {row['median_us']:8.1f} us (min {row['min_us']:.1f}){extra}")
    return 0
