"""Property-based tests: ``jaxtool.jacve`` agrees with ``jax.jacrev`` on random programs.

Each seed in ``range(CI_SEEDS)`` is one random program from :mod:`program_generator` (at most
``CI_MAX_OPS`` operations, to keep the XLA compilations CI pays for small), differentiated by
``jax.jacrev`` and by ``jaxtool.jacve`` in the ``fwd``, ``rev`` and ``markowitz`` orders and one
random valid order; structure, shapes, dtypes and values must agree. The seeds are checked in
worker processes, one per core (see :func:`outcomes`). ``make fuzz`` (``scripts/fuzz.py``) runs
the same check on many more, larger programs.

Seeds that expose known engine bugs are listed in :data:`KNOWN_BUGS` and expected to fail
(``strict=True``: once the bug is fixed, the test says so and the entry must go).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import program_generator as pg

CI_SEEDS = 300
CI_MAX_OPS = 10
CI_RANDOM_ORDERS = 1
MAX_WORKERS = 4

#: seed -> reason (a minimal reproducer of the engine bug the seed's program hits)
KNOWN_BUGS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def quick_compilation():
    """Compile without XLA's optimisation passes here too (see :func:`program_generator.quick_compilation`)."""
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    pg.quick_compilation()
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="session")
def outcomes(request) -> dict:
    """``seed -> (status, report)`` for every selected seed, checked in parallel worker processes.

    Each case costs an XLA compilation, which runs on one core: one worker per core (at most
    ``MAX_WORKERS``) divides the wall time. A seed the workers could not check (no pool: one CPU,
    one seed selected, or tests run by pytest-xdist's processes; or a worker died) is checked in
    this process by the test itself.
    """
    import os
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from itertools import repeat
    from multiprocessing import get_context

    done: dict = {}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: the test processes divide the seeds already
        return done
    seeds = sorted({item.callspec.params["seed"] for item in request.session.items
                    if getattr(item, "originalname", "") == "test_jacve_matches_jacrev"})
    workers = min(MAX_WORKERS, os.cpu_count() or 1, len(seeds))
    if workers < 2:
        return done
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=pg.quick_compilation) as pool:
            results = pool.map(pg.check_seed_outcome, seeds, repeat(CI_RANDOM_ORDERS), repeat(CI_MAX_OPS),
                               chunksize=4)
            for seed, outcome in zip(seeds, results):
                done[seed] = outcome
    except BrokenProcessPool:
        pass  # the remaining seeds are checked in this process
    return done


def _seed_param(seed: int):
    if seed in KNOWN_BUGS:
        return pytest.param(seed, marks=pytest.mark.xfail(reason=KNOWN_BUGS[seed], strict=True))
    return seed


@pytest.mark.parametrize("seed", [_seed_param(s) for s in range(CI_SEEDS)])
def test_jacve_matches_jacrev(seed, outcomes):
    _expect_passed(*(outcomes.get(seed) or pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS)))


def _expect_passed(status, report, strict=False):
    """Passed (or skipped: no valid program). A difference of values that a second opinion clears
    (``rounding``, see ``program_generator.check_case``) is an expected failure, unless ``strict``:
    where what is tested is a lowering, which the eager second opinion does not run."""
    if status == "skipped":
        pytest.skip(report)
    if status == "rounding" and not strict:  # listed by `pytest -rx`
        pytest.xfail(report)
    assert status == "passed", report


#: more seeds, checked with every small product and sum left to ``dot_general`` and ``reduce_sum``, as
#: jaxtool writes them off XLA:CPU (``partials.fuses_small_products``), which no CI machine runs; about
#: half of these programs contract or reduce
OFF_CPU_SEEDS = range(CI_SEEDS, CI_SEEDS + 40)


@pytest.mark.parametrize("seed", OFF_CPU_SEEDS)
def test_jacve_matches_jacrev_with_the_products_of_other_backends(seed, monkeypatch):
    from jaxtool import partials

    monkeypatch.setattr(partials, "fuses_small_products", lambda: False)
    _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS))


