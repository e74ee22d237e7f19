"""``jaxtool jac``: Jacobians by vertex elimination from the command line, checked against JAX's own AD.

Most runs go in-process through :func:`jaxtool.cli.main` (exit codes and one-line errors
included); one runs as a real subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtool import one_call, partials
from jaxtool.cli import main
from jaxtool.loading import load_target
from jaxtool.report import SMALL_BLOCK, Block, spy_drawing, spy_scale

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = "tests/fixtures/jac/programs.py"
BRANCHES = "sample_programs/branches.py:piecewise"
PYTREE = "sample_programs/pytree_params.py:loss"
ELEMENTWISE = "sample_programs/elementwise.py:elementwise"


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)
    x64 = jax.config.read("jax_enable_x64")
    yield
    jax.config.update("jax_enable_x64", x64)  # `--x64` switches it on for the whole process


def jac(capsys, *args, global_args=()):
    """Run ``jaxtool [global_args] jac ARGS`` in-process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--color", "never", *global_args, "jac", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def jac_json(capsys, *args, global_args=()):
    code, out, err = jac(capsys, *args, "--format", "json", global_args=global_args)
    assert code == 0, err
    return json.loads(out)


def reference_leaves(target, argnums, specs=()):
    """``jax.jacrev`` of the target at its example arguments, flattened: [output leaf][differentiated leaf]."""
    loaded = load_target(target, specs)
    result = jax.jacrev(loaded.fn, argnums=argnums)(*loaded.args)
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(loaded.fn, *loaded.args))
    per_output = out_tree.flatten_up_to(result)
    return [jax.tree_util.tree_leaves(blocks) for blocks in per_output]


# ------------------------------------------------------------------------------------- orders


@pytest.mark.parametrize("order", ["fwd", "rev", "markowitz"])
def test_check_passes_for_named_orders(capsys, order):
    code, out, err = jac(capsys, BRANCHES, "--argnums", "0,1", "--order", order, "--check")
    assert code == 0, err
    assert "check vs jax.jacrev:" in out and "check vs jax.jacfwd:" in out
    assert re.search(r"^check passed \(rtol 0\.0001, atol 1e-05\)$", out, re.M)
    assert re.search(rf"^elimination order: {order} \(8 vertices\)  multiplications: \d+  additions: \d+$", out, re.M)



def test_no_tracer_outlives_its_trace_from_the_command_line(capsys):
    """Under ``jax.checking_leaks()`` (``JAX_CHECK_TRACER_LEAKS=1``) ``jaxtool jac`` kept the program
    it eliminated, whose argument not differentiated (y) is a value of the finished trace, for the
    message of a leaking custom rule: it keeps the rule's name and location instead."""
    with jax.checking_leaks():
        code, out, err = jac(capsys, BRANCHES, "--argnums", "0", "--order", "fwd", "--check")
    assert code == 0, err
    assert re.search(r"^check passed", out, re.M)

def test_custom_order_permutation(capsys):
    rev = jac_json(capsys, BRANCHES, "--argnums", "0,1")
    assert rev["order"] == "rev" and rev["vertices"] == [8, 7, 6, 5, 4, 3, 2, 1]
    order = [8, 1, 2, 3, 4, 5, 6, 7]
    custom = jac_json(capsys, BRANCHES, "--argnums", "0,1", "--order", ",".join(map(str, order)))
    assert custom["order"] == "custom" and custom["vertices"] == order
    for a, b in zip(custom["blocks"], rev["blocks"]):
        np.testing.assert_allclose(a["values"], b["values"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order, expected", [
    ("8,1,2,3,4,5,6,7,1", "duplicates 1"),
    ("0,1,2,3,4,5,6,7,8", "unknown vertices 0 (vertices are 1..9)"),
    ("1,2,3,4,5,6,7,8,42", "unknown vertices 42"),
    ("1,2,3,4,5", "missing vertices 6,7,8"),
    ("1,2,3,4,5,6,7,8,9", "output vertices that cannot be eliminated 9"),
    ("rev,1", "invalid order 'rev,1'"),
    ("1,2,,3,4,5,6,7,8", "invalid order '1,2,,3,4,5,6,7,8': an empty entry"),  # (was read as 1..8)
    ("1,2,3,4,5,6,7,8,", "an empty entry"),
])
def test_invalid_order_exits_2_naming_the_vertices(capsys, order, expected):
    code, out, err = jac(capsys, BRANCHES, "--order", order)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("error: ") and expected in line


