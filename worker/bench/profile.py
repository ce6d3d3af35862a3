"""`bench offline --profile DIR`: where a prefill call's and a steady decode step's device time
goes, kernel by kernel.

After the timed rounds, one more round of the same workload runs. From its second call that holds
prompt chunks, the JAX profiler traces `calls` such calls into DIR/prefill (the step in flight
waited for at both ends, so the trace holds exactly those calls' batches); once two engine calls
in a row are pure decode (every prompt prefilled), it traces the next `calls` calls into
DIR/decode. The traces (Perfetto JSON, for ui.perfetto.dev or TensorBoard) stay there. Each
summary groups the trace's device events by kernel name, each with its share of the traced
device time, its milliseconds per decode step (per call for prefill) and its kind (the decode
attention kernel, matrix products, copies, scatters, the rest), and says how busy the device was
across the window: the idle gaps between kernels, short ones (launch latency) apart from long
ones (the device waiting on the host). On a CPU, where XLA runs its ops on host threads, those
threads' op events stand in for a device's, and each kernel call (`ffi_call.N` there) is named by
its target in the compiled programs.

The timed figures are not touched: the profiled round comes after them, and the profiler's
overhead stays in it. Once traced, the round's requests are aborted (on a lent GPU its remaining
tens of seconds would say nothing new).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

import jax

from worker.bench.launch_trace import family, launch_breakdown
from worker.bench.launch_trace import lines as launch_lines
from worker.engine.runner import landed

# a kernel's kind: the first whose words appear in its lowercased name
KINDS = (
    ("attention", ("attention",)),
    ("matmul", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot")),
    ("copy", ("copy", "memcpy", "memset", "transpose")),
    ("scatter", ("scatter", "dynamic_update_slice", "dynamic-update-slice", "kv_write")),
)
# host-thread events that are bookkeeping, not an XLA op (the CPU fallback)
HOST_NOISE = ("threadpool", "await", "end: ", "thunkexecutor", "execute")
# XLA's control flow on a CPU: the thread that runs a `while` (a fused decode call's loop over its
# steps) or a conditional (JAX names it `cond`: the int8 greedy head's) shows it as one event around
# the ops it ran, which count on their own. Matched by the name's first dotted part
CONTAINERS = ("while", "conditional", "cond", "call")
TOP = 15  # kernels listed by name; the rest are summed into their kinds only
Shape = tuple[int, int, int]  # a product's (M, K, N): x [M, K] times a weight [K, N]
# XLA runs a GPU program op by op while a profiler is active, not through the command buffers (CUDA
# graphs) its timed calls use, unless told otherwise: the traced launches would be another launch
COMMAND_BUFFERS_FLAG = "--xla_enable_command_buffers_during_profiling"


def trace_as_timed(environ: dict) -> None:
    """Have XLA keep its command buffers in traced calls (unless XLA_FLAGS already says): call it
    before JAX's backend starts, which reads XLA_FLAGS once. Inert on a CPU, which has none."""
    flags = environ.get("XLA_FLAGS", "")
    if COMMAND_BUFFERS_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFERS_FLAG}=true".strip()


def kind(name: str) -> str:
    lower = name.lower()
    return next((k for k, words in KINDS if any(w in lower for w in words)), "other")


