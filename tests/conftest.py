"""The suite runs on JAX's CPU backend, also on a machine with a GPU, as the CLI does by default.

Set before any test module imports JAX. On a GPU, float32 matrix products default to TF32 and
every pytest-xdist worker would take most of the GPU's memory; the GPU tests
(``tests/test_gpu.py``) run their checks in fresh processes, with this variable removed.

Most of the suite's time is XLA:CPU compiling the programs it differentiates, and most of that is
code generation: XLA's MLIR fusion emitters (9-15 ms per kernel) and LLVM. The suite therefore
compiles with :data:`FAST_COMPILE_FLAGS`, LLVM at -O0, which compiled the encoder's forward-order
Jacobian in 1.77 s instead of 3.05 s (``jax.jacrev``'s in 0.71 s instead of 1.05 s). It changes how
XLA optimises machine code, not the program JAX is given. XLA's older loop emitters
(``--xla_cpu_use_fusion_emitters=false``) compile about as fast, but with them and the fuzz checks'
``jax_disable_most_optimizations`` (or -O0) the compiled ``markowitz`` Jacobian of fuzz seed 267 (a
``jnp.hypot`` of ``tanh`` values) was off by up to 0.93 with JAX's rule for ``max``, right op by op;
``rules.max_min`` is right there (``test_max_partials_hold_where_xla_computes_an_operand_twice``).
``JAXTOOL_TEST_XLA_DEFAULTS=1`` runs the suite under XLA's default compiler settings instead; ``make
bench`` and ``make fuzz`` always use them.
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: XLA flags the suite compiles with (added to any XLA_FLAGS already set), see the module docstring
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)


def _use_fast_compile_flags():
    """Add :data:`FAST_COMPILE_FLAGS` to ``XLA_FLAGS`` where this jaxlib knows them.

    XLA aborts the process on a flag it does not know, and a later jaxlib may drop these, so they are
    tried in a child process first. pytest-xdist's workers inherit the variable from the controller,
    which has probed already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAXTOOL_TEST_XLA_DEFAULTS") == "1" or all(f in flags.split() for f in FAST_COMPILE_FLAGS):
        return
    candidate = " ".join([flags, *FAST_COMPILE_FLAGS]).strip()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
                           env=dict(os.environ, XLA_FLAGS=candidate), capture_output=True, timeout=120)
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = candidate


_use_fast_compile_flags()
