"""``jaxtool.typecheck`` (the checker library) and the ``jaxtool typecheck`` command.

Corrupted jaxprs are built here from real traced ones with ``Jaxpr.replace``/``JaxprEqn.replace``
and ``jax.extend.core.new_jaxpr_eqn``; each must be reported with the right code, never crash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.core import ShapedArray
from jax.extend.core import primitives as prims

from jaxtool.cli import main
from jaxtool.typecheck import check_annotations, check_jaxpr, parse_annotation

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "typecheck"
F32_3 = ShapedArray((3,), np.float32)
HAND_BUILT = jcore.DebugInfo("hand-built", "test_typecheck", None, None)


def _codes(report) -> list[str]:
    return [p.code for p in report.problems]


def _fixture(name: str):
    spec = importlib.util.spec_from_file_location(f"_typecheck_fixture_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Well-typed programs.

def test_well_typed_programs_have_no_problems():
    programs = _fixture("programs")
    cases = [
        (programs.mlp, (jnp.ones((5, 4)), jnp.ones((4, 8)), jnp.ones((8, 2)))),
        (programs.piecewise, (jnp.ones(3),)),
        (programs.cumulative, (jnp.ones((6, 3)),)),
        (programs.countdown, (jnp.float32(8.0),)),
    ]
    for fn, args in cases:
        report = check_jaxpr(jax.make_jaxpr(fn)(*args))
        assert report.problems == [], (fn.__name__, report.problems)
        assert report.n_equations > 0


def test_mapped_bodies_with_collectives_are_well_typed_and_still_walked():
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    centred = jax.shard_map(lambda v: v - lax.pmean(v, "i"), mesh=mesh, in_specs=PartitionSpec("i"),
                            out_specs=PartitionSpec("i"))
    pmapped = jax.pmap(lambda v: v - lax.pmean(v, "b"), axis_name="b")
    for fn, x, equations in ((centred, jnp.ones(8), 5), (pmapped, jnp.ones((1, 4)), 7)):
        report = check_jaxpr(jax.make_jaxpr(fn)(x))  # (pmap: a jit of a shard_map)
        assert report.problems == [], report.problems  # (collectives need the mesh's axis names)
        assert report.n_equations == equations  # the body's equations were walked and counted


def test_custom_derivatives_grad_and_remat_are_well_typed():
    @jax.custom_vjp
    def double(x):
        return x * 2

    double.defvjp(lambda x: (double(x), None), lambda _, g: (g * 2,))

    def fn(x, w):
        h = jax.nn.relu(x @ w)  # custom_jvp_call
        h = jax.checkpoint(lambda z: jnp.sin(z) ** 2)(double(h))
        return jax.jit(jnp.sum)(h)

    closed = jax.make_jaxpr(jax.value_and_grad(fn, argnums=1))(jnp.ones((2, 3)), jnp.ones((3, 4)))
    report = check_jaxpr(closed)
    assert report.problems == []
    # nested equations count too: more than the top level alone
    assert report.n_equations > len(closed.jaxpr.eqns)


# ---------------------------------------------------------------------------------------------
# Corrupted jaxprs: one builder per kind, each returning (jaxpr, expected code).

def _simple():
    return jax.make_jaxpr(lambda x, y: jnp.sin(x) * y + 1.0)(jnp.ones(3), jnp.ones(3)).jaxpr


def undefined_variable():
    j = _simple()
    stranger = jcore.Var(F32_3)
    return j.replace(eqns=[j.eqns[0].replace(invars=[stranger]), *j.eqns[1:]]), "JT002"


def used_before_definition():
    j = _simple()
    return j.replace(eqns=[j.eqns[1], j.eqns[0], j.eqns[2]]), "JT002"


def bound_twice():
    j = _simple()
    sin, mul, add = j.eqns
    # mul now writes sin's result variable, and add reads it
    mul = mul.replace(outvars=[sin.outvars[0]])
    add = add.replace(invars=[sin.outvars[0], add.invars[1]])
    return j.replace(eqns=[sin, mul, add]), "JT003"


def input_bound_twice():
    j = _simple()
    return j.replace(invars=[j.invars[0], j.invars[0]]), "JT003"


def output_undefined():
    j = _simple()
    return j.replace(outvars=[jcore.Var(F32_3)]), "JT004"


def wrong_result_type():
    j = _simple()
    sin, mul, add = j.eqns
    wrong = jcore.Var(ShapedArray((3,), np.int32))
    return j.replace(eqns=[sin.replace(outvars=[wrong]), mul.replace(invars=[wrong, mul.invars[1]]), add]), "JT005"


def wrong_literal_type():
    j = _simple()
    add = j.eqns[2]
    literal = jcore.Literal(np.int32(1), ShapedArray((), np.float32))
    return j.replace(eqns=[*j.eqns[:2], add.replace(invars=[add.invars[0], literal])]), "JT006"


def jit_arity_mismatch():
    j = jax.make_jaxpr(lambda x: jax.jit(lambda a, b: a * b)(x, x))(jnp.ones(3)).jaxpr
    call = j.eqns[0]
    return j.replace(eqns=[call.replace(invars=call.invars[:1])]), "JT007"


def cond_branch_types():
    j = jax.make_jaxpr(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))(True, jnp.ones(3)).jaxpr
    cond = j.eqns[-1]
    short = jax.make_jaxpr(lambda x: x[:2])(jnp.ones(3))
    branches = (cond.params["branches"][0], short)
    return j.replace(eqns=[*j.eqns[:-1], cond.replace(params={**cond.params, "branches": branches})]), "JT007"


def scan_body_types():
    j = jax.make_jaxpr(lambda xs: lax.scan(lambda c, x: (c + x, c * x), 0.0, xs))(jnp.ones(5)).jaxpr
    scan = j.eqns[-1]
    body = jax.make_jaxpr(lambda c, x: (c + x, jnp.stack([c, x])))(1.0, 1.0)  # ys of f32[2], not f32[]
    return j.replace(eqns=[*j.eqns[:-1], scan.replace(params={**scan.params, "jaxpr": body})]), "JT007"


def while_cond_not_bool():
    j = jax.make_jaxpr(lambda x: lax.while_loop(lambda c: c < 10.0, lambda c: c * 2.0, x))(1.0).jaxpr
    loop = j.eqns[-1]
    not_bool = jax.make_jaxpr(lambda c: c)(1.0)
    return j.replace(eqns=[loop.replace(params={**loop.params, "cond_jaxpr": not_bool})]), "JT007"


def custom_jvp_call_jaxpr_types():
    j = jax.make_jaxpr(jax.nn.relu)(jnp.ones(3)).jaxpr
    call = next(e for e in j.eqns if e.primitive.name == "custom_jvp_call")
    summed = jax.make_jaxpr(jnp.sum)(jnp.ones(3))
    eqns = [call.replace(params={**call.params, "call_jaxpr": summed}) if e is call else e for e in j.eqns]
    return j.replace(eqns=eqns), "JT007"


def abstract_eval_fails():
    x, y = jcore.Var(F32_3), jcore.Var(ShapedArray((3,), np.int32))
    out = jcore.Var(F32_3)
    eqn = jcore.new_jaxpr_eqn([x, y], [out], prims.add_p, {}, frozenset())
    return jcore.Jaxpr([], [x, y], [out], [eqn], debug_info=HAND_BUILT), "JT008"


def operand_not_an_atom():
    j = _simple()
    return j.replace(eqns=[j.eqns[0].replace(invars=[None]), *j.eqns[1:]]), "JT002"


def not_an_equation():
    j = _simple()
    return j.replace(eqns=[j.eqns[0], "not an equation", *j.eqns[1:]]), "JT009"


def not_a_primitive():
    j = _simple()
    return j.replace(eqns=[j.eqns[0].replace(primitive="sin"), *j.eqns[1:]]), "JT009"


def operands_not_a_list():
    j = _simple()
    return j.replace(eqns=[j.eqns[0].replace(invars=5), *j.eqns[1:]]), "JT009"


CORRUPTIONS = [undefined_variable, used_before_definition, bound_twice, input_bound_twice, output_undefined,
               wrong_result_type, wrong_literal_type, jit_arity_mismatch, cond_branch_types, scan_body_types,
               while_cond_not_bool, custom_jvp_call_jaxpr_types, abstract_eval_fails, operand_not_an_atom,
               not_an_equation, not_a_primitive, operands_not_a_list]


@pytest.mark.parametrize("build", CORRUPTIONS, ids=lambda f: f.__name__)
def test_corrupted_jaxpr_is_reported_with_its_code(build):
    jaxpr, code = build()
    report = check_jaxpr(jaxpr)
    assert code in _codes(report), report.problems
    assert all(p.severity() == "error" for p in report.problems)
    for problem in report.problems:
        assert problem.message and problem.location
    # the same objects are also accepted wrapped in a ClosedJaxpr
    assert code in _codes(check_jaxpr(jcore.ClosedJaxpr(jaxpr, [])))


def test_constant_values_of_closed_jaxprs_are_checked_against_their_constvars():
    # evaluating such a jaxpr fails ("add got incompatible shapes"), and typecheck said ok
    k = np.linspace(0.0, 1.0, 3).astype(np.float32)
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + k)(jnp.ones(3))
    assert closed.jaxpr.constvars and not _codes(check_jaxpr(closed))
    for consts, code, message in [([np.zeros(4, np.float32)], "JT006", "constant value f32[4] does not match its "
                                   "declared type f32[3]"),
                                  ([k.astype(np.int32)], "JT006", "constant value i32[3] does not match"),
                                  ([jax.random.key(0)], "JT006", "does not match its declared type f32[3]")]:
        report = check_jaxpr(jcore.ClosedJaxpr(closed.jaxpr, consts))
        assert [(p.code, p.where) for p in report.problems if p.code == code] == [(code, "<jaxpr>")]
        assert any(message in p.message for p in report.problems), report.problems
    # and in a nested closed jaxpr, at the equation that holds it
    outer = jax.make_jaxpr(lambda x: jax.jit(lambda y: jnp.sin(y) + k)(x) * 2.0)(jnp.ones(3))
    call = outer.jaxpr.eqns[0]
    inner = call.params["jaxpr"]
    if inner.jaxpr.constvars:  # (JAX may pass the constant in as an operand instead)
        bad = jcore.ClosedJaxpr(inner.jaxpr, [np.zeros(4, np.float32)])
        broken = outer.jaxpr.replace(eqns=[call.replace(params={**call.params, "jaxpr": bad}), *outer.jaxpr.eqns[1:]])
        [problem] = [p for p in check_jaxpr(broken).problems if p.code == "JT006"]
        assert problem.where == "<jaxpr>:eqn 0/jaxpr" and problem.primitive == call.primitive.name


def test_check_jaxpr_failures_are_reported_as_jt001():
    # jax's own checker catches these; its complaint comes first, with the user's line
    for build in (undefined_variable, bound_twice, wrong_literal_type, jit_arity_mismatch, operand_not_an_atom):
        jaxpr, _ = build()
        first = check_jaxpr(jaxpr).problems[0]
        assert first.code == "JT001" and first.message.startswith("check_jaxpr: ")
    problem = check_jaxpr(undefined_variable()[0]).problems[0]
    assert problem.file == "tests/test_typecheck.py" or problem.file.endswith("test_typecheck.py")
    assert problem.line is not None and problem.equation and "sin" in problem.equation


def test_messages_name_operand_types_and_the_definition():
    [jt002] = [p for p in check_jaxpr(used_before_definition()[0]).problems if p.code == "JT002"]
    assert jt002.message == "operand 0 (f32[3]) of `mul` is used before its definition by eqn 1"
    assert jt002.primitive == "mul" and "mul" in jt002.equation
    [jt005] = [p for p in check_jaxpr(wrong_result_type()[0]).problems if p.code == "JT005"]
    assert jt005.message == "result 0 of `sin` is declared i32[3] but `sin` of (f32[3]) gives f32[3]"
    [jt007] = [p for p in check_jaxpr(jit_arity_mismatch()[0]).problems if p.code == "JT007"]
    assert "1 operand(s) (f32[3]) but 2 jaxpr input(s)" in jt007.message


def test_problems_carry_no_terminal_colour_codes():
    # JAX's printer colours the types of an equation where stdout is a terminal: they were in the
    # report, its JSON included, whatever --color and NO_COLOR said
    import pty

    for args in (("--color", "never", "typecheck"), ("typecheck", "--format", "json")):
        master, slave = pty.openpty()
        process = subprocess.Popen([sys.executable, "-m", "jaxtool", *args, f"{FIXTURES}/jaxprs.py:handmade"],
                                   stdout=slave, stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": "1"})
        os.close(slave)
        output = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child has closed its end and everything has been read
                break
            if not chunk:
                break
            output += chunk
        os.close(master)
        assert process.wait(timeout=120) == 1 and b"JT005" in output, (args, output)
        assert b"\x1b" not in output, (args, output)


def test_problem_location_points_at_user_source_or_jaxpr_position():
    jaxpr, _ = wrong_result_type()
    [problem] = [p for p in check_jaxpr(jaxpr).problems if p.code == "JT005"]
    line = _simple.__code__.co_firstlineno + 1  # the lambda traced by _simple
    assert (Path(problem.file).name, problem.line, problem.col) == ("test_typecheck.py", line, 1)
    assert problem.location == f"{problem.file}:{line}:1"
    # hand-built equations have no source: the position in the jaxpr is shown instead
    [problem] = [p for p in check_jaxpr(abstract_eval_fails()[0]).problems if p.code == "JT008"]
    assert problem.file is None and problem.location == "<jaxpr>:eqn 0"
    assert problem.primitive == "add" and "add" in problem.message


def test_problems_inside_nested_jaxprs_name_their_path():
    # a hand-built branch whose sin claims an i32 result, inside a traced cond
    j = jax.make_jaxpr(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))(True, jnp.ones(3)).jaxpr
    cond = j.eqns[-1]
    x, out = jcore.Var(F32_3), jcore.Var(ShapedArray((3,), np.int32))
    sin = jcore.new_jaxpr_eqn([x], [out], prims.sin_p, {}, frozenset())
    bad = jcore.ClosedJaxpr(jcore.Jaxpr([], [x], [out], [sin], debug_info=HAND_BUILT), [])
    branches = (cond.params["branches"][0], bad)
    j = j.replace(eqns=[*j.eqns[:-1], cond.replace(params={**cond.params, "branches": branches})])
    problems = check_jaxpr(j).problems
    [inner] = [p for p in problems if p.code == "JT005"]
    assert inner.where == f"<jaxpr>:eqn {len(j.eqns) - 1}/branches[1]:eqn 0"
    assert Path(inner.file).name == "test_typecheck.py"  # the enclosing cond's line
    assert "JT007" in [p.code for p in problems]  # and the branch no longer fits the cond


def test_non_jaxpr_argument_is_reported():
    report = check_jaxpr("hello")
    assert _codes(report) == ["JT009"] and report.n_equations == 0


# ---------------------------------------------------------------------------------------------
# Warnings.

def test_warnings_downcast_and_host_callbacks():
    report = check_jaxpr(jax.make_jaxpr(_fixture("noisy").noisy)(jnp.ones(3)))
    assert sorted(_codes(report)) == ["W201", "W203"]
    assert all(p.severity() == "warning" and p.severity(strict=True) == "error" for p in report.problems)
    [downcast] = [p for p in report.problems if p.code == "W201"]
    assert "f32[3] -> bf16 narrows" in downcast.message and Path(downcast.file).name == "noisy.py"
    assert report.counts() == (0, 2) and report.counts(strict=True) == (2, 0)

    def printing(x):
        jax.debug.print("x={}", x)
        return x.astype(jnp.float16).astype(jnp.float32)  # f32 -> f16 down, f16 -> f32 up

    assert sorted(_codes(check_jaxpr(jax.make_jaxpr(printing)(jnp.ones(2))))) == ["W201", "W203"]


def test_float64_warning_only_when_not_requested():
    with jax.enable_x64(True):
        closed = jax.make_jaxpr(lambda x: x.astype(jnp.float64) * 2)(jnp.ones(3, jnp.float32))
        wide_input = jax.make_jaxpr(lambda x: x + 1)(jnp.ones(3, jnp.float64))
    report = check_jaxpr(closed, warn_float64=True)
    [w202] = report.problems
    assert w202.code == "W202" and w202.primitive == "convert_element_type" and "f64[3]" in w202.message
    assert check_jaxpr(closed, warn_float64=False).problems == []
    assert _codes(check_jaxpr(wide_input, warn_float64=True)) == ["W202"]  # the input, reported once


# ---------------------------------------------------------------------------------------------
# Annotations.

def _avals(*shapes_dtypes):
    return [ShapedArray(shape, dtype) for shape, dtype in shapes_dtypes]


def test_parse_annotation_spec_strings():
    ann = parse_annotation("f32[n, 4]")
    assert ann.dims == ("n", 4) and "f32" in ann.dtypes
    assert parse_annotation("i32[]").dims == ()
    assert parse_annotation("bf16[*batch,_,...]").dims == ("*batch", "_", "...")
    for not_a_spec in ("jax.Array", "float", "f32", "f32[n-1]", "x[3]", None, 3):
        assert parse_annotation(not_a_spec) is None


def test_annotations_match():
    annotations = {"x": "f32[batch,4]", "w": "f32[4,k]", "return": "f32[batch,k]"}
    arguments = {"x": _avals(((5, 4), np.float32)), "w": _avals(((4, 2), np.float32))}
    assert check_annotations(annotations, arguments, _avals(((5, 2), np.float32))) == []


def test_annotation_mismatch_shape_rank_and_dtype():
    annotations = {"x": "f32[3,4]", "y": "i32[3]", "return": "f32[3]"}
    arguments = {"x": _avals(((3, 5), np.float32)), "y": _avals(((3,), np.float32))}
    problems = check_annotations(annotations, arguments, _avals(((), np.float32)), file="m.py", line=7)
    assert [p.code for p in problems] == ["JT101", "JT101", "JT101"]
    assert problems[0].message == "argument 'x' is f32[3,5] but annotated f32[3,4] (axis 1)"
    assert problems[1].message == "argument 'y' is f32[3] but annotated i32[3] (dtype)"
    assert problems[2].message == "return value is f32[] but annotated f32[3] (rank)"
    assert problems[0].location == "m.py:7:1"


def test_pytree_annotations_are_checked_leaf_by_leaf_and_by_structure():
    # (JSON pytree annotations were not checked at all, nor an array annotation on a tuple result:
    # typecheck said "ok")
    annotations = {"p": '{"w": "f32[2,3]", "b": "f32[2]"}', "return": ["f32[3]", "f32[3]"]}
    arguments = {"p": _avals(((2,), np.float32), ((2, 4), np.float32))}  # (b, w: sorted keys)
    paths = {"p": ['["b"]', '["w"]'], "return": [".mu", ".sigma"]}  # a NamedTuple result: positions match a list
    problems = check_annotations(annotations, arguments, _avals(((3,), np.float32), ((), np.float32)), paths=paths)
    assert [p.message for p in problems] == ["argument 'p[\"w\"]' is f32[2,4] but annotated f32[2,3] (axis 1)",
                                             "return value out[1] is f32[] but annotated f32[3] (rank)"]
    keys = check_annotations({"return": '{"a": "f32[3]"}'}, {}, _avals(((3,), np.float32)), paths={"return": ['["b"]']})
    assert [p.message for p in keys] == ['return value has leaves ["b"] but annotated ["a"] (structure)']
    two = check_annotations({"return": "f32[3]"}, {}, _avals(((3,), np.float32), ((3,), np.float32)))
    assert [p.message for p in two] == ["return value is a pytree of 2 arrays but annotated f32[3] (structure)"]
    assert check_annotations(annotations, {"p": _avals(((2,), np.float32), ((2, 3), np.float32))},
                             _avals(((3,), np.float32), ((3,), np.float32)), paths=paths) == []


def test_pytree_annotations_with_named_dimensions_are_checked():
    # their leaves went through the parser of input specs, which refuses names: the annotation was skipped
    annotations = {"p": '{"w": "f32[n,m]", "b": "f32[n]"}', "return": "f32[m]"}
    paths = {"p": ['["b"]', '["w"]'], "return": [""]}
    good = check_annotations(annotations, {"p": _avals(((2,), np.float32), ((2, 3), np.float32))},
                             _avals(((3,), np.float32)), paths=paths)
    bad = check_annotations(annotations, {"p": _avals(((5,), np.float32), ((2, 3), np.float32))},
                            _avals(((3,), np.float32)), paths=paths)
    assert good == [] and [p.message for p in bad] == [
        "dimension 'n' is 2 in argument 'p[\"w\"]' axis 0 but 5 in argument 'p[\"b\"]' axis 0"]
    # a parameter with no traced leaves (--static, None) is not compared, whatever its annotation
    assert check_annotations({"shape": '["i32[]", "i32[]"]'}, {"shape": []}, []) == []


def test_cli_checks_pytree_annotations_with_named_dimensions(capsys, tmp_path):
    (tmp_path / "t.py").write_text(
        "import jax.numpy as jnp\n\n\n"
        "def f(p: '{\"w\": \"f32[n,4]\", \"b\": \"f32[n]\"}'):\n    return p['b'] * 2.0\n\n\n"
        "def g(x: 'f32[3]', shape: '[\"i32[]\", \"i32[]\"]'):\n    return jnp.zeros(shape) + x.sum()\n")
    code, out, _ = _run(capsys, f"{tmp_path}/t.py:f", '{"w": "f32[2,3]", "b": "f32[5]"}')
    assert code == 1 and "JT102 dimension 'n'" in out and "annotated f32[n,4] (axis 1)" in out
    code, out, _ = _run(capsys, f"{tmp_path}/t.py:g", "--static", "shape=(2,3)")  # (a false JT101 on shape)
    assert (code, out) == (0, "")


def test_named_dimension_inconsistent_across_arguments_and_outputs():
    annotations = {"x": "f32[n,4]", "y": "f32[n]", "return": "f32[*rest]"}
    arguments = {"x": _avals(((3, 4), np.float32)), "y": _avals(((5,), np.float32))}
    problems = check_annotations(annotations, arguments, _avals(((2, 2), np.float32)))
    assert [p.code for p in problems] == ["JT102"]
    assert problems[0].message == "dimension 'n' is 5 in argument 'y' axis 0 but 3 in argument 'x' axis 0"
    # a variadic name binds a tuple of sizes
    annotations = {"a": "f32[*b,2]", "return": "f32[*b]"}
    problems = check_annotations(annotations, {"a": _avals(((7, 6, 2), np.float32))}, _avals(((7, 5), np.float32)))
    assert [p.code for p in problems] == ["JT102"]


class _JaxtypingLike:
    """The class attributes jaxtyping gives ``Float[Array, "batch 4"]`` (jaxtyping is optional)."""

    dtypes = ["bfloat16", "float16", "float32", "float64"]
    dims = ()
    dim_str = "batch 4"


def test_jaxtyping_style_annotations():
    ann = parse_annotation(_JaxtypingLike)
    assert ann.dims == ("batch", 4) and "float32" in ann.dtypes
    arguments = {"x": _avals(((2, 4), np.float32)), "y": _avals(((3, 4), np.int32))}
    problems = check_annotations({"x": _JaxtypingLike, "y": _JaxtypingLike}, arguments, [])
    assert sorted(p.code for p in problems) == ["JT101", "JT102"]


def test_symbolic_jaxtyping_sizes_are_checked_once_their_names_are_bound():
    # "n+2" was not checked at all: a function returning n+1 elements passed
    def like(dims: str):
        return type("Annotated", (_JaxtypingLike,), {"dim_str": dims})

    arguments = {"x": _avals(((4, 3), np.float32))}
    for returned, dims, message in [((6,), "n+2", None), ((5,), "n+2", "(axis 0: n+2 = 6)"),
                                    ((7, 2), "2*n-1 m-1", None), ((8, 2), "2*n-1 m-1", "(axis 0: 2*n-1 = 7)"),
                                    ((2,), "n/2", None), ((3,), "n/2", "(axis 0: n/2 = 2.0)"),
                                    ((5,), "k+1", None)]:  # (k is bound nowhere: not checked)
        annotations = {"x": like("n m"), "return": like(dims)}
        problems = check_annotations(annotations, arguments, _avals((returned, np.float32)))
        assert [(p.code, p.message.endswith(message or "")) for p in problems] == ([("JT101", True)] if message else [])
    assert parse_annotation(like("#n+1 *b+1")).dims == ("_", "...")  # broadcastable or variadic: not checked


def test_real_jaxtyping_annotations():
    jaxtyping = pytest.importorskip("jaxtyping")
    ann = jaxtyping.Float[jax.Array, "batch dim"]
    problems = check_annotations({"x": ann, "y": ann},
                                 {"x": _avals(((2, 4), np.float32)), "y": _avals(((2, 5), np.float32))}, [])
    assert [p.code for p in problems] == ["JT102"]


# ---------------------------------------------------------------------------------------------
# The command, in process through jaxtool.cli.main (exit codes included).

def _run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["--color", "never", "typecheck", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)


def test_cli_clean_function_exits_0(capsys, in_repo):
    code, out, err = _run(capsys, "tests/fixtures/typecheck/programs.py:mlp", "f32[5,4]", "f32[4,8]", "f32[8,2]")
    assert (code, out) == (0, "")
    assert re.fullmatch(r"ok: no problems in mlp \(\d+ equations\)", err.strip())


def test_cli_annotation_problems_exit_1(capsys, in_repo):
    code, out, err = _run(capsys, "tests/fixtures/typecheck/annotated.py:inconsistent", "f32[3,4]", "f32[5]")
    assert code == 1
    [line] = out.splitlines()
    assert line.startswith("tests/fixtures/typecheck/annotated.py:14:1: JT102 dimension 'n' is 5")
    assert re.fullmatch(r"error: 1 error, 0 warnings in inconsistent \(\d+ equations\)", err.strip())
    code, out, _ = _run(capsys, "tests/fixtures/typecheck/annotated.py:wrong_return", "f32[2,3]")
    assert code == 1 and " JT101 return value is f32[] but annotated f32[n] (rank)" in out
    code, out, _ = _run(capsys, "tests/fixtures/typecheck/annotated.py:wrong_dtype", "i32[3]")
    assert code == 1 and "JT101 return value is i32[3] but annotated f32[3] (dtype)" in out


def test_cli_warnings_pass_unless_strict(capsys, in_repo):
    target = "tests/fixtures/typecheck/noisy.py:noisy"
    code, out, err = _run(capsys, target, "f32[3]")
    assert code == 0 and "ok: 2 warnings in noisy" in err
    lines = out.splitlines()
    assert [line.split(": ")[1].split()[0] for line in lines if not line.startswith(" ")] == ["W201", "W203"]
    assert any(line.startswith("    ") and "convert_element_type" in line for line in lines)
    code, _, err = _run(capsys, "--strict", target, "f32[3]")
    assert code == 1 and err.startswith("error: 2 errors, 0 warnings in noisy")


def test_cli_json_format(capsys, in_repo):
    code, out, _ = _run(capsys, "--format", "json", "tests/fixtures/typecheck/noisy.py:noisy", "f32[3]")
    assert code == 0
    records = json.loads(out)
    assert [r["code"] for r in records] == ["W201", "W203"]
    for record in records:
        assert set(record) >= {"code", "severity", "message", "file", "line", "col", "primitive", "equation"}
        assert record["severity"] == "warning"
        assert record["file"] == "tests/fixtures/typecheck/noisy.py" and isinstance(record["line"], int)
    assert records[0]["primitive"] == "convert_element_type" and records[1]["primitive"] == "pure_callback"
    code, out, _ = _run(capsys, "--format", "json", "--strict", "tests/fixtures/typecheck/noisy.py:noisy", "f32[3]")
    assert code == 1 and {r["severity"] for r in json.loads(out)} == {"error"}
    # a problem with no source (a hand-built jaxpr) has no column either (it said 1)
    code, out, _ = _run(capsys, "--format", "json", "tests/fixtures/typecheck/jaxprs.py:handmade")
    unlocated = [r for r in json.loads(out) if r["file"] is None]
    assert code == 1 and unlocated and all(r["line"] is None and r["col"] is None for r in unlocated)


def test_cli_github_format(capsys, in_repo):
    code, out, _ = _run(capsys, "--format", "github", "tests/fixtures/typecheck/noisy.py:noisy", "f32[3]")
    assert code == 0
    first, second = out.splitlines()
    assert first.startswith("::warning file=tests/fixtures/typecheck/noisy.py,line=8,col=1::W201 silent down-cast")
    assert second.startswith("::warning file=tests/fixtures/typecheck/noisy.py,line=9,col=1::W203 host callback")
    code, out, _ = _run(capsys, "--format", "github", "--strict", "tests/fixtures/typecheck/noisy.py:noisy",
                        "f32[3]")
    assert code == 1 and all(line.startswith("::error file=") for line in out.splitlines())


def test_cli_float64_warning_when_the_program_enables_x64(capsys, in_repo):
    try:
        code, out, err = _run(capsys, "--format", "json", "tests/fixtures/typecheck/wide.py:widen")
    finally:
        jax.config.update("jax_enable_x64", False)  # the fixture turned it on for this process
    assert code == 0 and "ok: 1 warning in widen" in err
    [record] = json.loads(out)
    assert record["code"] == "W202" and record["line"] == 10 and "f64[3]" in record["message"]


def test_cli_jaxpr_targets(capsys, in_repo):
    code, out, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:CLOSED")
    assert (code, out) == (0, "") and "ok: no problems in CLOSED (2 equations)" in err
    code, out, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:good")
    assert (code, out) == (0, "") and "ok: no problems in good (2 equations)" in err
    code, out, err = _run(capsys, "--format", "json", "tests/fixtures/typecheck/jaxprs.py:broken")
    assert code == 1
    records = json.loads(out)
    assert {"JT001", "JT005"} <= {r["code"] for r in records}
    assert all(r["file"] == "tests/fixtures/typecheck/jaxprs.py" for r in records)
    # hand-built equations have no source: ruff-style lines name the equation instead
    code, out, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:handmade")
    assert code == 1 and "in handmade (1 equation)" in err
    assert "<jaxpr>:eqn 0: JT005 result 0 of `sin` is declared i32[3] but `sin` of (f32[3]) gives f32[3]" in out
    code, out, _ = _run(capsys, "--format", "github", "tests/fixtures/typecheck/jaxprs.py:handmade")
    assert "::error::JT005 result 0 of `sin` is declared i32[3] but `sin` of (f32[3]) gives f32[3] " \
           "(at <jaxpr>:eqn 0)" in out.splitlines()
    code, _, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:CLOSED", "f32[3]")
    assert code == 2 and err.startswith("error: ")


def test_cli_annotations_of_a_transformed_function_do_not_apply_to_the_transformation(capsys, in_repo):
    fixture = "tests/fixtures/typecheck/transformed.py"
    assert _run(capsys, f"{fixture}:grad_of_loss", "f32[3]")[0] == 0  # not "f32[3] but annotated f32[]"
    assert _run(capsys, f"{fixture}:batched_loss", "f32[5,3]")[0] == 0
    code, _, err = _run(capsys, f"{fixture}:grad_of_loss")
    assert code == 2 and "cannot infer inputs for parameter 'x' of grad_of_loss" in err
    for kept in ("jitted_loss", "remat_loss"):
        code, out, _ = _run(capsys, f"{fixture}:{kept}", "f32[2,2]")
        assert code == 1 and "JT101 argument 'x' is f32[2,2] but annotated f32[n] (rank)" in out


def test_cli_needs_shapes_only(capsys, tmp_path):
    (tmp_path / "huge.py").write_text("def f(x: 'f32[100000,100000,100]'):\n    return x * 2\n")
    code, out, err = _run(capsys, f"{tmp_path / 'huge.py'}:f")  # 4 TB if values were drawn
    assert (code, out) == (0, "") and "ok: no problems in f (1 equation)" in err and "drawn" not in err


def test_cli_zero_argument_targets_are_traced_not_run(capsys, in_repo):
    code, out, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:with_computed_constant")
    assert (code, out) == (0, "") and "ok: no problems in with_computed_constant (2 equations)" in err
    code, out, err = _run(capsys, "tests/fixtures/typecheck/jaxprs.py:program_with_failing_callback")
    assert code == 0 and "W203 host callback `pure_callback`" in out
    assert "ok: 1 warning in program_with_failing_callback" in err and "ran" not in err
    fixture = sys.modules[next(name for name, module in sys.modules.items()
                               if getattr(module, "__file__", "") and
                               module.__file__.endswith("typecheck/jaxprs.py"))]
    assert fixture.RAN == []


def test_cli_subprocess_end_to_end():
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "jaxtool", "typecheck", "tests/fixtures/typecheck/jaxprs.py:broken"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "JT005 result 0 of `sin` is declared f32[4]" in proc.stdout
    assert "Traceback" not in proc.stderr
    [summary] = proc.stderr.strip().splitlines()
    assert summary.startswith("error: ") and "errors" in summary