def _seeds(start: int, count: int, keep) -> list:
    """The first ``count`` seeds from ``start`` on whose programs ``keep`` keeps (generating a program
    traces nothing: about 4 ms a seed)."""
    seeds, seed = [], start
    while len(seeds) < count:
        if keep(pg.generate(seed, max_ops=CI_MAX_OPS)):
            seeds.append(seed)
        seed += 1
    return seeds


#: more seeds, of programs of scalars, checked with the scalars each staged Jacobian shares computed
#: once (``jaxtool.sharing``) however few operations XLA:CPU would copy (jaxtool does it where they
#: would count 1000 flops or more); about half of these programs share some
SHARING_SEEDS = _seeds(CI_SEEDS + 40, 40, lambda case: all(np.ndim(x) == 0 for x in case.inputs))

#: more seeds, of programs that take sines, cosines or tangents, checked with those that several
#: equations read computed once (``jaxtool.sharing.once_p``) however small (jaxtool does it from
#: ``ONCE_SIZE`` elements on: under vmap)
ONCE_SEEDS = _seeds(SHARING_SEEDS[-1] + 1, 24, lambda case: re.search(r"jnp\.(sin|cos|tan)\(", "\n".join(case.ops)))


@pytest.mark.parametrize("seed", SHARING_SEEDS)
def test_jacve_matches_jacrev_with_shared_scalars_computed_once(seed, monkeypatch):
    from jaxtool import sharing

    monkeypatch.setattr(sharing, "crosses_the_line", lambda jaxpr, shared: True)
    _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS), strict=True)


@pytest.mark.parametrize("seed", ONCE_SEEDS)
def test_jacve_matches_jacrev_with_sines_computed_once(seed, monkeypatch):
    from jaxtool import sharing

    monkeypatch.setattr(sharing, "ONCE_SIZE", 0)
    _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS), strict=True)


#: more seeds, their programs evaluated on float64 inputs and compared at 1e-10, and on float16 and
#: bfloat16 ones (``scripts/fuzz.py --dtype``): engine code that assumes 32-bit types fails there
#: (indices a sort selects by were int64 in float64 once; float16 times bfloat16 had no NumPy type)
X64_SEEDS = range(ONCE_SEEDS[-1] + 1, ONCE_SEEDS[-1] + 31)
HALF_SEEDS = range(X64_SEEDS[-1] + 1, X64_SEEDS[-1] + 11)


@pytest.mark.parametrize("seed", X64_SEEDS)
def test_jacve_matches_jacrev_in_float64(seed):
    _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS, dtype="float64"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("seed", HALF_SEEDS)
def test_jacve_matches_jacrev_in_half_precision(seed, dtype):
    _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS, dtype=dtype))


#: more seeds, checked under ``jax.numpy_dtype_promotion("strict")`` (``scripts/fuzz.py --promotion
#: strict``), which applies to the program and not to the engine's own arithmetic
STRICT_SEEDS = range(HALF_SEEDS[-1] + 1, HALF_SEEDS[-1] + 31)


@pytest.mark.parametrize("seed", STRICT_SEEDS)
def test_jacve_matches_jacrev_under_strict_dtype_promotion(seed):
    import jax

    with jax.numpy_dtype_promotion("strict"):
        _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS))


#: more seeds, checked under ``jax.numpy_rank_promotion("raise")`` (``scripts/fuzz.py --rank-promotion
#: raise``), which applies to the program and not to the engine's own arithmetic
RANK_SEEDS = range(STRICT_SEEDS[-1] + 1, STRICT_SEEDS[-1] + 31)


@pytest.mark.parametrize("seed", RANK_SEEDS)
def test_jacve_matches_jacrev_under_rank_promotion_raise(seed):
    import jax

    with jax.numpy_rank_promotion("raise"):
        _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS))


#: more seeds, checked under ``jax.checking_leaks()`` (``scripts/fuzz.py --check-leaks``): no value of
#: a trace the engine opens may outlive it
LEAK_SEEDS = range(RANK_SEEDS[-1] + 1, RANK_SEEDS[-1] + 21)


