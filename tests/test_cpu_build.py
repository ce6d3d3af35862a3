"""worker/engine/cpu_build.py: the kernels are compiled several at once into the cache before the
first registration, and a kernel that fails to build leaves only itself to the XLA path."""

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import pytest

from worker.engine import cpu_build

SOURCE = 'extern "C" int redjax_test_value() {{ return {value}; }}\n'


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A kernel folder of three tiny sources and an empty cache, both private to the test."""
    src = tmp_path / "src"
    src.mkdir()
    for value, name in enumerate(("a", "b", "c")):
        (src / f"{name}.cc").write_text(SOURCE.format(value=value))
    monkeypatch.setattr(cpu_build, "KERNELS", src)
    monkeypatch.setenv("REDJAX_KERNEL_DIR", str(tmp_path / "cache"))
    cpu_build.build_all.cache_clear()
    yield src
    cpu_build.build_all.cache_clear()


def test_build_all_compiles_every_kernel_at_once_and_later_builds_reuse_them(kernels, monkeypatch):
    run, active, most = cpu_build.subprocess.run, [0], [0]
    lock = threading.Lock()

    def counted(*args, **kwargs):  # how many compilers run at the same time
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.3)  # long enough for the other threads to start theirs
        try:
            return run(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(cpu_build.subprocess, "run", counted)
    monkeypatch.setattr(cpu_build.os, "cpu_count", lambda: 2)
    assert cpu_build.build_all() == 3
    assert most[0] == 2  # one compiler per core

    def no_compiler(*args, **kwargs):
        raise AssertionError("the cache should have had it")

    monkeypatch.setattr(cpu_build.subprocess, "run", no_compiler)
    for value, name in enumerate(("a", "b", "c")):
        library = cpu_build.build(kernels / f"{name}.cc")
        assert library is not None and library.exists()
        assert ctypes.CDLL(str(library)).redjax_test_value() == value
    assert cpu_build.build_all() == 3  # once per process: no second round


def test_a_kernel_that_fails_to_build_leaves_the_others_registered(kernels, caplog):
    (kernels / "broken.cc").write_text("this is not C++\n")
    assert cpu_build.build_all() == 3
    assert "building broken.cc failed" in caplog.text
    assert cpu_build.build(kernels / "a.cc") is not None
    assert not cpu_build.register("broken.cc", "Anything", "redjax_test_broken")


def test_off_x86_each_kernel_waits_to_be_asked_for(kernels, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    assert cpu_build.build_all() == 0
    assert not (tmp_path / "cache").exists()  # nothing built ahead
    assert cpu_build.build(kernels / "a.cc") is not None  # the one asked for still builds


def test_every_kernel_builds_for_a_cpu_without_avx512(tmp_path):
    """Each kernel compiles, with the engine's own flags, for an AVX2 CPU (x86-64-v3) as well as for
    this one: its AVX-512 paths sit behind the compiler's macros. (The kernels are x86-64 sources;
    the test machines have the compiler the other kernel tests need too.) (Until session 58 sampling.cc held
    a vector in a register by an asm constraint that only AVX-512 can meet, so on an AVX2 CPU it
    failed to build and the engine sampled by jnp.)"""
    flags = [f for f in cpu_build.FLAGS if not f.startswith("-march")] + ["-march=x86-64-v3"]
    sources = sorted(cpu_build.KERNELS.glob("*.cc"))

    def build(source):
        cmd = [cpu_build.compiler(), *flags, f"-I{jax.ffi.include_dir()}", f"-I{source.parent}", str(source),
               "-o", str(tmp_path / f"{source.stem}.so")]
        return source.name, cpu_build.subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        for name, result in pool.map(build, sources):
            assert result.returncode == 0, f"{name}:\n{result.stderr[-2000:]}"
    assert len(sources) >= 8