def test_a_jacobian_too_large_for_memory_is_one_line_and_exit_2(capsys, monkeypatch):
    # (a million-element elementwise chain: numpy's MemoryError densifying its diagonal, exit 70)
    def no_memory(self):
        raise MemoryError("Unable to allocate 931. GiB for an array with shape (1000000, 1000000)")

    monkeypatch.setattr(partials.Sparse, "to_dense", no_memory)
    code, out, err = jac(capsys, BRANCHES)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("error: out of memory (MemoryError: Unable to allocate 931. GiB")


def test_a_jacobian_xla_cannot_compile_is_computed_op_by_op_with_a_note(tmp_path, monkeypatch, capsys):
    # (the program of test_engine.fft_of_a_kept_sum: JAX 0.10.2's XLA:CPU fails to compile it under jax.jit)
    (tmp_path / "fft.py").write_text("import jax.numpy as jnp\n\n\ndef kept(x: 'f32[2]'):\n"
                                     "    s = jnp.sum(x[None, :] * x[:, None], keepdims=True)\n"
                                     "    return jnp.linalg.inv(jnp.eye(1) + jnp.real(jnp.fft.fft(s)))\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = jac(capsys, "fft.py:kept", "--check", "--format", "json")
    assert code == 0
    check = json.loads(out)["check"]
    assert check["passed"] and check["jacrev"]["passed"] and check["jacfwd"]["passed"]
    compiled = "note: XLA could not compile" not in err
    if compiled:
        pytest.skip("this jaxlib compiles the program: the fallback is not reached")
    assert re.search(r"^note: XLA could not compile the staged Jacobian \(INTERNAL: .*\); computed op by op",
                     err, re.M)


def test_an_unrolled_loop_is_computed_equation_by_equation(tmp_path, monkeypatch, capsys):
    # 150 steps of 3 kinds of equation: jaxtool's Jacobian and --check's two are each run equation by
    # equation, where XLA would compile each whole
    (tmp_path / "steps.py").write_text("import jax.numpy as jnp\n\n\ndef steps(x: 'f32[3]'):\n"
                                       "    for _ in range(150):\n"
                                       "        x = jnp.sin(x) * 1.01 + x[::-1] * 0.1\n"
                                       "    return x\n")
    monkeypatch.chdir(tmp_path)
    ways = []
    real = one_call.by_equation
    monkeypatch.setattr(one_call, "by_equation", lambda *a: (ways.append(len(a[0].eqns)), real(*a))[1])
    code, out, err = jac(capsys, "steps.py:steps", "--check", "--format", "json")
    assert code == 0 and "XLA could not compile" not in err
    check = json.loads(out)["check"]
    assert check["passed"] and check["jacrev"]["passed"] and check["jacfwd"]["passed"]
    assert len(ways) == 3 and min(ways) > 500


def test_an_allocation_xla_cannot_make_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    # 500 GB: XLA's allocation fails when the program runs; reading that array unwaited aborted the process
    (tmp_path / "outer.py").write_text("import jax.numpy as jnp\n\n\ndef outer(x: 'f32[5000]'):\n"
                                       "    return jnp.outer(x, x)\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = jac(capsys, "outer.py:outer")
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("error: out of memory (JaxRuntimeError: RESOURCE_EXHAUSTED: ")


def test_a_target_that_returns_no_arrays_is_a_usage_error(tmp_path, monkeypatch, capsys):
    # (an empty table and exit 0 before; with --check: "all outputs are integer or boolean")
    (tmp_path / "nothing.py").write_text("def nothing(x: 'f32[2]'):\n    return {}\n")
    monkeypatch.chdir(tmp_path)
    for extra in ((), ("--check",)):
        code, out, err = jac(capsys, "nothing.py:nothing", *extra)
        assert code == 2 and out == ""
        assert err.splitlines()[-1] == "error: nothing.py:nothing returns no arrays: nothing to differentiate"


def test_a_save_path_that_cannot_be_a_file_is_refused_before_the_work(capsys, tmp_path, monkeypatch):
    # --save '' saved nothing and said nothing (exit 0); a missing directory was found after the work
    def no_work(*args):
        raise AssertionError("the Jacobian was computed")

    monkeypatch.setattr("jaxtool.commands.jac._eliminate", no_work)
    for path, expected in (("", "--save '': expected the name of a file to write"),
                           (str(tmp_path), f"--save '{tmp_path}': expected the name of a file to write"),
                           (str(tmp_path / "no" / "j.npz"), f"no such directory {tmp_path / 'no'}")):
        code, out, err = jac(capsys, BRANCHES, "--save", path)
        assert code == 2 and out == "" and err.splitlines()[-1].startswith("error: ") and expected in err


def test_debug_is_a_global_option_not_any_argument_that_reads_so(capsys):
    # the value of --order was taken for --debug: a traceback printed before the error line
    code, out, err = jac(capsys, BRANCHES, "--order", "--debug")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: invalid order '--debug'")


def test_order_and_tracing_messages_say_what_there_is(capsys, tmp_path, monkeypatch):
    (tmp_path / "small.py").write_text(
        "import functools\nimport jax\n\n\ndef ident(x: 'f32[2]'):\n    return x\n\n\n"
        "def two(x: 'f32[2]'):\n    return (x * 2) * 3\n\n\n"
        "@functools.partial(jax.jit, static_argnames='k')\ndef power(x: 'f32[2]', k: int = 2):\n    return x ** k\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = jac(capsys, "small.py:ident", "--order", "1")  # ("vertices are 1..0" before)
    assert code == 2 and "unknown vertices 1 (the program has no vertices)" in err
    code, _, err = jac(capsys, "small.py:two", "--order", "2")
    assert code == 2 and "(an order is a permutation of the 1 eliminable vertex; " in err
    # JAX's message ends its first line with "The error was:" and names the cause on the next
    code, _, err = jac(capsys, "small.py:power")
    assert code == 3 and err.splitlines()[-1].endswith(
        "The error was: TypeError: unhashable type: 'DynamicJaxprTracer' "
        "(give a static argument of jax.jit with --static NAME=VALUE)")
    assert jac(capsys, "small.py:power", "--static", "k=3")[0] == 0


def test_options_that_would_be_ignored_are_usage_errors(capsys, tmp_path):
    # --spy with --format json and --seed with --inputs were silently ignored
    code, out, err = jac(capsys, BRANCHES, "--spy", "--format", "json")
    assert code == 2 and out == "" and "--spy draws in the text output, not in --format json" in err
    np.savez(tmp_path / "in.npz", arg0=np.ones(3, np.float32), arg1=np.ones(3, np.float32))
    code, out, err = jac(capsys, BRANCHES, "--inputs", str(tmp_path / "in.npz"), "--seed", "0")
    assert code == 2 and out == "" and "--seed draws values from specs; with --inputs there are none" in err
    assert jac(capsys, BRANCHES, "--inputs", str(tmp_path / "in.npz"))[0] == 0


def test_a_negative_seed_is_a_usage_error(capsys):  # (numpy's ValueError: exit 70 before)
    code, out, err = jac(capsys, BRANCHES, "--seed", "-1")
    assert code == 2 and out == "" and "Invalid value for '--seed': -1 is not in the range x>=0" in err


# ------------------------------------------------------------------------------------- arrays


def test_save_matches_jacrev_for_pytree_arguments(capsys, tmp_path):
    path = tmp_path / "jac.out"  # written under exactly this name, no '.npz' appended
    code, _, err = jac(capsys, PYTREE, "--argnums", "0,1", "--save", str(path))
    assert code == 0, err
    assert f"saved 6 arrays jac_I_J to {path}" in err
    expected = reference_leaves(PYTREE, (0, 1))
    with np.load(path) as saved:
        assert sorted(saved.files) == [f"jac_0_{j}" for j in range(6)]
        for j, want in enumerate(expected[0]):
            got = saved[f"jac_0_{j}"]
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_argnums_order_is_kept_and_inputs_file_is_used(capsys, tmp_path):
    x = np.array([-1.0, 0.5, 2.0, 1.5, -0.3], np.float32)
    y = np.array([0.2, -1.0, 0.4, 0.9, 1.1], np.float32)
    np.savez(tmp_path / "in.npz", arg0=x, arg1=y)
    code, _, err = jac(capsys, BRANCHES, "--inputs", str(tmp_path / "in.npz"), "--argnums", "1,0",
                       "--save", str(tmp_path / "jac.npz"))
    assert code == 0, err
    assert "drawn" not in err
    fn = load_target(BRANCHES).fn
    want_dy, want_dx = jax.jacrev(fn, argnums=(1, 0))(jnp.asarray(x), jnp.asarray(y))
    with np.load(tmp_path / "jac.npz") as saved:
        np.testing.assert_allclose(saved["jac_0_0"], want_dy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(saved["jac_0_1"], want_dx, rtol=1e-5, atol=1e-6)


def test_drawn_inputs_are_noted_and_seeded(capsys, tmp_path):
    code, _, err = jac(capsys, ELEMENTWISE, "f32[6]", "--seed", "3", "--save", str(tmp_path / "a.npz"))
    assert code == 0 and "note: inputs drawn from N(0,1) with seed 3" in err
    x = np.random.default_rng(3).standard_normal(6).astype(np.float32)
    want = jax.jacrev(load_target(ELEMENTWISE).fn)(jnp.asarray(x))
    with np.load(tmp_path / "a.npz") as saved:
        np.testing.assert_allclose(saved["jac_0_0"], want, rtol=1e-5, atol=1e-6)
    code, _, err = jac(capsys, ELEMENTWISE)
    assert code == 0 and "drawn" not in err  # example arguments: nothing drawn


def test_the_note_on_drawn_inputs_names_each_kind_drawn(capsys, tmp_path, monkeypatch):
    # it said "drawn from N(0,1)" for integer and boolean arguments too
    (tmp_path / "kinds.py").write_text("import jax.numpy as jnp\n\n\ndef g(x, n, b):\n"
                                       "    return jnp.where(b, x * n, x)\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = jac(capsys, "kinds.py:g", "f32[3]", "i32[3]", "bool[3]")
    assert code == 0, err
    assert "note: inputs drawn with seed 0: floats from N(0,1), integers from [0, 10), booleans by coin flip" in err


# ------------------------------------------------------------------------------------- output


def test_text_table_and_small_blocks(capsys):
    code, out, _ = jac(capsys, f"{FIXTURES}:mixed", "f32[4]", "i32[]")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["output", "input", "block", "nnz", "max", "|value|"]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows['out["y"]'][1:4] == ["x", "f32[4,4]", "4/16"]
    assert rows['out["i"]'][3:] == ["0/4", "0"]
    assert 'out["y"] w.r.t. x  f32[4,4]' in out  # 16 elements: printed in full, 2-D
    matrix = out.split('out["y"] w.r.t. x  f32[4,4]\n')[1].split("\n\n")[0]
    assert len(matrix.splitlines()) == 4


def test_json_output(capsys):
    data = jac_json(capsys, f"{FIXTURES}:mixed", "f32[4]", "i32[]", "--check")
    assert set(data) == {"order", "vertices", "mults", "adds", "opaque_vertices", "blocks", "check"}
    assert data["opaque_vertices"] == []
    assert [(b["output"], b["input"], b["shape"]) for b in data["blocks"]] == [
        ('out["i"]', "x", [4]), ('out["s"]', "x", [4]), ('out["y"]', "x", [4, 4])]
    y = data["blocks"][2]
    values = np.array(y["values"])
    assert y["nnz"] == np.count_nonzero(values) == 4 and np.all(values == np.diag(np.diag(values)))
    assert y["max_abs"] == pytest.approx(np.abs(values).max())
    check = data["check"]
    assert check["passed"] and check["jacrev"]["passed"] and check["jacfwd"]["passed"]
    assert check["not_compared"] == ['out["i"]']  # an integer output has no derivative to compare


def test_json_leaves_out_values_of_big_blocks(capsys):
    data = jac_json(capsys, f"{FIXTURES}:banded")
    [block] = data["blocks"]
    assert block["shape"] == [199, 200] and block["nnz"] == 398 and "values" not in block


def test_spy_small_block_one_character_per_entry(capsys):
    code, out, _ = jac(capsys, ELEMENTWISE, "--spy")
    assert code == 0
    drawing = out.split("out w.r.t. x  8x8, 12.5% non-zero\n")[1].splitlines()[:8]
    assert drawing == ["·" * i + "█" + "·" * (7 - i) for i in range(8)]


def test_spy_big_block_braille(capsys):
    code, out, _ = jac(capsys, f"{FIXTURES}:banded", "--spy")
    assert code == 0
    assert "out w.r.t. x  199x200, 1% non-zero (one dot per ~4x2 entries)" in out
    drawing = out.split("entries)\n")[1].split("\n\n")[0].splitlines()
    assert len(drawing) == 16 and all(len(line) == 64 for line in drawing)
    assert all("\u2800" <= ch <= "\u28ff" for line in drawing for ch in line)
    # bidiagonal: every drawn row has dots, and they move right row by row
    first_dot = [min(i for i, ch in enumerate(line) if ch != "\u2800") for line in drawing]
    assert first_dot == sorted(first_dot) and first_dot[-1] > first_dot[0]


def test_spy_drawing_downsampling_keeps_every_nonzero():
    matrix = np.zeros((1000, 3000))
    matrix[999, 2999] = 1.0  # a single entry, in the last pooled cell
    matrix[0, 0] = np.nan  # NaN counts as non-zero
    lines = spy_drawing(matrix).splitlines()
    assert len(lines) == 16 and {len(line) for line in lines} == {64}
    assert lines[0][0] == chr(0x2801) and lines[-1][-1] == chr(0x2880)
    assert sum(ch != "\u2800" for line in lines for ch in line) == 2


def test_spy_of_empty_blocks():
    assert spy_drawing(np.zeros((100, 0))) == "(empty)" and spy_scale((100, 0)) == ""
    assert spy_scale((100, 3)) == " (one dot per ~2x1 entries)" and spy_scale((32, 64)) == ""


def test_block_of_scalars_reshapes_to_one_by_one():
    block = Block("out", "x", (), (), np.array(-2.5, np.float32))
    assert block.matrix.shape == (1, 1) and block.nnz == 1 and block.max_abs == 2.5
    assert spy_drawing(block.matrix) == "█"


def test_blocks_up_to_64_elements_are_printed_in_full():
    from jaxtool.report import JacobianReport, render_text

    blocks = (Block("a", "x", (8,), (8,), np.eye(8, dtype=np.float32)),
              Block("b", "x", (5,), (13,), np.ones((5, 13), np.float32)))
    text = render_text(JacobianReport("rev", (1,), 0, 0, blocks)).plain
    assert "a w.r.t. x  f32[8,8]\n[[1. 0." in text
    assert "b w.r.t. x" not in text  # 65 elements: in the table only
    assert SMALL_BLOCK == 64


def test_bfloat16_blocks_print_in_aligned_columns_as_float32_blocks_do():
    from jaxtool.report import JacobianReport, render_text

    values = np.array([[-0.53125, 0.0], [0.0, 1.046875]], np.float32)
    texts = [render_text(JacobianReport("rev", (1,), 0, 0, (Block("a", "x", (2,), (2,), values.astype(dtype)),)))
             .plain.split("\n\n")[1].split("\n", 1)[1] for dtype in (np.float32, jnp.bfloat16)]
    assert texts[0] == texts[1] == "[[-0.53125   0.      ]\n [ 0.        1.046875]]"


# ------------------------------------------------------------------------------------- check


def test_check_exit_code_follows_the_comparison(capsys):
    code, out, err = jac(capsys, ELEMENTWISE, "--check", "--rtol", "0", "--atol", "0", "--format", "json")
    check = json.loads(out)["check"]
    errors = [check[ref]["max_abs_error"] for ref in ("jacrev", "jacfwd")]
    assert check["passed"] == (max(errors) == 0)
    assert code == (0 if check["passed"] else 1)
    if code == 1:
        [line] = err.splitlines()
        assert line.startswith("error: --check: the Jacobian differs from jax.")


@pytest.mark.parametrize("args, message", [
    (["--check", "--atol", "nan"], "Invalid value for '--atol': 'nan' is not a finite number >= 0"),
    (["--check", "--rtol", "inf"], "Invalid value for '--rtol': 'inf' is not a finite number >= 0"),
    (["--check", "--rtol", "-1e-3"], "'-1e-3' is not a finite number >= 0"),
    (["--rtol", "1e-3"], "error: --rtol sets a tolerance of --check; add --check"),
    (["--atol", "0"], "error: --atol sets a tolerance of --check; add --check"),
])
def test_tolerances_are_finite_and_need_check(capsys, args, message):
    code, out, err = jac(capsys, ELEMENTWISE, *args)
    assert code == 2 and out == "" and message in err


def test_what_the_function_prints_goes_to_stderr(capsys):
    # it runs for the trace, the elimination and both references of --check: none of it on stdout,
    # which holds one JSON document
    code, out, err = jac(capsys, f"{FIXTURES}:printing", "--check", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["check"]["passed"]
    assert "printing: traced" in err and "printing" not in out


def test_check_detects_a_wrong_block():
    from jaxtool.commands.jac import _check, _differentiated_leaves
    from jaxtool.tracing import trace

    loaded = load_target(ELEMENTWISE)
    traced = trace(loaded.fn, loaded.args)
    leaves, wrt = _differentiated_leaves(loaded, traced, [0])
    right = np.asarray(jax.jacrev(loaded.fn)(*loaded.args))
    wrong = right.copy()
    wrong[2, 2] += 1e-3 * (1 + abs(wrong[2, 2]))
    check = _check(loaded.fn, traced, leaves, wrt, (Block("out", "x", (8,), (8,), wrong),), None, None)
    assert not check.passed and [c.passed for c in check.comparisons] == [False, False]
    assert [c.reference for c in check.comparisons] == ["jax.jacrev", "jax.jacfwd"]
    assert check.comparisons[0].max_abs_error == pytest.approx(1e-3 * (1 + abs(right[2, 2])), rel=1e-3)


def test_check_reports_an_unavailable_reference(capsys):
    code, out, err = jac(capsys, f"{FIXTURES}:reverse_only", "--check")
    assert code == 0, err
    assert re.search(r"^check vs jax\.jacrev: max abs error \S+, max rel error \S+  ok$", out, re.M)
    assert "check vs jax.jacfwd: unavailable (TypeError: can't apply forward-mode autodiff" in out
    assert "check passed" in out


def test_a_narrower_input_is_checked_at_its_own_tolerance(capsys, tmp_path, monkeypatch):
    # its block has its dtype, as jax.jacrev's; jax.jacfwd's has the output's: at float64's tolerance
    # the float32 block of a correct Jacobian failed against jax.jacfwd (exit 1)
    (tmp_path / "mixed.py").write_text("import jax.numpy as jnp\n\n\ndef g(x, y):\n    return jnp.tanh(x + y)\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = jac(capsys, "mixed.py:g", "f32[3]", "f64[3]", "--argnums", "all", "--check",
                         global_args=("--x64",))
    assert code == 0, out + err
    assert "check passed (rtol 0.0001, atol 1e-05)" in out
    code, out, err = jac(capsys, "mixed.py:g", "f64[3]", "f64[3]", "--argnums", "all", "--check",
                         global_args=("--x64",))
    assert code == 0 and "check passed (rtol 1e-10, atol 1e-10)" in out, out + err


def test_a_reduce_precision_widens_the_default_tolerances_to_its_rounding(capsys, tmp_path, monkeypatch):
    # 3 mantissa bits: jax.jacfwd rounds its tangent 1.1 to 1.125 (2.2% relative), beyond float16's
    # default 1e-2 (exit 1 before); the default is now at least that rounding, 2 ** -(3 + 1)
    (tmp_path / "rounded.py").write_text(
        "from jax import lax\n\n\ndef g(x):\n    return lax.reduce_precision(1.1 * x, 5, 3)\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = jac(capsys, "rounded.py:g", "f32[1]", "--check")
    assert code == 0, out + err
    assert re.search(r"^check vs jax\.jacfwd: max abs error 0\.025, max rel error 0\.0222  ok$", out, re.M)
    assert "check passed (rtol 0.0625, atol 0.0625)" in out


def test_complex_output_checks_against_jacfwd(capsys, tmp_path):
    code, out, err = jac(capsys, f"{FIXTURES}:spectrum", "--check", "--save", str(tmp_path / "j.npz"))
    assert code == 0, err
    assert "check vs jax.jacrev: unavailable (TypeError: jacrev requires real-valued outputs" in out
    assert re.search(r"^check vs jax\.jacfwd: max abs error \S+, max rel error \S+  ok$", out, re.M)
    assert "check passed (rtol 0.0001, atol 1e-05)" in out  # complex64: float32's tolerances
    loaded = load_target(f"{FIXTURES}:spectrum", ())
    saved = np.load(tmp_path / "j.npz")["jac_0_0"]
    assert saved.dtype == np.complex64
    np.testing.assert_allclose(saved, jax.jacfwd(loaded.fn)(*loaded.args), rtol=1e-5, atol=1e-6)
    assert re.search(r"^opaque vertices: v\d+ fft \(partials from JAX's AD", out, re.M)
    report = jac_json(capsys, f"{FIXTURES}:spectrum")
    assert [v["primitive"] for v in report["opaque_vertices"]] == ["fft"]
    [block] = report["blocks"]
    assert block["dtype"] == "complex64" and block["max_abs"] == pytest.approx(np.abs(saved).max(), rel=1e-6)
    np.testing.assert_allclose(np.array(block["values"])[..., 0] + 1j * np.array(block["values"])[..., 1], saved,
                               rtol=1e-6)


def test_x64_tightens_default_tolerances(capsys):
    code, out, err = jac(capsys, ELEMENTWISE, "f64[5]", "--check", global_args=("--x64",))
    assert code == 0, err
    assert "check passed (rtol 1e-10, atol 1e-10)" in out


def test_a_narrower_float_inside_the_program_sets_the_default_tolerances(capsys):
    # jax.jacrev rounds the cotangent of the float16 cast, jax.jacfwd and jaxtool do not: float16's
    # tolerances apply, as they would had the program returned float16
    x = np.linspace(0.3, 2.9, 6, dtype=np.float32)
    fn = load_target(f"{FIXTURES}:half_inside", ()).fn
    rounding = np.abs(np.asarray(jax.jacrev(fn)(x)) - np.asarray(jax.jacfwd(fn)(x))).max()
    assert 1e-4 < rounding < 1e-2
    code, out, err = jac(capsys, f"{FIXTURES}:half_inside", "f32[6]", "--check")
    assert code == 0, err
    assert "check passed (rtol 0.01, atol 0.01)" in out
    code, out, _ = jac(capsys, f"{FIXTURES}:half_inside", "f32[6]", "--check", "--rtol", "1e-4", "--atol", "1e-5")
    assert code == 1 and "check vs jax.jacfwd: max abs error 0," in out


# ------------------------------------------------------------------------------------- errors


def test_a_custom_rule_closing_over_an_argument_not_differentiated_is_differentiated(capsys):
    # the rule is traced when its equation is eliminated: the program is traced again inside the
    # elimination's jax.jit, where the closed-over argument is a value of that trace (it leaked a
    # tracer of the finished trace of `show`'s program before: exit 70, later exit 4)
    code, out, err = jac(capsys, f"{FIXTURES}:scaled_inside", "f32[3]", "f32[3]", "--argnums", "0", "--check")
    assert code == 0, err
    assert "check passed" in out


def test_a_custom_rule_closing_over_a_differentiated_argument_exits_4_with_location(capsys):
    code, out, err = jac(capsys, f"{FIXTURES}:scaled_inside", "f32[3]", "f32[3]", "--argnums", "0,1")
    assert code == 4 and out == ""
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {FIXTURES}:") and "'custom_jvp_call'" in line and "argument" in line


def test_unsupported_primitive_exits_4_with_location(capsys):
    code, out, err = jac(capsys, f"{FIXTURES}:callback")
    assert code == 4 and out == ""
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {FIXTURES}:10: ") and "'pure_callback'" in line


@pytest.mark.parametrize("args, expected", [
    (("--argnums", "2"), "--argnums 2: piecewise takes 2 array arguments (x, y)"),
    (("--argnums", "0,2"), "--argnums 2: piecewise takes 2 array arguments (x, y)"),  # (not 'the same as 0')
    (("--argnums", "0,0"), "position 0 given more than once"),
    (("--argnums", "1,-1"), "--argnums 1 and -1 name the same argument (y)"),  # (two equal blocks before)
    (("--argnums", "a"), "expected comma-separated argument positions"),
])
def test_bad_argnums_exit_2(capsys, args, expected):
    code, _, err = jac(capsys, BRANCHES, *args)
    assert code == 2 and expected in err


def test_integer_argument_cannot_be_differentiated(capsys):
    code, _, err = jac(capsys, f"{FIXTURES}:mixed", "f32[4]", "i32[]", "--argnums", "1")
    assert code == 2 and "cannot differentiate with respect to k (i32[])" in err


def test_argnums_all_takes_every_floating_point_leaf(capsys):
    data = jac_json(capsys, f"{FIXTURES}:mixed", "f32[4]", "i32[]", "--argnums", "all")
    assert {b["input"] for b in data["blocks"]} == {"x"}  # k is an integer: left out


def test_subprocess_run():
    result = subprocess.run([sys.executable, "-m", "jaxtool", "--color", "never", "jac", ELEMENTWISE,
                             "--order", "markowitz", "--format", "json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["order"] == "markowitz" and len(data["vertices"]) == 13
    expected = reference_leaves(ELEMENTWISE, 0)[0][0]
    np.testing.assert_allclose(data["blocks"][0]["values"], expected, rtol=1e-5, atol=1e-6)


def test_writes_to_descriptor_1_in_user_code_go_to_stderr(tmp_path):
    # os.write(1, ...) bypasses sys.stdout (as C extensions' printf does): at import and while traced
    (tmp_path / "raw.py").write_text(
        "import os\nimport jax.numpy as jnp\nos.write(1, b'raw at import\\n')\n\n\n"
        "def f(x):\n    os.write(1, b'raw while traced\\n')\n    return jnp.sin(x)\n")
    result = subprocess.run([sys.executable, "-m", "jaxtool", "jac", "raw.py:f", "f32[2]", "--format", "json"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["blocks"]) == 1
    assert "raw at import" in result.stderr and "raw while traced" in result.stderr


def test_error_measures_handle_nan_and_zeros():
    from jaxtool.commands.jac import _errors

    ref = np.array([0.0, 2.0, np.nan, -1.0])
    assert _errors(ref.copy(), ref, 0.0, 0.0) == (0.0, 0.0, True)  # NaN where the reference has NaN agrees
    max_abs, max_rel, ok = _errors(np.array([1e-6, 2.0, np.nan, -1.1]), ref, 1e-4, 1e-5)
    assert max_abs == pytest.approx(0.1) and max_rel == pytest.approx(0.1) and not ok
    assert _errors(np.array([1e-6, 2.0, 0.0, -1.0]), ref, 1e-4, 1e-5)[0] == np.inf  # a NaN missed


def test_json_writes_non_finite_numbers_as_null():
    from jaxtool.report import JacobianReport, to_json

    values = np.array([[np.inf, 0.1], [np.nan, -2.0]], np.float32)
    report = JacobianReport("rev", (2, 1), 3, 1, (Block("out", "x", (2,), (2,), values),))
    data = json.loads(json.dumps(to_json(report), allow_nan=False))
    assert data["blocks"][0]["values"] == [[None, 0.1], [None, -2.0]]  # float32 0.1 written as 0.1
    assert data["blocks"][0]["max_abs"] is None and data["blocks"][0]["nnz"] == 4