@pytest.mark.parametrize("seed", LEAK_SEEDS)
def test_jacve_matches_jacrev_under_tracer_leak_checks(seed):
    import jax

    with jax.checking_leaks():
        _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS))


#: more seeds, checked with the engine's size thresholds shrunk (``program_generator.SMALL_THRESHOLDS``,
#: ``scripts/fuzz.py --small-thresholds``): the paths for large partials, on small programs; and
#: under ``jax.checking_leaks()`` too, as the traces those paths open are not opened otherwise
SMALL_THRESHOLD_SEEDS = range(LEAK_SEEDS[-1] + 1, LEAK_SEEDS[-1] + 21)


@pytest.mark.parametrize("seed", SMALL_THRESHOLD_SEEDS)
def test_jacve_matches_jacrev_with_small_thresholds(seed):
    import jax

    with pg.small_thresholds(), jax.checking_leaks():
        _expect_passed(*pg.check_seed_outcome(seed, CI_RANDOM_ORDERS, CI_MAX_OPS))


@pytest.mark.parametrize("seed", [2012, 2051, 2161])
def test_replayed_maps_keep_nothing_of_their_trace(seed):
    """Programs of ``scripts/fuzz.py --small-thresholds --check-leaks`` (25 operations, 2 random orders)
    in which a map replayed deep in a chain derived (transposed) its callees' maps in the replay's
    trace and kept them on the callees: now kept in that trace's table of applications."""
    import jax

    with pg.small_thresholds(), jax.checking_leaks():
        _expect_passed(*pg.check_seed_outcome(seed, 2, 25))


# ------------------------------------------------------------------------------------------------
# the checker itself must be able to fail


@pytest.fixture(scope="module")
def reference():
    """A ``jax.jacrev`` Jacobian with a nested structure and nonzero blocks of several shapes."""
    import jax
    import jax.numpy as jnp

    def fun(x, y):
        return jnp.sin(x) * y, {"total": jnp.sum(x * x) + y}

    return jax.jacrev(fun, argnums=(0, 1))(jnp.array([0.3, -1.2, 0.8]), jnp.float32(1.7))


def test_compare_accepts_the_reference_itself(reference):
    assert pg.compare(reference, reference) == []


def test_compare_detects_a_perturbed_entry(reference):
    import jax

    leaves, tree = jax.tree_util.tree_flatten(reference)
    k = max(range(len(leaves)), key=lambda i: leaves[i].size)
    wrong = np.array(leaves[k])
    scale = max(1.0, float(np.abs(wrong).max()))
    wrong.flat[wrong.size // 2] += 1e-3 * scale  # far above atol = 1e-5 * scale
    problems = pg.compare(jax.tree_util.tree_unflatten(tree, leaves[:k] + [wrong] + leaves[k + 1:]), reference)
    assert len(problems) == 1 and "1/" in problems[0] and "entries differ" in problems[0]


def test_compare_tolerates_rounding_but_not_more(reference):
    import jax

    def scaled(factor):
        return jax.tree_util.tree_map(lambda x: np.asarray(x) * np.float32(factor), reference)

    assert pg.compare(scaled(1 + 1e-6), reference) == []
    assert len(pg.compare(scaled(1 + 1e-3), reference)) == len(jax.tree_util.tree_leaves(reference))
    assert len(pg.compare(scaled(1 + 1e-6), reference, rtol=1e-10, atol=1e-10)) == \
        len(jax.tree_util.tree_leaves(reference))


def test_compare_detects_nan_structure_shape_and_dtype(reference):
    import jax

    leaves, tree = jax.tree_util.tree_flatten(reference)
    nan = np.array(leaves[0])
    nan.flat[0] = np.nan
    assert pg.compare(jax.tree_util.tree_unflatten(tree, [nan] + leaves[1:]), reference)
    assert "structure" in pg.compare((reference,), reference)[0]
    as_f64 = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), reference)
    assert "float64" in pg.compare(as_f64, reference)[0]
    reshaped = jax.tree_util.tree_map(lambda x: np.asarray(x).reshape(-1, 1), reference)
    assert "!=" in pg.compare(reshaped, reference)[0]


