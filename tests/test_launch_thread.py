"""`launch_thread`: each step's jitted call launched from a helper thread while the engine thread
reads back and schedules. Same tokens as the engine launching its calls itself (greedy and seeded
sampling, prompts chunked beside decode rows, fused decode steps, sequences ending mid-call), the
same pages free at the end, a launch's error raised from `step()`, and the bench probe counting
the launches apart from the engine thread's host time; on by default on accelerators alone."""

from __future__ import annotations

import threading

import pytest

from worker.bench.offline import Workload, make_engine, submit
from worker.bench.probe import StepProbe
from worker.cli import engine_argv, main, parser
from worker.engine.config import EngineConfig

SMALL = {"max_num_batched_tokens": 64, "decode_steps": 4, "max_num_seqs": 8}


def run(launch_thread: bool, work: Workload, probe: StepProbe | None = None):
    engine, _ = make_engine(None, "llama-tiny", {**SMALL, "launch_thread": launch_thread}, work)
    probe = probe.install(engine) if probe is not None else None
    prompts = work.round_prompts(engine.model_config.vocab_size, 0)
    outputs = submit(engine, prompts, work.output_lens, work, tag="r")
    while engine.has_unfinished():
        for out in (probe.step(engine) if probe else engine.step()):
            outputs[out.request_id] += out.token_ids
    return engine, outputs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_launch_thread_gives_the_same_tokens(temperature):
    work = Workload(num_prompts=10, input_len=40, output_len=24, range_ratio=0.5, temperature=temperature, top_p=0.9)
    _, alone = run(False, work)
    engine, threaded = run(True, work)
    assert threaded == alone and all(len(t) == n for t, (_, n) in zip(threaded.values(), work.sizes))
    assert engine.runner._launcher is not None
    engine.allocator.uncache(engine.allocator.cache_entries())  # the prefix cache keeps full prompt pages
    assert engine.pages_used == 0


def test_launches_run_on_the_launch_thread_in_dispatch_order():
    work = Workload(num_prompts=4, input_len=20, output_len=12)
    engine, _ = make_engine(None, "llama-tiny", {**SMALL, "launch_thread": True}, work)
    seen, run_ = [], engine.runner._run

    def recording(key, db):
        seen.append((threading.current_thread().name, key[0].decode_steps, key[0].num_prefill))
        return run_(key, db)

    engine.runner._run = recording
    submit(engine, work.round_prompts(engine.model_config.vocab_size, 0), 12, work, tag="o")
    while engine.has_unfinished():
        engine.step()
    assert seen and all(name.startswith("redjax-launch") for name, _, _ in seen)
    assert seen[0][2] > 0 and seen[-1][2] == 0  # prompts first, decode calls last


def test_an_error_in_a_launch_is_raised_from_step():
    work = Workload(num_prompts=2, input_len=8, output_len=40)
    engine, _ = make_engine(None, "llama-tiny", {**SMALL, "launch_thread": True}, work)
    calls, run_ = [0], engine.runner._run

    def failing(key, db):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the device went away")
        return run_(key, db)

    engine.runner._run = failing
    submit(engine, work.round_prompts(engine.model_config.vocab_size, 0), 40, work, tag="e")
    with pytest.raises(RuntimeError, match="the device went away"):
        for _ in range(20):
            engine.step()


def test_the_probe_counts_the_launch_thread_apart_from_host_time():
    work = Workload(num_prompts=6, input_len=30, output_len=20)
    probe = StepProbe()
    run(True, work, probe)
    for phase in (probe.decode, probe.prefill):
        assert phase.calls and phase.launch_s == 0 and phase.launch_thread_s > 0, phase
        parts = phase.schedule_s + phase.build_s + phase.launch_s + phase.postprocess_s
        assert min(phase.schedule_s, phase.build_s, phase.postprocess_s) >= 0
        assert parts == pytest.approx(phase.host_s, abs=1e-6)


def test_on_by_default_on_accelerators_and_off_on_the_cpu():
    assert EngineConfig().for_backend("gpu").launch_thread is True
    assert EngineConfig().for_backend("tpu").launch_thread is True
    assert EngineConfig().for_backend("cpu").launch_thread is False
    assert EngineConfig(launch_thread=False).for_backend("gpu").launch_thread is False
    assert EngineConfig(launch_thread=True).for_backend("cpu").launch_thread is True


def test_the_flag_reaches_the_engine_and_child_processes(capsys):
    assert engine_argv({"launch_thread": True}) == ["--launch-thread"]
    assert engine_argv({"launch_thread": False}) == ["--no-launch-thread"]
    assert parser().parse_args(["worker", "--no-launch-thread"]).launch_thread is False
    assert parser().parse_args(["worker"]).launch_thread is None
    assert main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "24", "--launch-thread"]) == 0
    assert "on the launch thread" in capsys.readouterr().out
