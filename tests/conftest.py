"""The suite runs on JAX's CPU backend, also on a machine with a GPU, as the CLI does by default.

Set before any test module imports JAX. On a GPU, float32 matrix products default to TF32 and
every pytest-xdist worker would take most of the GPU's memory; the GPU tests
(``tests/test_gpu.py``) run their checks in fresh processes, with this variable removed.

Most of the suite's time is XLA:CPU compiling the programs it differentiates, most of them single
operations run eagerly (about 36 ms each with XLA's defaults), and most of that is code generation:
XLA's MLIR fusion emitters and LLVM. The suite therefore compiles with XLA's older loop emitters
(:data:`FAST_COMPILE_FLAGS`) and LLVM at -O0 (JAX's ``jax_disable_most_optimizations``, set by
:data:`FAST_COMPILE_ENV`): on a 2-CPU machine ``make test`` took 10 min instead of 14.5 min. They
change how XLA emits machine code, not the program JAX is given, nor its HLO optimisations.
The two together compute ``jnp.hypot`` (a ``max`` and a ``min`` of its operands' magnitudes)
differently in different kernels of one program: the compiled ``jax.jacrev`` of four fuzz programs
with one (seeds 15, 126, 152 and 219) then differed from their compiled Jacobians, though the two
agree when both run eagerly, and with either setting alone. So the fuzz checks compile at LLVM's
default level here (:func:`program_generator.quick_compilation`). ``JAXTOOL_TEST_XLA_DEFAULTS=1``
runs the suite under XLA's default compiler settings instead; ``make bench`` and ``make fuzz``
always use them.
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: XLA flags the suite compiles with (added to any XLA_FLAGS already set), see the module docstring
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
#: JAX settings (as environment variables, which pytest-xdist's workers and the CLI's processes inherit)
#: the suite compiles with, unless set already, see the module docstring
FAST_COMPILE_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def _use_fast_compile_settings():
    """Set :data:`FAST_COMPILE_ENV`, and add :data:`FAST_COMPILE_FLAGS` to ``XLA_FLAGS`` where this
    jaxlib knows them.

    XLA aborts the process on a flag it does not know, and a later jaxlib may drop these, so they are
    tried in a child process first. pytest-xdist's workers inherit the variables from the controller,
    which has probed already."""
    if os.environ.get("JAXTOOL_TEST_XLA_DEFAULTS") == "1":
        return
    for key, value in FAST_COMPILE_ENV.items():
        os.environ.setdefault(key, value)
    flags = os.environ.get("XLA_FLAGS", "")
    if all(f in flags.split() for f in FAST_COMPILE_FLAGS):
        return
    candidate = " ".join([flags, *FAST_COMPILE_FLAGS]).strip()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
                           env=dict(os.environ, XLA_FLAGS=candidate), capture_output=True, timeout=120)
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = candidate


_use_fast_compile_settings()
