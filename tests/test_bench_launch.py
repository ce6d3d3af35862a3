"""`redjax bench launch`: the launch-time rows by argument kind, as JSON and as text. No
wall-clock thresholds: the figures are only checked to be measured (positive, median >= min)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.bench_support import run_bench
from worker.bench import launch


def test_launch_rows_grow_each_argument_kind_to_the_engines_count():
    code, out = run_bench("launch", "--repeats", "3", "--json")
    assert code == 0
    report = json.loads(out)
    rows = report["results"]
    assert [(r["name"], r["weights"], r["pages"], r["host"], r["products"]) for r in rows] == [
        tuple(row) for row in launch.ROWS]
    by_name = {r["name"]: (r["weights"], r["pages"], r["host"], r["products"]) for r in rows}
    assert by_name["all, batch unpacked"] == (291, 64, 26, 0)
    assert by_name["all, as the engine"] == by_name[launch.BUSY_ROW] == (291, 64, 1, 0)  # the batch packed
    # the engine's arguments again, to a program of one product a weight (a real step's kernel count)
    assert by_name[launch.PRODUCTS_ROW] == by_name[launch.PRODUCTS_BUSY_ROW] == (291, 64, 1, 291)
    for r in rows:
        assert 0 < r["min_us"] <= r["median_us"], r
    # each row adds arguments to the first, except the busy and products ones: an earlier row in another state
    others = {launch.BUSY_ROW, launch.PRODUCTS_ROW, launch.PRODUCTS_BUSY_ROW}
    assert "us_per_added_argument" not in rows[0] and {r["name"] for r in rows[-3:]} == others
    assert all("us_per_added_argument" not in r for r in rows[-3:])
    assert all("us_per_added_argument" in r for r in rows[1:-3])
    base = rows[0]["median_us"]
    assert rows[1]["us_per_added_argument"] == pytest.approx((rows[1]["median_us"] - base) / 290)

    code, text = run_bench("launch", "--repeats", "2")
    assert code == 0 and text.startswith("launch of a compiled step on ")
    assert all(f"{r['name']}" in text for r in rows) and text.count(" us (min ") == len(rows)
    assert text.count(", 291 products: ") == 2


def test_the_products_stand_in_multiplies_through_every_weight():
    """One product a weight, in order, before the host arrays join: its program has a real step's kernel count."""
    pages = (jnp.zeros((16, 16), jnp.bfloat16), jnp.ones((16, 16), jnp.bfloat16))
    host = (np.full(16, 4, np.int32),)
    zero = (jnp.eye(16, dtype=jnp.bfloat16), jnp.zeros((16, 16), jnp.bfloat16))  # the last weight zeroes the chain
    new_pages, s = launch._products_step(zero, pages, host)
    assert float(s) == 4 and [float(p[0, 0]) for p in new_pages] == [4.0, 5.0]
    eye = (jnp.eye(16, dtype=jnp.bfloat16),) * 3  # tanh(tanh(tanh(0.5 * ones))) in every entry
    _, s = launch._products_step(eye, pages, host, (jnp.full(16, 7, jnp.int32),))
    assert float(s) == pytest.approx(256 * np.tanh(np.tanh(np.tanh(0.5))) + 4 + 7, rel=2e-2)
    lowered = jax.jit(launch._products_step).lower((jnp.eye(16, dtype=jnp.bfloat16),) * 5, pages, host)
    assert lowered.as_text().count("dot_general") == 5


def test_the_stand_in_step_reads_every_argument_and_updates_every_page():
    weights = (jnp.full((16, 16), 2.0, jnp.bfloat16), jnp.full((16, 16), 3.0, jnp.bfloat16))
    pages = (jnp.zeros((16, 16), jnp.bfloat16), jnp.ones((16, 16), jnp.bfloat16))
    host = (np.full(16, 4, np.int32), np.full(16, 5, np.int32))
    new_pages, s = launch._step(weights, pages, host)
    assert float(s) == 2 + 3 + 4 + 5
    assert [float(p[0, 0]) for p in new_pages] == [14.0, 15.0] and all(p.dtype == jnp.bfloat16 for p in new_pages)


def test_a_busy_launch_takes_the_running_calls_output():
    """The busy row's stand-in takes the output of the call in front of it (pending when launched),
    as the engine's step takes the previous step's tokens; it still reads every argument."""
    weights = (jnp.full((16, 16), 2.0, jnp.bfloat16),)
    pages = (jnp.zeros((16, 16), jnp.bfloat16),)
    _, s = launch._step(weights, pages, (np.full(16, 4, np.int32),), (jnp.full(16, 7, jnp.int32),))
    assert float(s) == 2 + 4 + 7
    hog, x = launch.busy_call(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    y, tokens = hog(x)
    assert y.shape == x.shape and tokens.shape == (16,) and tokens.dtype == jnp.int32
    times = launch.launch_us(3, 2, 1, repeats=4, busy=True)
    assert len(times) == 4 and min(times) > 0
    times = launch.launch_us(3, 2, 1, repeats=4, busy=True, products=True)
    assert len(times) == 4 and min(times) > 0


def test_launch_refuses_no_repeats():
    with pytest.raises(SystemExit) as exit_:
        run_bench("launch", "--repeats", "0")
    assert exit_.value.code == 2


def test_gpu_bench_launch_run_writes_its_report_and_a_summary_line_per_row(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable, "DEADLINE_S": "300"}
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", "launch", "--out", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "launch.json").read_text())["results"]
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert lines == done.stdout.splitlines() and len(lines) == len(rows) == len(launch.ROWS)
    for line, row in zip(lines, rows):
        products = f", {row['products']} products" if row["products"] else ""
        assert line.startswith(f"launch {row['name']} ({row['weights']} weights, {row['pages']} pages, "
                               f"{row['host']} host arrays{products}): {row['median_us']:.0f} us"), line
