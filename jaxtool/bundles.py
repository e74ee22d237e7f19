"""Products and sums of partials of one structure, computed together.

Eliminating a vertex ``v`` multiplies each of its out-edge partials ``b: v -> w`` by every in-edge
partial ``a_i: u_i -> v``. In forward order the ``u_i`` are the inputs: every vertex after the first
few carries a partial from each of them, and where several of those have one structure (the
Jacobians of a hidden layer with respect to each of the weight matrices of the layer before, once
a contraction has made them dense) each product ``b o a_i`` is the same computation on other
values. Traced one by one they are as many equations and, on XLA:CPU, as many kernels: the
encoder's forward-order Jacobian multiplied 726 pairs and compiled 185 kernels, where
``jax.jacfwd``, pushing all of its inputs' tangents through each equation at once, compiled 97.

Here such a bundle ``a_1 .. a_k`` is stacked along a new leading input axis into one Sparse partial
``u* -> v`` (``u*`` is ``k`` copies of the inputs' common shape), multiplied by ``b`` once, and the
product split back into ``k`` partials. The sums with the edges ``u_i -> w`` already there are
bundled the same way. Each result has the structure and the counted cost of the pair by pair
product or sum, and its value (the same products and sums; a contraction may take its other form,
written out or ``dot_general``, at the bundle's size, so the last bits can differ): a bundle is
only how the values are traced. The encoder's forward order then compiles to 98 kernels, and a
call at a point takes 115-120 us instead of 154-159 us. The results remember the stacked array
they were split from (while the elimination keeps results,
:func:`~jaxtool.partials.shared_applications`), so that the next vertex's bundle of the same
partials is that array itself, not a concatenation of its pieces: a chain of vertices stays one
array per bundle until the Jacobian's blocks are taken from it.

Only Sparse partials with values are bundled (not unit partials, which store nothing, nor
permuted diagonals, whose products with lazily applied maps keep them lazy, nor partials with
exact zeros, whose products select, nor those of fewer than :data:`MIN_STORED` values); anything
else is multiplied and added pair by pair.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from jax import lax

from jaxtool.partials import (_APPLICATIONS, Partial, Sparse, _kept, _product_plan, _sparse_add, _sparse_sparse,
                              _sum_plan, _take, reshaped)


#: partials that store fewer values than this are multiplied pair by pair: stacking and splitting
#: arrays of a few values costs XLA:CPU more kernels than it saves (roe_flux_3d, whose partials
#: store 1 to 15 values, compiled its fwd-order Jacobian to 64 kernels bundled, 46 not: 33.5 us a
#: call instead of 32.5 us)
MIN_STORED = 16
#: partials that store more values than this are bundled only where they are pieces of one array
#: already (:func:`_origins`): a concatenation of large arrays costs more than the kernels it
#: saves (attention's markowitz order bundles two partials of 16384 values once: 89 us a call
#: with their concatenation, 82 us without)
MAX_STORED = 1024


def bundle_key(a: Partial):
    """The key under which ``a`` is bundled with partials of the same key, or None if it is not."""
    if isinstance(a, Sparse) and a.val is not None and a.live is None and not a.is_permuted_diag \
            and a.stored >= MIN_STORED:
        return a.key
    return None


def bundles(parts: dict, b: Partial) -> list:
    """The vertices ``u`` of ``parts`` (the in-edge partials ``u -> v`` by ``u``) grouped into bundles
    to multiply by ``b`` together: lists of vertices, in order of first appearance, each of one
    :func:`bundle_key` (a list of one for a partial that is not bundled, for every one where ``b`` is
    not a Sparse partial free of exact zeros, and for large ones that would have to be
    concatenated, see :data:`MAX_STORED`)."""
    if not isinstance(b, Sparse) or b.live is not None or (b.val is None and not b.unit):
        return [[u] for u in parts]
    groups = collections.defaultdict(list)
    for u, a in parts.items():
        key = bundle_key(a)
        groups[("single", u) if key is None else key].append(u)
    result = []
    for members in groups.values():
        if len(members) == 1 or _stackable([parts[u] for u in members]):
            result.append(members)
        else:
            result.extend([u] for u in members)
    return result


def products(b: Sparse, parts: list) -> Optional[list]:
    """``[matmul(b, a) for a in parts]`` for partials of one :func:`bundle_key`, as one product:
    ``(partial, cost)`` pairs, or None where the stacked product's structure is not the pair by pair
    product's with the stacking axis (not expected: the fallback is pair by pair)."""
    plan = _product_plan(b.key, parts[0].key)
    product, _ = _sparse_sparse(b, _stacked(parts))
    pieces = _split(product, plan.result, len(parts))
    return None if pieces is None else [(p, plan.cost) for p in pieces]


