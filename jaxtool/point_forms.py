"""One computation in two forms: written out for XLA:CPU at a point, a library call under ``jax.vmap``.

XLA:CPU makes every reduction and every ``dot`` a kernel of its own, which nothing fuses with; a
few slices added up, or a broadcast product summed so, fuse with the arithmetic around them. At a
point, where a Jacobian's call time is mostly its kernels, small sums and matrix-vector products
written out are the faster form: perceptron's reverse-order Jacobian took 19.9 us so, 22.6 us as
``reduce_sum`` and ``dot`` (the encoder's: 59.4 us, 63.9 us; each pinned to one CPU, interleaved
with ``jax.jacrev``: 22.8-23.1 us, 83.8-85.8 us). Over a batch the written-out forms lose: over
1024 points those two took 0.34 ms and 5.55 ms written out, 0.20 ms and 4.33 ms with the library
calls, and perceptron's markowitz order 1.17 ms against 0.26 ms (a batch of sums is a loop XLA:CPU
hands to a library; its written-out form is a product made in memory first).

:data:`two_forms_p` carries both forms of one computation: its operands, and ``forms``, a hashable
object with the methods ``at_a_point(*operands)`` and ``batched(*operands)`` and the attributes
``shape`` and ``dtype`` of the one result. It is lowered for XLA:CPU as ``at_a_point``; eagerly,
for other backends and under ``jax.vmap`` it is ``batched``, and it is differentiated as
``batched`` (whose derivative JAX knows; so is it by :mod:`jaxtool.rules`).
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir


def _as_batched(*operands, forms):
    return forms.batched(*operands)


def _as_at_a_point(*operands, forms):
    return forms.at_a_point(*operands)


def _jvp(primals, tangents, *, forms):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return two_forms_p.bind(*primals, forms=forms), jax.jvp(forms.batched, tuple(primals), tangents)[1]


def _batching_rule(operands, dims, *, forms):
    return jax.vmap(forms.batched, in_axes=tuple(dims))(*operands), 0


two_forms_p = jcore.Primitive("two_forms")
two_forms_p.def_impl(_as_batched)
two_forms_p.def_abstract_eval(lambda *avals, forms: jax.core.ShapedArray(forms.shape, forms.dtype))
mlir.register_lowering(two_forms_p, mlir.lower_fun(_as_batched, multiple_results=False))
mlir.register_lowering(two_forms_p, mlir.lower_fun(_as_at_a_point, multiple_results=False), platform="cpu")
ad.primitive_jvps[two_forms_p] = _jvp
batching.primitive_batchers[two_forms_p] = _batching_rule


def two_forms(forms, *operands):
    """The result of ``forms`` on ``operands`` (see the module docstring)."""
    return two_forms_p.bind(*operands, forms=forms)