# ------------------------------------------------------------------------------------------------
# second opinions: a difference of values is a rounding artefact only if one clears it


@pytest.fixture
def small_case():
    return pg.generate(5, max_ops=4)


def _differing_values(got, ref, **tolerance):
    return ["leaf (root): 1/4 " + pg.VALUES_DIFFER + "; worst at [0]: 1 vs reference 0 (block scale 1)"]


def test_differences_of_values_cleared_by_a_second_opinion_are_rounding(monkeypatch, small_case):
    monkeypatch.setattr(pg, "compare", _differing_values)  # the checker's own comparison, not JAX
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: False)
    monkeypatch.setattr(pg, "_eager_failures", lambda case, n: {})
    result = pg.check_case(small_case, 1)
    assert result.ok and set(result.rounding) == {pg.label(o) for o in pg.orders_for(small_case, 1)}
    assert result.reason == "jacve and jax.jacrev agree when both run eagerly"
    monkeypatch.setattr(pg, "_optimized_failures", lambda case, orders, jacobians: {})
    assert pg.check_case(small_case, 1).reason.startswith("XLA without its optimisations alone differs")
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: True)
    assert "primal output" in pg.check_case(small_case, 1).reason
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: False)
    monkeypatch.setattr(pg, "_eager_failures", lambda case, n: {"fwd": ["still differs"]})
    monkeypatch.setattr(pg, "_float32_reference_is_noise", lambda case: True)
    monkeypatch.setattr(pg, "_float64_failures", lambda case, n: {})
    assert "agree in float64" in pg.check_case(small_case, 1).reason


def test_a_float64_case_that_computes_in_float32_is_cleared_only_at_float32_tolerance(monkeypatch):
    import jax

    monkeypatch.setattr(pg, "compare", _differing_values)
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: False)
    monkeypatch.setattr(pg, "_eager_failures", lambda case, n: {"fwd": ["still differs"]})
    with jax.enable_x64(True):
        case = pg.generated(5, 0, 4, dtype="float64")
        monkeypatch.setattr(pg, "_computes_in_float32", lambda case: True)
        monkeypatch.setattr(pg, "_float32_tolerance_failures", lambda case, orders, jacobians: {})
        assert "computes some values in float32" in pg.check_case(case, 1).reason
        monkeypatch.setattr(pg, "_float32_tolerance_failures", lambda case, orders, jacobians: {"fwd": ["differs"]})
        assert not pg.check_case(case, 1).ok
        monkeypatch.setattr(pg, "_computes_in_float32", lambda case: False)
        monkeypatch.setattr(pg, "_float32_tolerance_failures", lambda case, orders, jacobians: {})
        assert not pg.check_case(case, 1).ok


def test_float32_values_are_found_in_nested_jaxprs_of_a_float64_case():
    import dataclasses

    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):
        wide = dataclasses.replace(pg.generated(5, 0, 4, dtype="float64"), fun=lambda v: jnp.sin(v) * 2, argnums=0,
                                   has_aux=False, inputs=(np.linspace(0.1, 0.9, 4),))
        narrow = dataclasses.replace(wide, fun=lambda v: jax.jit(lambda u: (u > 0.5).astype(jnp.float32) * u)(v))
        assert not pg._computes_in_float32(wide)
        assert pg._computes_in_float32(narrow)


def test_a_jitted_reference_that_alone_differs_is_named(small_case):
    import dataclasses

    import jax.numpy as jnp

    # on jax 0.10.2, jax.jit(jax.jacrev) of this gives all ones; eager jacrev, jit(jacfwd) and jacve 1,1,1,0,0
    case = dataclasses.replace(small_case, fun=lambda v: jnp.cumsum(v)[2], argnums=0, has_aux=False,
                               inputs=(np.linspace(0.1, 0.9, 5).astype(np.float32),))
    orders = pg.orders_for(case, 1)
    assert pg._only_the_jitted_reference_differs(case, orders, pg._jacobians(case, orders))
    result = pg.check_case(case, 1)
    if not result.rounding:  # a JAX without the bug: nothing to clear, and nothing fails
        assert result.ok
    else:
        assert result.ok and result.reason.startswith("jax.jit(jax.jacrev) alone differs")