def profile_decode(engine, probe, prompts: list[list[int]], output_lens: list[int], work, directory: str,
                   calls: int) -> dict:
    """Run `prompts` to the end, tracing `calls` calls that hold prompt chunks into DIR/prefill,
    then `calls` steady decode calls into DIR/decode -> the decode trace's summary, with the
    prefill one under "prefill" (or why there was none under "prefill_error")."""
    from worker.bench.offline import WorkloadError, submit

    outputs = submit(engine, prompts, output_lens, work, tag="profile")
    programs = ProgramsRun(engine.runner)
    prefill = PrefillWindow(engine, probe, str(Path(directory) / "prefill"), calls, programs)
    pure_in_a_row, traced, tracing, steps0, decode_run = 0, 0, False, 0, {}
    while engine.has_unfinished():
        prefill.before_call()
        prefill_calls = probe.prefill.calls
        for out in probe.step(engine):
            outputs[out.request_id] += out.token_ids
        prefill.after_call()
        pure_in_a_row = pure_in_a_row + 1 if probe.prefill.calls == prefill_calls else 0
        if tracing:
            traced += 1
            if traced == calls or not engine.has_unfinished():
                _settle(engine)  # launched in the window: traced whole
                jax.profiler.stop_trace()
                decode_run, tracing = programs.stop(), False
                steps = probe.decode.decode_steps - steps0
                for request_id in outputs:  # the rest of the round tells nothing new (device time is scarce)
                    engine.abort(request_id)
        elif traced == 0 and pure_in_a_row >= 2 and not prefill.tracing:
            start_trace(str(Path(directory) / "decode"))
            tracing, steps0 = True, probe.decode.decode_steps
            programs.start()
    prefill.close()
    if traced == 0:
        raise WorkloadError("the profiled round never reached two decode-only calls in a row: nothing was traced "
                         "(longer outputs, or fewer prompts than --max-num-seqs, give it some)")
    # a GPU trace names its kernels; a CPU one names HLO ops, whose targets the programs that ran hold
    on_cpu = jax.default_backend() == "cpu"
    layers = engine.model_config.num_layers
    texts = programs.texts(decode_run) if on_cpu else []
    summary = summarize(newest_trace(str(Path(directory) / "decode")), steps, layers, op_targets(texts),
                        op_products(texts))
    report = {"directory": directory, "calls": traced, **summary}
    if prefill.batches:
        texts = programs.texts(prefill.run) if on_cpu else []
        report["prefill"] = prefill.summary(op_targets(texts), op_products(texts))
    else:
        report["prefill_error"] = prefill.why_not()
    return report


def start_trace(directory: str) -> None:
    """The JAX profiler on, with Python's frames traced on the host (the launch breakdown reads
    the runner's `_run` among them), whatever the profiler's default."""
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 1
    except (AttributeError, TypeError):  # a profiler without these options: its defaults (frames on in jax 0.10)
        options = None
    jax.profiler.start_trace(directory, create_perfetto_trace=True, profiler_options=options)


def _settle(engine) -> None:
    """Wait for the step in flight, so a trace starts or ends on the device's call boundary."""
    flight = getattr(engine, "_inflight", None)
    if flight is not None:
        jax.block_until_ready(landed(flight.out))


class ProgramsRun:
    """The compiled step variants an engine runs between start() and stop(), recorded by a wrapper
    on its runner's `_run` (the engine code is unchanged): a CPU trace names a kernel call by its
    HLO op name, which other variants may give another kernel, so the names are read from the
    programs that ran in the window alone."""

    def __init__(self, runner):
        self.runner, self.batches, self.recording = runner, {}, False
        run = runner._run

        def _run(key, db):
            if self.recording:
                self.batches.setdefault(key, db)
            return run(key, db)

        runner._run = _run

    def start(self) -> None:
        self.batches, self.recording = {}, True

    def stop(self) -> dict:
        """The variants run since start(), each with a batch of its shape."""
        self.recording = False
        return self.batches

    def texts(self, batches: dict) -> list[str]:
        """The optimized HLO of each variant in `batches`. One compiled in the background has its
        executable at hand; one that ran through `jit` is compiled again from the same lowering (the
        names of its ops, a fused decode loop's included, are the ones its trace shows), outside
        the timed rounds."""
        runner = self.runner
        return [runner.ready[key].as_text() if key in runner.ready
                else runner._lower(key, db, runner._specs()).compile().as_text() for key, db in batches.items()]


