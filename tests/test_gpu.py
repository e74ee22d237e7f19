"""``--backend gpu`` and ``jaxtool.jacve`` on a GPU, where JAX sees one (skipped elsewhere), and the
usage error where it sees none.

Each check runs in a fresh Python process: a process keeps the platforms JAX initialised first, and
the other tests initialise it for the CPU (``--backend cpu`` sets ``JAX_PLATFORMS=cpu``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST_COMPILE_ENV, FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parent.parent

#: jacve in every order against jax.jacrev on the GPU, for a program of scalars and two of matrices
#: (the engine's contractions run at HIGHEST precision, so float32 tolerances hold where the GPU would
#: multiply float32 matrices in TF32). The encoder is the one whose ``fwd`` Jacobian once did not
#: compile within 75 s there (XLA:GPU over the written-out forms, which are now for XLA:CPU only).
API_SCRIPT = """
import sys
import jax, numpy as np
import jaxtool
sys.path.insert(0, "sample_programs")
from perceptron import perceptron, perceptron_example_args
from roe_flux_3d import roe_flux_3d, roe_flux_3d_example_args
from encoder import encoder, encoder_example_args

gpu = jax.devices("gpu")[0]
programs = ((roe_flux_3d, roe_flux_3d_example_args()), (perceptron, perceptron_example_args()),
            (encoder, encoder_example_args()))
for fn, args in programs:
    args = jax.device_put(args, gpu)
    argnums = tuple(range(len(args)))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.jacrev(fn, argnums))(*args)
    for order in ("fwd", "rev", "markowitz"):
        got = jax.jit(jaxtool.jacve(fn, order, argnums))(*args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert g.devices() == {gpu}, (order, g.devices())
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=order)
print("ok")
"""


def _run(*args):
    """``python *args`` from the repository root, with JAX free to pick its platforms and XLA's default
    compiler settings (without the suite's :data:`conftest.FAST_COMPILE_FLAGS` and ``FAST_COMPILE_ENV``)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and FAST_COMPILE_ENV.get(k) != v}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS)
    env["NO_COLOR"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def has_gpu() -> bool:
    probe = _run("-c", "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))")
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.split()[-1] == "True"


@pytest.fixture
def gpu(has_gpu):
    if not has_gpu:
        pytest.skip("JAX sees no GPU on this machine")


@pytest.mark.gpu
def test_jac_on_a_gpu_passes_its_check(gpu):
    result = _run("-m", "jaxtool", "--backend", "gpu", "jac", "sample_programs/roe_flux_3d.py:roe_flux_3d",
                  "--order", "markowitz", "--check", "--format", "json")
    assert result.returncode == 0, result.stderr
    check = json.loads(result.stdout)["check"]
    assert check["passed"] and check["jacrev"]["passed"] and check["jacfwd"]["passed"]


@pytest.mark.gpu
def test_jacve_on_a_gpu_matches_jacrev_there(gpu):
    result = _run("-c", API_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "ok"


def test_backend_gpu_without_a_gpu_exits_2(has_gpu):
    if has_gpu:
        pytest.skip("JAX sees a GPU on this machine")
    result = _run("-m", "jaxtool", "--backend", "gpu", "jac", "sample_programs/roe_flux_1d.py:roe_flux_1d")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --backend gpu: JAX sees no GPU on this machine (try --backend cpu)")