def test_a_program_without_forward_mode_gets_no_jacfwd_opinion(small_case):
    import dataclasses

    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def sine(x):
        return jnp.sin(x)

    sine.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos_x, g: (cos_x * g,))
    # jax.jacfwd raises on a custom_vjp function; the checker crashed there (fuzz seed 134282)
    case = dataclasses.replace(small_case, fun=lambda v: sine(v) * 2, argnums=0, has_aux=False,
                               inputs=(np.linspace(0.1, 0.9, 3).astype(np.float32),))
    orders = pg.orders_for(case, 1)
    assert not pg._only_the_jitted_reference_differs(case, orders, pg._jacobians(case, orders))


def test_differences_no_second_opinion_clears_are_failures(monkeypatch, small_case):
    monkeypatch.setattr(pg, "compare", _differing_values)
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: False)
    monkeypatch.setattr(pg, "_eager_failures", lambda case, n: {"fwd": ["still differs"]})
    result = pg.check_case(small_case, 1)
    assert not result.ok and not result.rounding
    # float64 agreement clears nothing unless the float32 reference is itself noise, and vice versa
    monkeypatch.setattr(pg, "_float32_reference_is_noise", lambda case: False)
    monkeypatch.setattr(pg, "_float64_failures", lambda case, n: {})
    assert not pg.check_case(small_case, 1).ok
    monkeypatch.setattr(pg, "_float32_reference_is_noise", lambda case: True)
    monkeypatch.setattr(pg, "_float64_failures", lambda case, n: {"fwd": ["still differs"]})
    assert not pg.check_case(small_case, 1).ok
    # a crash or a wrong shape is never a rounding artefact, whatever the second opinions say
    monkeypatch.setattr(pg, "_eager_failures", lambda case, n: {})
    monkeypatch.setattr(pg, "_reference_branch_differs", lambda case: True)
    monkeypatch.setattr(pg, "compare",
                        lambda got, ref, **tolerance: ["leaf (root): float32[2] != reference float32[3]"])
    assert not pg.check_case(small_case, 1).ok


def test_second_opinions_on_a_correct_and_a_wrong_engine(monkeypatch, small_case):
    import jax

    import jaxtool

    assert not pg._reference_branch_differs(small_case)
    assert pg._eager_failures(small_case, 1) == {}
    assert pg._float64_failures(small_case, 1) == {}
    orders = pg.orders_for(small_case, 1)
    quick = jax.config.read("jax_disable_most_optimizations")
    assert pg._optimized_failures(small_case, orders, pg._jacobians(small_case, orders)) == {}
    assert jax.config.read("jax_disable_most_optimizations") == quick  # (restored)
    real = jaxtool.jacve

    def doubled(*args, **kwargs):  # jaxtool's own engine made wrong on purpose
        jacobian = real(*args, **kwargs)
        return lambda *a: jax.tree_util.tree_map(lambda x: 2 * x + 1, jacobian(*a))

    monkeypatch.setattr(jaxtool, "jacve", doubled)
    assert set(pg._eager_failures(small_case, 1)) == {pg.label(o) for o in pg.orders_for(small_case, 1)}
    assert set(pg._optimized_failures(small_case, orders, pg._jacobians(small_case, orders))) == \
        {pg.label(o) for o in orders}
    assert len(pg._float64_failures(small_case, 1)) == 3 + 1  # fwd, rev, markowitz, one random order