class PrefillWindow:
    """Traces `calls` engine calls whose batches hold prompt chunks (prefill, with whatever decode
    rows run beside them), from the second such call on: the first admits the first prompts alone.
    The step in flight is waited for at both ends, so the trace holds exactly the batches the
    window's calls launched, and each one's prompt tokens and decode rows are known."""

    def __init__(self, engine, probe, directory: str, calls: int, programs: ProgramsRun):
        self.engine, self.probe, self.directory, self.calls = engine, probe, directory, calls
        self.programs, self.run = programs, {}  # the variants the traced calls ran (ProgramsRun.stop)
        self.tracing = False
        self.done = False
        self.calls_before = probe.prefill.calls  # the timed rounds' (the probe counts on)
        self.batches: list[tuple[int, int]] = []  # (prompt tokens, decode rows) of each traced batch

    def _prompts_left(self) -> bool:
        """Whether the next batch will hold a prompt chunk: prompts wait or are part computed."""
        scheduler = self.engine.scheduler
        return bool(scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running)

    def before_call(self) -> None:
        if self.tracing and not self._prompts_left():
            self.close()
        elif not self.tracing and not self.done and self.probe.prefill.calls > self.calls_before and self._prompts_left():
            _settle(self.engine)
            start_trace(self.directory)
            self.programs.start()
            self.tracing = True

    def after_call(self) -> None:
        if not self.tracing:
            return
        batch = self.probe.last_scheduled
        if batch is not None and batch.chunks:
            self.batches.append((sum(c.num_tokens for c in batch.chunks if not c.is_decode),
                                 sum(1 for c in batch.chunks if c.is_decode)))
        if len(self.batches) >= self.calls:
            self.close()

    def close(self) -> None:
        if self.tracing:
            _settle(self.engine)
            jax.profiler.stop_trace()
            self.run = self.programs.stop()
            self.tracing, self.done = False, True

    def why_not(self) -> str:
        return ("no call held prompt chunks after the first: every prompt was admitted in one call "
                "(more or longer prompts give the profile some)")

    def summary(self, targets: dict[str, str], products: dict[str, Shape]) -> dict:
        """Device time per batch (the summary's "steps" are the traced batches) and per prompt token."""
        batches = len(self.batches)
        tokens = sum(t for t, _ in self.batches)
        s = summarize(newest_trace(self.directory), batches, 0, targets, products)
        s.update(calls=batches, prompt_tokens_per_step=tokens / batches,
                 decode_rows_per_step=sum(r for _, r in self.batches) / batches,
                 device_us_per_prompt_token=s["device_ms_per_step"] * 1e3 * batches / max(tokens, 1))
        return s


def op_targets(texts) -> dict[str, str]:
    """HLO op name -> its custom call's target, from compiled programs' text. Step variants may
    give one name different targets, and the trace cannot say which program ran: such a name gets
    its targets joined ("a|b") where they are all of one kind (their time is still that kind's), and
    is left out where they are not."""
    found: dict[str, set[str]] = {}
    for text in texts:
        for name, target in re.findall(r'%([\w.\-]+) = [^\n]*?custom_call_target="([^"]+)"', text):
            found.setdefault(name, set()).add(target)
    return {name: "|".join(sorted(ts)) for name, ts in found.items() if len({kind(t) for t in ts}) == 1}


def op_products(texts) -> dict[str, Shape]:
    """HLO op name -> (M, K, N) of a matrix-product kernel call (x f32[M, K] times a packed weight
    -> f32[M, N], or the int8 head's s32[M, N] sums first in a tuple), from compiled programs' text;
    a name that programs give different shapes is left out, as the trace cannot say which one ran."""
    found: dict[str, set[Shape]] = {}
    pattern = (r'%([\w.\-]+) = \(?[fs]32\[(\d+),(\d+)\][^\n]*?custom_call_target="([^"]+)"'
               r'[^\n]*?operand_layout_constraints=\{f32\[\d+,(\d+)\]')
    for text in texts:
        for name, m, n, target, k in re.findall(pattern, text):
            if kind(target) == "matmul":
                found.setdefault(name, set()).add((int(m), int(k), int(n)))
    return {name: next(iter(shapes)) for name, shapes in found.items() if len(shapes) == 1}


def newest_trace(directory: str) -> Path:
    traces = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    return traces[-1]


