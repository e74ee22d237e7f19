"""Tests for jaxtool.tracing and jaxtool.source: jaxprs with names, user source locations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtool import source
from jaxtool.errors import EXIT_LOAD, LoadError
from jaxtool.loading import load_target
from jaxtool.tracing import Traced, argument_names, trace

FIXTURES = Path(__file__).parent / "fixtures"
BASIC = FIXTURES / "fx_basic.py"


@pytest.fixture(autouse=True)
def _restore_sys_path():
    saved = list(sys.path)
    yield
    sys.path[:] = saved


def marker_line(path: Path, marker: str) -> int:
    """The 1-based line of ``path`` carrying the comment ``# LINE: marker``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# LINE: {marker}"):
            return number
    raise AssertionError(f"no marker {marker} in {path}")


def test_trace_names_pytree_inputs_and_outputs():
    loaded = load_target(f"{BASIC}:mlp", ['{"w": "f32[3,2]", "b": "f32[2]"}', "f32[5,3]"])
    traced = trace(loaded.fn, loaded.args)
    assert isinstance(traced, Traced)
    assert traced.in_names == ['params["b"]', 'params["w"]', "x"]
    assert traced.out_names == ['out["loss"]', 'out["x"]']
    assert [a.shape for a in traced.in_avals] == [(2,), (3, 2), (5, 3)]
    assert [a.shape for a in traced.out_avals] == [(), (5, 3)]
    assert traced.in_tree == jax.tree_util.tree_structure(loaded.args)
    assert traced.out_tree.num_leaves == 2
    assert len(traced.jaxpr.invars) == len(traced.in_names)


def test_trace_names_for_sequences_attributes_and_single_outputs():
    from dataclasses import dataclass

    @jax.tree_util.register_dataclass
    @dataclass
    class State:
        mu: jax.Array
        nu: jax.Array

    def f(state, pair):
        return (state.mu + pair[0], pair[1])

    traced = trace(f, (State(jnp.ones(2), jnp.ones(2)), (jnp.ones(2), jnp.ones(()))))
    assert traced.in_names == ["state.mu", "state.nu", "pair[0]", "pair[1]"]
    assert traced.out_names == ["out[0]", "out[1]"]
    single = trace(lambda x: x * 2, (jnp.ones(3),))
    assert single.in_names == ["x"] and single.out_names == ["out"]


def test_string_keys_are_escaped_so_that_a_name_is_one_line():
    traced = trace(lambda p: p, ({'a"b': jnp.ones(2), "two\nlines": jnp.ones(2), "λ": jnp.ones(2)},))
    assert traced.in_names == ['p["a\\"b"]', 'p["two\\nlines"]', 'p["λ"]']


def test_trace_accepts_shapes_and_explicit_names():
    traced = trace(lambda *xs: xs[0] * xs[1], [jax.ShapeDtypeStruct((2,), jnp.float32)] * 2, names=["a", "b"])
    assert traced.in_names == ["a", "b"]
    assert str(traced.closed_jaxpr.jaxpr.eqns[0].primitive) == "mul"


def test_trace_uses_static_binding_names():
    loaded = load_target(f"{BASIC}:affine", ["f32[2,2]", "f32[2,2]"], static={"b": 1.0})
    traced = trace(loaded.fn, loaded.args)
    assert traced.in_names == ["w", "x"] == loaded.arg_names


def test_argument_names():
    def f(a, b, *rest, k=1):
        return a

    assert argument_names(f, 4) == ["a", "b", "rest[0]", "rest[1]"]
    assert argument_names(f, 1) == ["a"]
    assert argument_names(max, 2) == ["arg0", "arg1"]