def test_float32_reference_that_cancels_is_noise(small_case):
    """sin(100 (x + 1000) - 1e5): x + 1000 rounds by up to 3e-5 in float32, so the argument of sin is
    off by up to 3e-3 and the derivative 100 cos(...) by up to 0.3, far beyond the checker's tolerance
    (1e-5 of the block's scale, 100); in float64 the same rounding is 1e-9 times smaller."""
    import jax.numpy as jnp

    cancelling = pg.Case(0, 0, (np.float32([0.123, 0.456]),), 0, False, [], "",
                         fun=lambda x: jnp.sin(100 * (x + 1000) - 1e5))
    assert pg._float32_reference_is_noise(cancelling)
    assert not pg._float32_reference_is_noise(small_case)


# ------------------------------------------------------------------------------------------------
# the generator


def test_generator_is_deterministic():
    a, b = pg.generate(7), pg.generate(7)
    assert a.source == b.source and a.argnums == b.argnums
    assert all(np.array_equal(x, y) and x.dtype == np.float32 for x, y in zip(a.inputs, b.inputs))
    assert pg.generate(8).source != a.source


def test_generator_tracks_shapes_and_dtypes():
    """The shapes the generator assumes (and prints in descriptions) are the ones JAX computes."""
    import jax

    for seed in range(20):
        case = pg.generate(seed, max_ops=CI_MAX_OPS)
        names = list(case.types)
        head = case.source.rpartition("    return ")[0]
        every_value = pg.compile_program(head + "    return [" + ", ".join(names) + "]\n")
        for name, value in zip(names, jax.eval_shape(every_value, *case.inputs)):
            assert case.type_of(name) == f"{'f32' if value.dtype == np.float32 else 'i32'}[" + ",".join(
                map(str, value.shape)) + "]", (seed, name, case.description())


def test_ci_seeds_cover_the_operations_of_the_brief():
    """The CI seeds exercise every family of operation (first attempts; regenerated ones add more)."""
    tags, sources = set(), []
    for seed in range(CI_SEEDS):
        case = pg.generate(seed, max_ops=CI_MAX_OPS)
        tags.update(case.tags)
        sources.append(case.source)
    families = {t.split(":")[0] for t in tags}
    assert {"unary", "binary", "const", "reduce", "slice", "gather", "scatter", "structure", "concat", "stack",
            "reshape", "contract", "cum", "sort", "int", "control", "linalg", "complex"} <= families
    needed = ["control:scan", "control:cond", "unary:jax.nn.relu(x)", "unary:jax.nn.softplus(x)",
              "reduce:softmax", "unary:cube(x)", "unary:sin_vjp(x)", "unary:lax.stop_gradient(x)", "scatter:add",
              "scatter:set", "int:argsort", "int:compare_cast", "unary:x * x", "contract:jnp.outer(x, x)",
              "contract:x @ x.T", "unary:jax.jit(lambda x: jnp.tanh(x) * x + 1.0)(x)", "complex:jnp.abs",
              "complex:lax.scan"]
    assert not [t for t in needed if t not in tags]
    text = "\n".join(sources)
    assert "np.array(" in text and "return {" in text and "return [" in text and "return (" in text
    cases = [pg.generate(seed, max_ops=CI_MAX_OPS) for seed in range(CI_SEEDS)]
    assert any(c.has_aux for c in cases) and any(isinstance(c.argnums, int) for c in cases)
    assert any(isinstance(c.argnums, tuple) and len(c.argnums) < len(c.inputs) for c in cases)
    outputs = [c.ops[-1].split("'aux'")[0] for c in cases]
    assert any(re.search(rf"\bv{i}\b", out) for c, out in zip(cases, outputs) for i in range(len(c.inputs)))


