"""The NumPy forms of ``gather`` and of ``scatter``'s targets against XLA running the primitive.

The engine reads which operand element each output element of a ``gather`` copies (and where each
update of a ``scatter-add`` goes) from NumPy forms of XLA's semantics, so that a new index shape
costs no XLA compilation while tracing. Here both are compared, equation by equation, with what
XLA computes: the gather run on element numbers, the scatter's transpose (a gather) likewise.
The equations come from the indexing JAX users write (``x[idx]``, ``.at[...]``, ``take``,
``take_along_axis``, ``segment_sum``, vmapped indexing with batching dimensions) and from
``lax.gather``/``lax.scatter_add`` with windows partly out of bounds, in every mode, and from 150
random gathers and 150 random scatters (random ranks, index maps in any order, collapsed or
inserted axes, window sizes and positions, batching dimensions, indices out of bounds, modes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Literal

import jaxtool
from jaxtool import rules

X1 = np.linspace(-1.0, 1.0, 7).astype(np.float32)
X2 = np.linspace(-1.0, 1.0, 20).astype(np.float32).reshape(4, 5)
X3 = np.linspace(-1.0, 1.0, 60).astype(np.float32).reshape(3, 4, 5)
I1 = np.array([0, 6, 2, 2, -1])
I2 = np.array([[0, 3], [2, 1]])
MODES = list(lax.GatherScatterMode)
G = lax.GatherDimensionNumbers
S = lax.ScatterDimensionNumbers


def _window_gather(mode):
    # windows of 3 rows starting at rows -1, 0, 2, 3 of a 4x5 operand: partly out of bounds
    dnums = G(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    return lambda x: lax.gather(x, np.array([[-1], [0], [2], [3]]), dnums, (3, 5), mode=mode)


def _window_scatter(mode):
    dnums = S(update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,))
    return lambda x, u: lax.scatter_add(x, np.array([[-1], [0], [2], [3]]), u, dnums, mode=mode)


def _two_axis_window_gather(mode):
    dnums = G(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1))
    return lambda x: lax.gather(x, np.array([[0, 4], [3, 2], [1, 3], [5, 0]]), dnums, (1, 2), mode=mode)


GATHERS = {
    "x[idx]": (lambda x: x[I1], (X1,)),
    "x[2-d idx]": (lambda x: x[I2], (X1,)),
    "rows": (lambda x: x[np.array([3, 0, 3])], (X2,)),
    "columns": (lambda x: x[:, np.array([4, 0, 1])], (X2,)),
    "points": (lambda x: x[np.array([0, 3, 1]), np.array([4, 4, 0])], (X2,)),
    "axes 0 and 2": (lambda x: x[np.array([2, 0]), :, np.array([1, 4])], (X3,)),
    "clip": (lambda x: x.at[np.array([0, 9, -3])].get(mode="clip"), (X1,)),
    "fill": (lambda x: x.at[np.array([0, 9, -9, 6])].get(mode="fill", fill_value=2.0), (X1,)),
    "promise": (lambda x: x.at[np.array([1, 5])].get(mode="promise_in_bounds"), (X1,)),
    "take axis 1": (lambda x: jnp.take(x, np.array([4, 0, 2]), axis=1), (X3,)),
    "take_along_axis": (lambda x: jnp.take_along_axis(x, np.array([[1, 0, 4], [2, 2, 3], [0, 1, 1], [4, 3, 2]]),
                                                      axis=1), (X2,)),
    "vmapped (batching dims)": (lambda x: jax.vmap(lambda row, i: row[i])(x, np.array([[0, 4], [1, 1], [3, 2],
                                                                                      [4, 0]])), (X2,)),
    "vmapped over axis 1": (lambda x: jax.vmap(lambda col, i: col[i], in_axes=(1, 0))(x, np.array([3, 0, 1, 2, 2])),
                            (X2,)),
    **{f"window rows, {m.name}": (_window_gather(m), (X2,)) for m in MODES if m.name != "ONE_HOT"},
    **{f"two-axis windows, {m.name}": (_two_axis_window_gather(m), (X2,)) for m in MODES if m.name != "ONE_HOT"},
}

SCATTERS = {
    "add at idx": (lambda x, u: x.at[I1].add(u), (X1, X1[:5])),
    "add rows": (lambda x, u: x.at[np.array([3, 0, 3])].add(u), (X2, X2[:3])),
    "add columns": (lambda x, u: x.at[:, np.array([4, 0, 4])].add(u), (X2, X2[:, :3])),
    "add points": (lambda x, u: x.at[np.array([0, 3, 0]), np.array([4, 4, 4])].add(u), (X2, X1[:3])),
    "drop out of bounds": (lambda x, u: x.at[np.array([0, 9, -9, 6])].add(u, mode="drop"), (X1, X1[:4])),
    "clip": (lambda x, u: x.at[np.array([0, 9, -9, 6])].add(u, mode="clip"), (X1, X1[:4])),
    "promise": (lambda x, u: x.at[np.array([1, 5, 1])].add(u, mode="promise_in_bounds"), (X1, X1[:3])),
    "segment_sum": (lambda x, u: x + jax.ops.segment_sum(u, np.array([0, 1, 1, 2, 0, 6, 3]), 7), (X1, X1)),
    "vmapped (batching dims)": (lambda x, u: jax.vmap(lambda row, v: row.at[np.array([0, 4, 0])].add(v))(x, u),
                                (X2, X2[:, :3])),
    **{f"window rows, {m.name}": (_window_scatter(m), (X2, np.ones((4, 3, 5), np.float32)))
       for m in MODES if m.name != "ONE_HOT"},
}


def _applications(fun, args, primitive):
    """Each ``primitive`` equation that running ``fun`` on ``args`` meets (in nested jits too), with
    the values of its inputs."""
    found = []

    def run(jaxpr, consts, values):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, values))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
        for e in jaxpr.eqns:
            invals = [read(v) for v in e.invars]
            if e.primitive.name == "jit":
                outs = run(e.params["jaxpr"].jaxpr, e.params["jaxpr"].consts, invals)
            else:
                if e.primitive.name == primitive:
                    found.append((e, [np.asarray(x) for x in invals]))
                outs = e.primitive.bind(*invals, **e.params)
                outs = outs if e.primitive.multiple_results else [outs]
            env.update(zip(e.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    closed = jax.make_jaxpr(fun)(*args)
    run(closed.jaxpr, closed.consts, args)
    assert found, f"no {primitive} in the program"
    return found


@pytest.mark.parametrize("name", GATHERS)
def test_numpy_gather_copies_the_elements_xla_copies(name):
    fun, args = GATHERS[name]
    for eqn, invals in _applications(fun, args, "gather"):
        shape = invals[0].shape
        numbers = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        ours = rules._np_gather(numbers, invals[1], **eqn.params)
        by_xla = rules._selection_index_by_evaluation(eqn, invals, 0, 0)
        np.testing.assert_array_equal(ours, by_xla)


@pytest.mark.parametrize("name", SCATTERS)
def test_scatter_targets_are_where_xla_adds_the_updates(name):
    fun, args = SCATTERS[name]
    for eqn, (operand, indices, updates) in _applications(fun, args, "scatter-add"):
        ours = rules._scatter_targets(operand.shape, indices, updates.shape, eqn.params["dimension_numbers"],
                                      eqn.params["mode"])
        # XLA: each update element's number (1, 2, ...) added into zeros; every output element
        # that receives exactly one update names it
        numbers = np.arange(1, updates.size + 1, dtype=np.float32).reshape(updates.shape)
        added = np.asarray(eqn.primitive.bind(np.zeros(operand.shape, np.float32), indices, numbers, **eqn.params))
        counts = np.asarray(eqn.primitive.bind(np.zeros(operand.shape, np.float32), indices,
                                               np.ones(updates.shape, np.float32), **eqn.params))
        expected_counts = np.bincount(ours[ours >= 0].ravel(), minlength=operand.size).reshape(operand.shape)
        np.testing.assert_array_equal(counts, expected_counts)
        single = counts == 1
        owner = np.full(operand.size, -1)
        owner[ours[ours >= 0]] = np.flatnonzero(ours >= 0)
        np.testing.assert_array_equal(added[single], owner.reshape(operand.shape)[single] + 1)
        # and where several updates meet, their numbers add up
        sums = np.zeros(operand.size)
        np.add.at(sums, ours[ours >= 0], np.flatnonzero(ours.ravel() >= 0) + 1)
        np.testing.assert_allclose(added.ravel(), sums)


def test_a_mode_the_numpy_forms_do_not_model_is_left_to_xla():
    dnums = G(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
    assert rules._np_gather(np.arange(5), np.array([[1]]), dimension_numbers=dnums, slice_sizes=(1,),
                            mode=lax.GatherScatterMode.ONE_HOT) is NotImplemented
    sdnums = S(update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
    assert rules._scatter_targets((5,), np.array([[1]]), (1,), sdnums, lax.GatherScatterMode.ONE_HOT) is None


@pytest.fixture
def compilations():
    """The names of the XLA compilations that run while the test runs (via ``jax.monitoring``)."""
    seen = []

    def listener(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("order, n", [("fwd", 7), ("rev", 8)])
def test_differentiating_indexing_compiles_the_jacobian_only(order, n, compilations):
    # shapes no other test (or order) uses, so no XLA executable run before could hide a compilation
    indices = np.array([0, 10, 10, 3, 0, 12, 12, 5])[:n]
    rows = np.array([[0, 2], [1, 1], [10, 0]])

    def f(x, table):
        return jax.ops.segment_sum(x * x, indices, 13), table[rows] * x[:3], x.at[np.array([1, 20])].get(mode="fill")

    x, table = np.linspace(0.5, 1.5, n, dtype=np.float32), np.linspace(-1, 1, 33, dtype=np.float32).reshape(11, 3)
    jacobian = jax.jit(jaxtool.jacve(f, order=order, argnums=(0, 1)))(x, table)
    assert len(compilations) == 1
    reference = jax.jacrev(f, argnums=(0, 1))(x, table)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), jacobian, reference)


def _random_indexing(rng):
    """The parts a random ``gather`` and ``scatter`` share: an operand shape, its batching axis (or
    none) and the axes the index vectors address (in random order), the other axes, the batch
    shape of the indices with the batching axis inserted, where, and the indices themselves (some
    out of bounds)."""
    rank = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(1, 5, rank))
    axes = [int(a) for a in rng.permutation(rank)]
    batching = [axes.pop()] if rank > 1 and rng.random() < 0.3 else []
    index_map = axes[:int(rng.integers(1, len(axes) + 1))]
    batch = [int(n) for n in rng.integers(1, 4, int(rng.integers(0, 3)))]
    indices_batching = []
    if batching:
        position = int(rng.integers(0, len(batch) + 1))
        batch.insert(position, shape[batching[0]])
        indices_batching = [position]
    indices = rng.integers(-2, max(shape) + 2, tuple(batch) + (len(index_map),))
    return shape, tuple(batching), tuple(index_map), axes, batch, tuple(indices_batching), indices


def _random_gather(rng):
    """A random valid ``gather``: operand, indices and parameters."""
    shape, batching, index_map, axes, batch, indices_batching, indices = _random_indexing(rng)
    collapsed = tuple(sorted(a for a in axes if rng.random() < 0.5))
    sizes = [1 if a in batching or a in collapsed else int(rng.integers(1, shape[a] + 1)) for a in range(len(shape))]
    n_offsets = len(shape) - len(collapsed) - len(batching)
    offsets = tuple(sorted(int(n) for n in rng.choice(len(batch) + n_offsets, n_offsets, replace=False)))
    dnums = G(offset_dims=offsets, collapsed_slice_dims=collapsed, start_index_map=index_map,
              operand_batching_dims=batching, start_indices_batching_dims=indices_batching)
    mode = MODES[int(rng.integers(0, 3))]
    operand = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return operand, indices, dict(dimension_numbers=dnums, slice_sizes=tuple(sizes), mode=mode)


def _random_scatter(rng):
    """A random valid ``scatter-add``: operand shape, indices, updates shape, dimension numbers
    and mode."""
    shape, batching, index_map, axes, batch, indices_batching, indices = _random_indexing(rng)
    inserted = tuple(sorted(a for a in axes if rng.random() < 0.5))
    window_axes = [a for a in range(len(shape)) if a not in inserted and a not in batching]
    windows = tuple(sorted(int(n) for n in rng.choice(len(batch) + len(window_axes), len(window_axes), replace=False)))
    upd_shape = [0] * (len(batch) + len(window_axes))
    for position, axis in zip(windows, window_axes):
        upd_shape[position] = int(rng.integers(1, shape[axis] + 1))
    rest = iter(batch)
    upd_shape = tuple(n if n else next(rest) for n in upd_shape)
    dnums = S(update_window_dims=windows, inserted_window_dims=inserted, scatter_dims_to_operand_dims=index_map,
              operand_batching_dims=batching, scatter_indices_batching_dims=indices_batching)
    return shape, indices, upd_shape, dnums, MODES[int(rng.integers(0, 3))]


def test_random_gathers_agree_with_xla():
    rng = np.random.default_rng(0)
    for _ in range(150):
        operand, indices, params = _random_gather(rng)
        (eqn, invals), = _applications(lambda x: lax.gather(x, indices, **params), (operand,), "gather")
        numbers = np.arange(operand.size, dtype=np.int64).reshape(operand.shape)
        np.testing.assert_array_equal(rules._np_gather(numbers, invals[1], **eqn.params),
                                      rules._selection_index_by_evaluation(eqn, invals, 0, 0), err_msg=str(params))


def test_random_scatters_agree_with_xla():
    rng = np.random.default_rng(1)
    for _ in range(150):
        shape, indices, upd_shape, dnums, mode = _random_scatter(rng)
        numbers = np.arange(1, int(np.prod(upd_shape)) + 1, dtype=np.float32).reshape(upd_shape)
        added = np.asarray(lax.scatter_add(np.zeros(shape, np.float32), indices, numbers, dnums, mode=mode))
        ours = rules._scatter_targets(shape, indices, upd_shape, dnums, mode)
        expected = np.zeros(int(np.prod(shape)))
        np.add.at(expected, ours[ours >= 0], numbers.ravel()[(ours >= 0).ravel()])
        np.testing.assert_array_equal(added.ravel(), expected, err_msg=f"{shape} {dnums} {mode}")