def test_exception_in_user_function_names_file_and_line(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    loaded = load_target("fx_basic.py:raises", ["f32[2]"])
    with pytest.raises(LoadError) as info:
        trace(loaded.fn, loaded.args)
    line = marker_line(BASIC, "raises")
    assert str(info.value) == f"fx_basic.py:{line}: ValueError: bad input"
    assert info.value.exit_code == EXIT_LOAD
    assert isinstance(info.value.__cause__, ValueError)


def test_jax_error_in_user_function_names_file_and_line(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    loaded = load_target("fx_basic.py:shape_bug", ["f32[3]"])
    with pytest.raises(LoadError) as info:
        trace(loaded.fn, loaded.args)
    line = marker_line(BASIC, "shape_bug")
    assert str(info.value).startswith(f"fx_basic.py:{line}: TypeError: dot_general requires contracting "
                                      "dimensions to have the same shape, got (3,) and (4,)")


def test_multiline_exception_is_one_line():
    def f(x):
        if x > 0:  # a concretization error: JAX's message spans many lines
            return x
        return -x

    with pytest.raises(LoadError) as info:
        trace(f, (jnp.ones(()),))
    message = str(info.value)
    assert "\n" not in message
    assert "TracerBoolConversionError" in message
    assert message.startswith(f"{os.path.relpath(__file__)}:")
    assert message.endswith("such as a size or a flag, pass that with --static NAME=VALUE)")


def test_a_traced_size_suggests_static(tmp_path):
    # a default of numbers is an array argument: used as a shape, JAX's error named tracers and nothing else
    (tmp_path / "sized.py").write_text("def f(x: 'f32[3]', shape=(1, 3)):\n    return x.reshape(shape)\n")
    result = subprocess.run([sys.executable, "-m", "jaxtool", "show", "sized.py:f"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_LOAD and "pass that with --static NAME=VALUE)" in result.stderr
    (tmp_path / "power.py").write_text("def f(x: 'f32[3]', n: 'i32[]'):\n    for _ in range(n):\n"
                                       "        x = x * x\n    return x\n")  # (TracerIntegerConversionError)
    power = subprocess.run([sys.executable, "-m", "jaxtool", "show", "power.py:f"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert power.returncode == EXIT_LOAD and "pass that with --static NAME=VALUE)" in power.stderr
    fixed = subprocess.run([sys.executable, "-m", "jaxtool", "show", "sized.py:f", "--static", "shape=(1,3)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0 and "reshape" in fixed.stdout


def test_error_without_user_frame_says_what_failed():
    with pytest.raises(LoadError, match="tracing .* failed: TypeError"):
        trace(jnp.sin, ("not an array",))


def test_user_frame_and_location_of_equations(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    loaded = load_target("fx_basic.py:calls_helper", ["f32[3]"])
    traced = trace(loaded.fn, loaded.args)
    sin = next(e for e in traced.jaxpr.eqns if e.primitive.name == "sin")
    frame = source.user_frame(sin.source_info)
    line = marker_line(BASIC, "helper")
    assert frame.file_name == str(BASIC) and frame.line_num == line and frame.function_name == "_helper"
    assert source.location(sin.source_info) == f"fx_basic.py:{line}"
    assert source.source_line(frame) == "return jnp.sin(x) * 2.0  # LINE: helper"
    assert source.location(None) is None


def test_location_outside_working_directory_stays_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    frame = source.Frame(str(BASIC), 3, "f")
    assert source.format_frame(frame) == f"{BASIC}:3"


def test_library_files():
    import click

    assert source.is_library(jax.__file__)
    assert source.is_library(np.__file__)
    assert source.is_library(os.__file__)
    assert source.is_library(source.__file__)
    assert source.is_library("<frozen importlib._bootstrap>")
    assert not source.is_library(str(BASIC))
    assert not source.is_library("<string>")
    assert not source.is_library(click.__file__)  # site-packages below the stdlib folder is not stdlib


def test_location_of_exception_prefers_the_given_file():
    sys.path.insert(0, str(FIXTURES))
    import fx_sibling_main

    with pytest.raises(TypeError) as info:
        fx_sibling_main.f(None)
    helper = source.exception_frame(info.value)
    preferred = source.exception_frame(info.value, prefer=fx_sibling_main.__file__)
    assert helper.file_name.endswith("fx_sibling_helper.py")
    assert preferred.file_name.endswith("fx_sibling_main.py")


def test_a_failing_trace_in_a_sibling_module_names_its_line_too(tmp_path):
    # it was reported at the target file's call alone: the line that failed was not named
    (tmp_path / "util.py").write_text("import jax.numpy as jnp\n\n\ndef bad(x):\n    return jnp.dot(x, jnp.ones(5))\n")
    (tmp_path / "main.py").write_text("import util\n\n\ndef f(x: 'f32[3]'):\n    return util.bad(x)\n")
    result = subprocess.run([sys.executable, "-m", "jaxtool", "show", "main.py:f"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_LOAD and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: main.py:5: TypeError: dot_general") and line.endswith(" (via util.py:5)")


def test_code_file_sees_through_wrappers():
    loaded = load_target(f"{BASIC}:static_fn", ["f32[2]"], static={"n": 1, "scale": 2.0})
    assert source.code_file(loaded.fn) == str(BASIC)
    assert source.code_file(jax.jit(loaded.fn)) == str(BASIC)
    assert source.code_file(len) is None


def test_cli_error_line_for_a_failing_trace():
    """End to end through ``jaxtool show``: one ``error: file:line: ...`` line on stderr, exit code 3."""
    result = subprocess.run([sys.executable, "-m", "jaxtool", "show", "fx_basic.py:shape_bug", "f32[3]"],
                            cwd=FIXTURES, capture_output=True, text=True, timeout=120)
    line = marker_line(BASIC, "shape_bug")
    assert result.returncode == EXIT_LOAD, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: fx_basic.py:{line}: TypeError: dot_general requires contracting dimensions to have the same "
        "shape, got (3,) and (4,)."]
