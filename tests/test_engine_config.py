"""EngineConfig's fused decode steps, as the CLI and the environment give them: a number, or auto."""

from __future__ import annotations

import argparse

import pytest

from worker.cli import _engine_overrides, engine_argv, parser
from worker.engine.config import MAX_AUTO_DECODE_STEPS, EngineConfig
from worker.service.config import WorkerConfig


def test_auto_fuses_what_fits_in_the_window():
    config = EngineConfig()
    assert config.decode_steps is None and config.decode_window_ms == 100.0
    assert config.fused_steps_for(0.010) == 10  # 100 ms / 10 ms
    assert config.fused_steps_for(0.0101) == 9  # never past the window
    assert config.fused_steps_for(0.004) == MAX_AUTO_DECODE_STEPS == 16  # 25 fit: capped
    assert config.fused_steps_for(0.5) == 1  # a step longer than the window still runs
    assert EngineConfig(decode_window_ms=40).fused_steps_for(0.010) == 4


@pytest.mark.parametrize("bad", [dict(decode_steps=0), dict(decode_window_ms=0), dict(decode_window_ms=-5),
                                 dict(compile_threads=0)])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)


def _worker_args(*flags: str) -> argparse.Namespace:
    return parser().parse_args(["worker", "--model", "m", *flags])


def test_cli_takes_a_number_or_auto_and_passes_it_on():
    assert "decode_steps" not in _engine_overrides(_worker_args("--decode-steps", "auto"))
    overrides = _engine_overrides(_worker_args("--decode-steps", "4", "--decode-window-ms", "40"))
    assert overrides["decode_steps"] == 4 and overrides["decode_window_ms"] == 40.0
    again = _engine_overrides(_worker_args(*engine_argv(overrides)))  # what `redjax serve` gives its workers
    assert again == overrides
    with pytest.raises(SystemExit):
        _worker_args("--decode-steps", "0")


def test_environment_takes_a_number_or_auto():
    def engine(env: dict) -> EngineConfig:
        return WorkerConfig.from_env({"model_dir": "m"}, environ=env).engine

    assert engine({"REDJAX_DECODE_STEPS": "auto"}).decode_steps is None
    assert engine({"REDJAX_DECODE_STEPS": "12", "REDJAX_DECODE_WINDOW_MS": "50"}) == EngineConfig(
        decode_steps=12, decode_window_ms=50.0)
    with pytest.raises(ValueError):
        engine({"REDJAX_DECODE_STEPS": "many"})


def test_compile_threads_from_the_cli_and_the_environment():
    overrides = _engine_overrides(_worker_args("--compile-threads", "3"))
    assert overrides["compile_threads"] == 3 and _engine_overrides(_worker_args(*engine_argv(overrides))) == overrides
    env = {"REDJAX_COMPILE_THREADS": "2"}
    assert WorkerConfig.from_env({"model_dir": "m"}, environ=env).engine.compile_threads == 2
    assert EngineConfig().compile_threads is None  # half the host's cores, at most 8


def test_pallas_tuning_from_the_cli_and_the_environment():
    overrides = _engine_overrides(_worker_args("--pallas-tuning", "8:4096:8:3"))
    assert overrides["pallas_tuning"] == "8:4096:8:3"
    assert _engine_overrides(_worker_args(*engine_argv(overrides))) == overrides  # what `redjax serve` passes on
    engine = WorkerConfig.from_env({"model_dir": "m"}, environ={"REDJAX_PALLAS_TUNING": "2:1024:4:2"}).engine
    assert engine.tuning() == (2, 1024, 4, 2) and EngineConfig().tuning() is None
    for bad in ("4:2048:4", "4:2048:3:2", "0:2048:4:2", "a:b:c:d", ""):
        with pytest.raises(ValueError, match="pallas_tuning must be PAGES:PROGRAMS:WARPS:STAGES"):
            EngineConfig(pallas_tuning=bad)


def test_pallas_prefill_from_the_cli_and_the_environment():
    overrides = _engine_overrides(_worker_args("--pallas-prefill"))
    assert overrides["pallas_prefill"] is True and "--pallas-prefill" in engine_argv(overrides)
    assert _engine_overrides(_worker_args(*engine_argv(overrides))) == overrides  # what `redjax serve` passes on
    assert "pallas_prefill" not in _engine_overrides(_worker_args())
    env = {"REDJAX_PALLAS_PREFILL": "1"}
    assert WorkerConfig.from_env({"model_dir": "m"}, environ=env).engine.pallas_prefill is True
    assert EngineConfig().pallas_prefill is None  # auto: with the Pallas decode kernel, where it compiles
    off = _engine_overrides(_worker_args("--no-pallas-prefill"))
    assert off["pallas_prefill"] is False and _engine_overrides(_worker_args(*engine_argv(off))) == off
    for raw, value in (("0", False), ("auto", None)):
        assert WorkerConfig.from_env({"model_dir": "m"}, environ={"REDJAX_PALLAS_PREFILL": raw}).engine.pallas_prefill is value


def test_async_overlap_auto_always_or_never_from_the_cli_and_the_environment():
    for flags, value in ((("--async-overlap",), True), (("--no-async-overlap",), False)):
        overrides = _engine_overrides(_worker_args(*flags))
        assert overrides["async_overlap"] is value
        assert _engine_overrides(_worker_args(*engine_argv(overrides))) == overrides  # what `redjax serve` passes on
    assert "async_overlap" not in _engine_overrides(_worker_args())

    def engine(env: dict) -> EngineConfig:
        return WorkerConfig.from_env({"model_dir": "m"}, environ=env).engine

    assert [engine({"REDJAX_ASYNC_OVERLAP": v}).async_overlap for v in ("auto", "true", "false")] == [None, True, False]
    # auto: always on accelerators and with speculation; decided step by step on the CPU (LLMEngine._dispatch_ahead)
    assert EngineConfig().for_backend("gpu").async_overlap is True
    assert EngineConfig().for_backend("cpu").async_overlap is None
    assert EngineConfig(speculative_tokens=4).for_backend("cpu").async_overlap is True
    assert EngineConfig(async_overlap=False).for_backend("gpu").async_overlap is False