def sums(olds: list, news: list) -> Optional[list]:
    """``[add(x, y) for x, y in zip(olds, news)]`` for ``olds`` of one :func:`bundle_key` and
    ``news`` of another, as one sum: ``(partial, cost)`` pairs, or None as for :func:`products`."""
    if not _stackable(olds):
        return None
    plan, cost = _sum_plan(olds[0].key, news[0].key)
    total, _ = _sparse_add(_stacked(olds), _stacked(news))
    pieces = _split(total, plan, len(olds))
    return None if pieces is None else [(p, cost) for p in pieces]


def _stackable(parts: list) -> bool:
    """Whether partials of one :func:`bundle_key` are worth stacking: small ones always, large ones
    where they are pieces of one array already (see :data:`MAX_STORED`)."""
    return parts[0].stored <= MAX_STORED or _origins([p.val for p in parts], len(parts[0].out_shape)) is not None


def _with_axis(x: Sparse, k: int, val=None) -> Sparse:
    """``x``'s structure with a new leading input axis of ``k`` (unpaired, stored in full), and ``val``."""
    nout = len(x.out_shape)
    return Sparse(tuple(x.out_shape), (k,) + tuple(x.in_shape), tuple(None if p is None else p + 1 for p in x.pairs),
                  tuple(x.val_shape[:nout]) + (k,) + tuple(x.val_shape[nout:]), x.dtype, val)


def _stacked(parts: list) -> Sparse:
    """Partials of one structure as one, stacked along a new leading input axis."""
    first = parts[0]
    axis = len(first.out_shape)
    return _with_axis(first, len(parts), _stack([p.val for p in parts], axis))


def _split(x: Sparse, like: Sparse, k: int) -> Optional[list]:
    """``x`` (``like``'s structure with a leading input axis of ``k``) split into ``k`` partials of
    ``like``'s structure, each remembering where it came from (:func:`_stack`); None where ``x`` is
    not of that structure."""
    if not isinstance(x, Sparse) or x.key != _with_axis(like, k).key or x.val is None:
        return None
    axis = len(x.out_shape)
    pieces = lax.split(x.val, (1,) * k, axis)
    vals = [reshaped(v, tuple(like.val_shape)) for v in pieces]
    for i, v in enumerate(vals):
        _kept(("bundled", id(v)), lambda i=i: (x.val, i, axis), v)
    return [Sparse(like.out_shape, like.in_shape, like.pairs, like.val_shape, like.dtype, v) for v in vals]


def _origins(vals: list, axis: int) -> Optional[tuple]:
    """``(parent, indices)`` where every one of ``vals`` is a piece :func:`_split` made from one array
    ``parent`` along ``axis`` (the ``indices``-th pieces), else None."""
    results = _APPLICATIONS.results or {}
    origins = [results.get(("bundled", id(v)), (None,))[0] for v in vals]
    if any(o is None or o[0] is not origins[0][0] or o[2] != axis for o in origins):
        return None
    return origins[0][0], np.asarray([o[1] for o in origins])


def _stack(vals: list, axis: int):
    """``vals`` stacked along a new ``axis``: taken from the array :func:`_split` made them from where
    they all come from one (the array itself where they are all of it, in order), else concatenated."""
    origins = _origins(vals, axis)
    if origins is not None:
        return _take(*origins, axis)
    return lax.concatenate([reshaped(v, v.shape[:axis] + (1,) + v.shape[axis:]) for v in vals], axis)

