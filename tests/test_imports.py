"""The Redis contract, the API and the dashboard never import JAX (a worker-only dependency)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", ["worker.contract", "worker.engine.sampling_params", "api", "api.app",
                                    "dashboard", "worker.cli"])
def test_module_does_not_import_jax(module):
    code = f"import sys, {module}; heavy = sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules); print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imported {out.stdout.strip()}"


def test_worker_package_init_is_empty():
    assert (REPO / "worker" / "__init__.py").read_text().strip() == ""


def test_importing_the_api_app_factory_does_not_load_torch_or_jax():
    code = "import sys; from api.app import create_app; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