def summarize(trace: Path, decode_steps: int, num_layers: int = 0, targets: dict[str, str] | None = None,
              products: dict[str, Shape] | None = None) -> dict:
    """Device time by kernel (numbering dropped: `family`) and by kind, per decode step and as
    shares of the traced total, with each kernel's launches per step; and how busy the device
    was from its first traced kernel to its last, with the idle gaps between kernels split into
    short ones (under GAP_US: launch latency) and long ones (the device waiting on the host).

    Steps: where the decode attention kernel shows (a GPU's Pallas kernel, once a layer a step),
    its launches over `num_layers` (a fraction where the window cut a step: that step's kernels
    count in proportion); else `decode_steps`, the steps of the calls read back in the window.

    `products` (op name -> (M, K, N), a CPU's kernel calls): the products' time is also given by
    shape, each with its rate, so a slow projection shows among the fast ones."""
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    ops, intervals = op_events(events, targets or {})
    by_shape = shape_events(events, products or {})
    total = sum(us for us, _ in ops.values()) or 1.0
    by_kind: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, (us, calls) in ops.items():
        by_kind[kind(name)][0] += us
        by_kind[kind(name)][1] += calls
    attention_calls = by_kind["attention"][1] if "attention" in by_kind else 0
    counted = bool(attention_calls and num_layers)
    steps = attention_calls / num_layers if counted else max(decode_steps, 1)

    def row(us: float, calls: int) -> dict:
        return {"ms_per_step": us / 1e3 / steps, "share": us / total, "calls_per_step": calls / steps}

    top = sorted(ops.items(), key=lambda item: -item[1][0])[:TOP]
    span, busy, short, long, long_count = busy_time(intervals)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    launch = launch_breakdown(events, threads)
    return {
        "trace": str(trace), "decode_steps": steps, "steps_from": "attention kernels" if counted else "engine",
        "device_ms_per_step": total / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps, "busy_fraction": busy / span if span else 0.0,
        "short_gaps_ms_per_step": short / 1e3 / steps, "long_gaps_ms_per_step": long / 1e3 / steps,
        "long_gaps": long_count,
        "by_kind": {k: row(*v) for k, v in sorted(by_kind.items(), key=lambda item: -item[1][0])},
        "top": [{"name": name, "kind": kind(name), **row(*v)} for name, v in top],
        "products": [{"m": m, "k": k, "n": n, **row(us, calls), "us_per_call": us / calls,
                      "gflops": 2 * m * k * n * calls / us / 1e3}
                     for (m, k, n), (us, calls) in sorted(by_shape.items(), key=lambda item: -item[1][0])],
        # product calls whose programs gave their name several shapes (step variants): not by shape
        "products_unshaped_ms_per_step": (max(0.0, by_kind["matmul"][0] - sum(us for us, _ in by_shape.values()))
                                          / 1e3 / steps if by_shape else 0.0),
        **({"launch": launch} if launch else {}),
    }


GAP_US = 50.0  # an idle gap between kernels shorter than this is launch latency, longer the host


def busy_time(intervals: list[tuple[float, float]]) -> tuple[float, float, float, float, int]:
    """(start, end) microseconds of kernels -> (span, busy, short gaps, long gaps, long-gap count)."""
    if not intervals:
        return 0.0, 0.0, 0.0, 0.0, 0
    intervals = sorted(intervals)
    busy = short = long = 0.0
    count = 0
    start, end = intervals[0]
    for a, b in intervals[1:]:
        if a <= end:  # overlapping kernels (several streams) are busy once
            end = max(end, b)
            continue
        busy += end - start
        gap = a - end
        if gap < GAP_US:
            short += gap
        else:
            long += gap
            count += 1
        start, end = a, b
    busy += end - start
    span = max(b for _, b in intervals) - intervals[0][0]
    return span, busy, short, long, count


