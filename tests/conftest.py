"""The suite runs on JAX's CPU backend, also on a machine with a GPU, as the CLI does by default.

Set before any test module imports JAX. On a GPU, float32 matrix products default to TF32 and
every pytest-xdist worker would take most of the GPU's memory; the GPU tests
(``tests/test_gpu.py``) run their checks in fresh processes, with this variable removed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