def test_reproducer_runs_and_compares(capsys):
    case = pg.generate(3, max_ops=6)
    exec(compile(case.reproducer(), "<reproducer>", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["fwd", "rev", "markowitz"]


def _fuzz_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("fuzz_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzz_script_passes_and_summarises(capsys):
    assert _fuzz_script().main(["-n", "2", "--start", "5", "--max-ops", "4", "--random-orders", "1",
                                "--jobs", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["2 passed, 0 failed"]


def test_fuzz_script_lists_rounding_dependent_seeds_without_failing(monkeypatch, capsys):
    fuzz = _fuzz_script()
    monkeypatch.setattr(fuzz.pg, "check_seed_outcome",  # not JAX: the checker's verdicts, on demand
                        lambda seed, *args, **kwargs: ("rounding", "tie") if seed == 4 else ("passed", ""))
    assert fuzz.main(["--seeds", "3,4,5", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["2 passed, 0 failed, 1 rounding-dependent", "rounding-dependent seeds: 4"]
    assert "ROUNDING-DEPENDENT tie" in captured.err


def test_fuzz_script_exits_1_and_names_failed_seeds(monkeypatch, capsys):
    fuzz = _fuzz_script()
    monkeypatch.setattr(fuzz.pg, "check_seed_outcome",  # not JAX: the checker, to fail on demand
                        lambda seed, *args, **kwargs: ("failed", "boom") if seed == 4 else ("passed", ""))
    assert fuzz.main(["--seeds", "3,4,5", "--jobs", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[:2] == ["2 passed, 1 failed", "failed seeds: 4"]
    assert "FAILED boom" in captured.err


@pytest.fixture
def promotion_restored():
    """The fuzz script sets JAX's settings (``fuzz.OPTIONS``) and the engine's thresholds for its
    process: set them back afterwards."""
    import jax

    from jaxtool.jacobian import clear_caches

    fuzz = _fuzz_script()
    previous, thresholds = {name: getattr(jax.config, name) for name in fuzz.OPTIONS}, pg.thresholds()
    yield
    for name, value in previous.items():
        jax.config.update(name, value)
    pg.set_thresholds(thresholds)
    clear_caches()


def test_fuzz_script_checks_other_dtypes_and_promotion_settings(monkeypatch, capsys, promotion_restored):
    import jax

    fuzz = _fuzz_script()
    assert fuzz.main(["-n", "1", "--start", "5", "--max-ops", "4", "--random-orders", "1", "--jobs", "1",
                      "--dtype", "float64", "--promotion", "strict", "--rank-promotion", "raise", "--check-leaks",
                      "--small-thresholds"]) == 0
    assert capsys.readouterr().out.splitlines() == ["1 passed, 0 failed"]
    assert jax.config.jax_numpy_rank_promotion == "raise" and jax.config.jax_check_tracer_leaks
    assert pg.thresholds() == pg.SMALL_THRESHOLDS
    assert fuzz.main(["--show", "5", "--max-ops", "4", "--dtype", "float64", "--promotion", "strict"]) == 0
    reproducer = capsys.readouterr().out
    assert 'jax.config.update("jax_numpy_dtype_promotion", "strict")' in reproducer
    assert 'jax.config.update("jax_enable_x64", True)' in reproducer and "dtype=np.float64" in reproducer
    assert "jax_numpy_rank_promotion" not in reproducer
    assert fuzz.main(["--show", "5", "--max-ops", "4", "--rank-promotion", "raise", "--check-leaks",
                      "--small-thresholds"]) == 0
    reproducer = capsys.readouterr().out
    assert "jaxtool.partials.SMALL_DENSE = 2\n" in reproducer and "jaxtool.bundles.MIN_STORED = 1\n" in reproducer
    assert 'jax.config.update("jax_numpy_rank_promotion", "raise")' in reproducer
    assert 'jax.config.update("jax_check_tracer_leaks", True)' in reproducer
    assert "jax_numpy_dtype_promotion" not in reproducer
    seen = []
    monkeypatch.setattr(fuzz.pg, "check_seed_outcome",  # not JAX: the checker, to fail on demand
                        lambda seed, *args, **kwargs: seen.append(kwargs["dtype"]) or ("failed", "boom"))
    assert fuzz.main(["--seeds", "4", "--jobs", "1", "--dtype", "bfloat16", "--promotion", "strict",
                      "--rank-promotion", "raise", "--check-leaks", "--small-thresholds"]) == 1
    captured = capsys.readouterr()
    assert seen == ["bfloat16"]
    flags = "--dtype bfloat16 --promotion strict --rank-promotion raise --check-leaks --small-thresholds"
    assert f"{flags} --seeds 4" in captured.out and f"{flags} --show 4" in captured.err