def kernel_events(events: list[dict]) -> list[dict]:
    """The trace's op events on the device's kernel lines: a GPU's streams (not the lines that
    repeat them per XLA op or module), else, on a CPU, XLA's host threads less their bookkeeping
    and control-flow events."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {key: name for key, name in threads.items() if processes.get(key[0], "").startswith("/device:")}
    streams = {key for key, name in device.items() if "stream" in name.lower()}
    if streams:
        lines, noise = streams, ()
    else:
        lines = {key for key, name in threads.items() if name.startswith("tf_XLA")}
        noise = HOST_NOISE
    return [e for e in events
            if e.get("ph") == "X" and (e["pid"], e["tid"]) in lines and not any(w in e["name"].lower() for w in noise)
            and not (noise and e["name"].split(".")[0].lower() in CONTAINERS)]


def op_events(events: list[dict], targets: dict[str, str]) -> tuple[dict[str, tuple[float, int]],
                                                                    list[tuple[float, float]]]:
    """(microseconds, events) by op family (an op named in `targets`: by its target) over
    `kernel_events`; and each event's (start, end)."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in kernel_events(events):
        dur = float(e.get("dur", 0.0))
        entry = out[family(targets.get(e["name"], e["name"]))]
        entry[0] += dur
        entry[1] += 1
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
    return {name: (us, calls) for name, (us, calls) in out.items()}, intervals


def shape_events(events: list[dict], products: dict[str, Shape]) -> dict[Shape, tuple[float, int]]:
    """(microseconds, events) of the product calls named in `products`, by their (M, K, N)."""
    out: dict[Shape, list] = defaultdict(lambda: [0.0, 0])
    for e in kernel_events(events) if products else ():
        shape = products.get(e["name"])
        if shape is not None:
            out[shape][0] += float(e.get("dur", 0.0))
            out[shape][1] += 1
    return {shape: (us, calls) for shape, (us, calls) in out.items()}


def table(profile: dict) -> list[str]:
    lines = [f"profile: {profile['calls']} decode calls ({profile['decode_steps']:.1f} steps) traced to "
             f"{profile['directory']}/decode; device time {profile['device_ms_per_step']:.2f} ms per step",
             *_kernels(profile, "step")]
    p = profile.get("prefill")
    if p:
        lines += [f"prefill: {p['calls']} calls with prompt chunks ({p['prompt_tokens_per_step']:.0f} prompt tokens and "
                  f"{p['decode_rows_per_step']:.1f} decode rows each) traced to {profile['directory']}/prefill; "
                  f"device time {p['device_ms_per_step']:.2f} ms per call, {p['device_us_per_prompt_token']:.2f} us "
                  "per prompt token", *_kernels(p, "call")]
    elif "prefill_error" in profile:
        lines.append(f"prefill: not traced ({profile['prefill_error']})")
    return lines


def _kernels(summary: dict, unit: str) -> list[str]:
    lines = [f"  first kernel to last: {summary['span_ms_per_step']:.2f} ms per {unit}, busy "
             f"{summary['busy_fraction']:.0%}; idle gaps under {GAP_US:.0f} us {summary['short_gaps_ms_per_step']:.2f} ms, "
             f"longer {summary['long_gaps_ms_per_step']:.2f} ms per {unit} ({summary['long_gaps']} of them)",
             "  by kind: " + ", ".join(f"{k} {r['ms_per_step']:.2f} ms ({r['share']:.0%})"
                                      for k, r in summary["by_kind"].items())]
    for r in summary["top"]:
        lines.append(f"  {r['ms_per_step']:>8.3f} ms {r['share']:>6.1%} {r['calls_per_step']:>6.1f}/{unit:<4}  "
                     f"{r['kind']:<9} {r['name'][:80]}")
    if summary.get("products"):
        lines.append("  products by shape (rows x in x out):")
        for r in summary["products"]:
            lines.append(f"  {r['ms_per_step']:>8.3f} ms {r['share']:>6.1%} {r['calls_per_step']:>6.1f}/{unit:<4}  "
                         f"{r['m']} x {r['k']} x {r['n']}: {r['us_per_call']:.0f} us a call, {r['gflops']:.0f} GFLOP/s")
        if summary["products_unshaped_ms_per_step"] > 0.005 * summary["device_ms_per_step"]:
            lines.append(f"  {summary['products_unshaped_ms_per_step']:>8.3f} ms of products whose step variants "
                         "gave one call different shapes")
    if "launch" in summary:
        lines += launch_lines(summary["launch"], "call")
    return lines
