"""Tests for jaxtool.specs and jaxtool.loading: targets, specs, no-spec conventions, errors."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxtool
from jaxtool.errors import EXIT_LOAD, EXIT_USAGE, LoadError, SpecError, UsageError
from jaxtool.loading import load, load_target, resolve
from jaxtool.specs import draw, format_spec, parse_spec, parse_static, parse_statics
from jaxtool.tracing import trace

FIXTURES = Path(__file__).parent / "fixtures"
BASIC = str(FIXTURES / "fx_basic.py")


@pytest.fixture(autouse=True)
def _restore_sys_path():
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def marker_line(path: Path, marker: str) -> int:
    """The 1-based line of ``path`` carrying the comment ``# LINE: marker``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# LINE: {marker}"):
            return number
    raise AssertionError(f"no marker {marker} in {path}")


# --- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, shape, dtype", [
    ("f32[32,64]", (32, 64), jnp.float32),
    ("i32[]", (), jnp.int32),
    ("bf16[8]", (8,), jnp.bfloat16),
    ("f16[1, 2]", (1, 2), jnp.float16),
    ("i8[3]", (3,), jnp.int8),
    ("i16[3]", (3,), jnp.int16),
    ("u8[2,2]", (2, 2), jnp.uint8),
    ("u32[5]", (5,), jnp.uint32),
    ("bool[]", (), jnp.bool_),
    ("bool[4]", (4,), jnp.bool_),
    ("c64[2]", (2,), jnp.complex64),
    (" f32 [ 0 ] ", (0,), jnp.float32),
])
def test_parse_aval_strings(text, shape, dtype):
    spec = parse_spec(text)
    assert isinstance(spec, jax.ShapeDtypeStruct)
    assert spec.shape == shape
    assert spec.dtype == jnp.dtype(dtype)


def test_parse_pytree_json():
    tree = parse_spec('{"w": "f32[8,4]", "b": "f32[4]"}')
    assert tree["w"].shape == (8, 4) and tree["b"].shape == (4,)
    mixed = parse_spec('["f32[3]", {"a": "f32[]"}, null]')
    assert isinstance(mixed, list) and mixed[0].shape == (3,) and mixed[1]["a"].shape == () and mixed[2] is None


@pytest.mark.parametrize("text, fragment", [
    ("f32[3", "expected DTYPE[DIMS]"),
    ("float[3]", "unknown dtype 'float'"),
    ("q32[2]", "unknown dtype 'q32'"),
    ("i[2]", "unknown dtype 'i'"),
    ("f32[a,2]", "dimension 'a' is a name, not a size"),
    ("f32[-1]", "dimension '-1' is not a non-negative integer"),
    ("f32[3,]", "dimension ''"),
    ('{"a": 1}', 'leaf 1 at ["a"] is not an aval string'),
    ('{"a": ', "invalid JSON"),
    ("", "expected DTYPE[DIMS]"),
])
def test_bad_specs_quote_text_and_expected_form(text, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    message = str(info.value)
    assert fragment in message
    assert repr(text) in message
    assert "\n" not in message
    assert info.value.exit_code == EXIT_USAGE


def test_64_bit_specs_need_x64():
    for text in ("f64[2]", "i64[]", "c128[1]", '{"a": "f64[3]"}'):
        with pytest.raises(SpecError, match="--x64"):
            parse_spec(text)


def test_64_bit_specs_with_x64(x64):
    assert parse_spec("f64[2]").dtype == jnp.float64
    loaded = load_target(f"{BASIC}:affine", ["f64[3,2]", "f64[2]", "f64[4,3]"])
    assert all(a.dtype == jnp.float64 for a in loaded.args)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 64), max_size=4),
       st.sampled_from(["f32", "bf16", "f16", "i8", "i16", "i32", "u8", "u32", "bool", "c64"]))
def test_format_spec_round_trips(shape, dtype):
    text = f"{dtype}[{','.join(map(str, shape))}]"
    assert format_spec(parse_spec(text)) == text


@pytest.mark.parametrize("text, expected", [
    ("n=3", ("n", 3)),
    ("shape=(2, 3)", ("shape", (2, 3))),
    ("lr = 0.5", ("lr", 0.5)),
    ("act=relu", ("act", "relu")),
    ("flag=True", ("flag", True)),
    ("name='x=y'", ("name", "x=y")),
])
def test_parse_static(text, expected):
    assert parse_static(text) == expected


@pytest.mark.parametrize("text", ["n", "=3", "1n=2", "a b=1"])
def test_bad_static(text):
    with pytest.raises(SpecError, match="expected NAME=VALUE"):
        parse_static(text)


def test_parse_statics_rejects_duplicates():
    assert parse_statics(["n=1", "m=x"]) == {"n": 1, "m": "x"}
    assert parse_statics({"n": 1}) == {"n": 1}
    with pytest.raises(SpecError, match="given twice"):
        parse_statics(["n=1", "n=2"])


def test_draws_are_seeded_and_typed():
    tree = {"f": jax.ShapeDtypeStruct((50,), jnp.float32), "i": jax.ShapeDtypeStruct((50,), jnp.int32),
            "b": jax.ShapeDtypeStruct((50,), jnp.bool_), "h": jax.ShapeDtypeStruct((4,), jnp.bfloat16),
            "c": jax.ShapeDtypeStruct((3,), jnp.complex64), "i8": jax.ShapeDtypeStruct((50,), jnp.int8)}
    arrays = draw(tree, np.random.default_rng(7))
    for key in tree:
        assert isinstance(arrays[key], jax.Array)
        assert arrays[key].dtype == tree[key].dtype and arrays[key].shape == tree[key].shape
    first = {key: np.asarray(value) for key, value in arrays.items()}
    again = {key: np.asarray(value) for key, value in draw(tree, np.random.default_rng(7)).items()}
    other = {key: np.asarray(value) for key, value in draw(tree, np.random.default_rng(8)).items()}
    for key in tree:
        np.testing.assert_array_equal(first[key], again[key])
    assert not np.array_equal(first["f"], other["f"])
    assert 0 <= first["i"].min() and first["i"].max() < 10 and 0 <= first["i8"].min()
    assert first["b"].any() and not first["b"].all()
    assert first["c"].imag.any()
    assert -1 < first["f"].mean() < 1 and 0.5 < first["f"].std() < 1.5


# --- targets --------------------------------------------------------------------------------------


def test_file_target_with_specs():
    loaded = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], seed=1)
    assert loaded.arg_names == ["w", "b", "x"]
    assert [a.shape for a in loaded.args] == [(3, 2), (2,), (4, 3)]
    assert loaded.drawn
    assert loaded.source_file == os.path.abspath(BASIC)
    assert loaded.name == "affine"
    out = loaded.fn(*loaded.args)
    w, b, x = loaded.args
    np.testing.assert_allclose(out, np.tanh(np.asarray(x) @ np.asarray(w) + np.asarray(b)), rtol=1e-5)


def test_same_seed_same_values_other_seed_other_values():
    a = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], seed=3).args
    b = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], seed=3).args
    c = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], seed=4).args
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)
    assert not np.array_equal(a[0], c[0])


def test_relative_file_path_and_pytree_spec(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    loaded = load_target("fx_basic.py:mlp", ['{"w": "f32[3,2]", "b": "f32[2]"}', "f32[5,3]"])
    params, x = loaded.args
    assert params["w"].shape == (3, 2) and params["b"].shape == (2,) and x.shape == (5, 3)
    assert loaded.fn(*loaded.args)["loss"].shape == ()


def test_module_target_from_working_directory(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    loaded = load_target("fx_pkg.core:energy", [])
    assert loaded.arg_names == ["x"] and loaded.args[0].shape == (4,)
    x = np.asarray(loaded.args[0])
    np.testing.assert_allclose(loaded.fn(*loaded.args), (x * x).sum() / 2, rtol=1e-5)


def test_file_in_package_supports_relative_imports():
    loaded = load_target(str(FIXTURES / "fx_pkg" / "core.py") + ":energy")
    module = sys.modules[loaded.fn.__module__]
    assert module.__name__ == "fx_pkg.core"
    assert loaded.fn(jnp.ones(4)) == 2.0


def test_sibling_import():
    loaded = load_target(str(FIXTURES / "fx_sibling_main.py") + ":f")
    np.testing.assert_allclose(loaded.fn(*loaded.args), 2 * np.asarray(loaded.args[0]))


def test_class_method_targets():
    method = load_target(f"{BASIC}:Model.loss")  # instance method: Model() is made
    assert method.arg_names == ["x"]
    assert float(method.fn(*method.args)) == pytest.approx(9.0)  # example args [1, 2] * scale 3
    assert not method.drawn
    static = load_target(f"{BASIC}:Model.make")
    assert static.arg_names == ["x"] and static.drawn
    instance = load_target(f"{BASIC}:model.loss", ["f32[2]"])
    assert instance.obj.__self__.scale == 3.0


def test_callable_target_and_load_api():
    def scaled(x, y):
        return x * y

    fn, args = jaxtool.load(scaled, "f32[2]", jnp.arange(2.0))
    assert fn is scaled
    assert args[0].shape == (2,)
    np.testing.assert_array_equal(args[1], [0.0, 1.0])
    fn2, args2 = load(f"{BASIC}:affine", "f32[1,1]", "f32[1]", "f32[1,1]")
    assert fn2(*args2).shape == (1, 1)
    # the API's own checks of what click checks on the command line (NumPy's errors before)
    for bad, message in ((dict(seed=-1), "seed=-1: expected an integer >= 0"),
                         (dict(seed="1"), "seed='1': expected an integer >= 0"),
                         (dict(inputs=3), "inputs=3: expected the path of an .npz file")):
        with pytest.raises(UsageError, match=re.escape(message)):
            jaxtool.load(scaled, "f32[2]", "f32[2]", **bad)


def test_resolve_returns_raw_objects():
    assert isinstance(resolve(f"{BASIC}:a_jaxpr"), jax.extend.core.ClosedJaxpr)
    assert resolve(f"{BASIC}:NOT_CALLABLE") == 3


def test_jaxpr_target_is_a_function_of_its_inputs():
    loaded = load_target(f"{BASIC}:a_jaxpr")
    assert loaded.arg_names == ["arg0", "arg1"]
    assert loaded.drawn
    x, y = loaded.args
    np.testing.assert_allclose(loaded.fn(x, y)[0], np.sin(np.asarray(x)) * np.asarray(y), rtol=1e-6)
    # specs of other types are refused: an elementwise jaxpr evaluated at f32[5] ran, typed f32[3]
    mismatched = load_target(f"{BASIC}:a_jaxpr", ["f32[5]", "f32[2]"])
    with pytest.raises(UsageError, match=re.escape("a_jaxpr is a jaxpr: arg0 is f32[5] but the jaxpr takes f32[2]")):
        trace(mismatched.fn, mismatched.args)


# --- specs and static arguments -------------------------------------------------------------------


def test_static_arguments_are_bound_by_name():
    loaded = load_target(f"{BASIC}:static_fn", ["f32[2]"], static=["n=2", "scale=0.5"])
    assert loaded.arg_names == ["x"]
    np.testing.assert_allclose(loaded.fn(jnp.ones(2)), [0.25, 0.25])
    middle = load_target(f"{BASIC}:affine", ["f32[2,2]", "f32[2,2]"], static={"b": 1.0})
    assert middle.arg_names == ["w", "x"]
    np.testing.assert_allclose(middle.fn(jnp.zeros((2, 2)), jnp.zeros((2, 2))), np.tanh(np.ones((2, 2))))


def test_varargs_take_extra_specs():
    loaded = load_target(f"{BASIC}:varargs", ["f32[2]", "f32[2]", "f32[2]"])
    assert loaded.arg_names == ["x", "rest[0]", "rest[1]"]
    np.testing.assert_allclose(loaded.fn(*loaded.args), sum(np.asarray(a) for a in loaded.args), rtol=1e-6)


def test_fewer_specs_keep_python_defaults():
    loaded = load_target(f"{BASIC}:with_defaults", ["f32[3]"])
    assert loaded.arg_names == ["x"]
    np.testing.assert_allclose(loaded.fn(jnp.ones(3)), [2.0, 2.0, 2.0])


@pytest.mark.parametrize("specs, static, fragment", [
    (["f32[3]"], None, "affine takes 3 array arguments (w, b, x), but 1 spec was given"),
    (["f32[1]"] * 4, None, "but 4 specs were given"),
    (["f32[2]"], ["n=2"], "parameter 'scale' of static_fn is keyword-only; bind it with --static scale=VALUE"),
    (["f32[2]"], ["n=2", "scale=1", "bogus=1"], "--static bogus: static_fn has no parameter 'bogus'"),
    # (an AttributeError from inside the parser before)
    (["f32[2]"], [("n", 2)], "bad static arguments [('n', 2)]: expected a mapping of names to values, or NAME="),
    (["f32[2]"], 5, "bad static arguments 5: expected a mapping"),
])
def test_usage_errors_for_specs(specs, static, fragment):
    target = f"{BASIC}:static_fn" if static else f"{BASIC}:affine"
    with pytest.raises(UsageError) as info:
        load_target(target, specs, static=static)
    assert fragment in str(info.value)
    assert info.value.exit_code == EXIT_USAGE


def test_bad_spec_string_through_load_target():
    with pytest.raises(SpecError, match=r"bad spec 'f32\[3': expected"):
        load_target(f"{BASIC}:affine", ["f32[3", "f32[2]", "f32[2]"])


# --- no-spec conventions --------------------------------------------------------------------------


def test_default_values():
    loaded = load_target(f"{BASIC}:with_defaults")
    assert loaded.arg_names == ["x", "scale", "offset"]  # mode=None keeps its default
    assert not loaded.drawn
    x, scale, offset = loaded.args
    np.testing.assert_array_equal(x, np.ones(3))
    assert scale.dtype == jnp.float32 and float(scale) == 2.0
    np.testing.assert_array_equal(offset, np.zeros(3))
    np.testing.assert_allclose(loaded.fn(*loaded.args), [2.0, 2.0, 2.0])


def test_string_annotations():
    loaded = load_target(f"{BASIC}:annotated", seed=5)
    assert loaded.arg_names == ["x", "n", "flags"]
    assert [(a.shape, a.dtype) for a in loaded.args] == [((3, 4), jnp.float32), ((), jnp.int32), ((2,), jnp.bool_)]
    assert loaded.drawn
    assert format_spec(loaded.annotations["x"]) == "f32[3,4]"
    assert format_spec(loaded.annotations["return"]) == "f32[3,4]"


def test_pytree_string_annotation():
    loaded = load_target(f"{BASIC}:pytree_annotated")
    assert loaded.args[0]["w"].shape == (2, 2) and loaded.args[0]["b"].shape == (2,)


def test_postponed_annotations():
    loaded = load_target(str(FIXTURES / "fx_future.py") + ":f")
    # x from its quoted spec; y=None keeps its default; k=2 is an array-like default
    assert loaded.arg_names == ["x", "k"]
    assert loaded.args[0].shape == (3,)
    assert set(loaded.annotations) == {"x"}
    np.testing.assert_allclose(loaded.fn(*loaded.args), 2 * np.asarray(loaded.args[0]))


def test_companion_function():
    loaded = load_target(f"{BASIC}:companion")
    a, b = loaded.args
    np.testing.assert_array_equal(a, [0.0, 1.0, 2.0])
    assert b.shape == (3,) and loaded.drawn  # a ShapeDtypeStruct in the example is drawn


def test_example_args_attribute_tuple_and_callable():
    plain = load_target(f"{BASIC}:with_attribute")
    assert plain.args[0].shape == (2, 2) and not plain.drawn
    lazy = load_target(f"{BASIC}:with_callable_attribute")
    np.testing.assert_array_equal(lazy.args[0], np.zeros(4))


def test_specs_win_over_conventions():
    loaded = load_target(f"{BASIC}:companion", ["f32[5]", "f32[5]"])
    assert [a.shape for a in loaded.args] == [(5,), (5,)]


def test_concrete_false_keeps_shapes():
    loaded = load_target(f"{BASIC}:annotated", concrete=False)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in loaded.args)
    assert not loaded.drawn


def test_jaxtyping_annotations():
    pytest.importorskip("jaxtyping")
    target = str(FIXTURES / "fx_jaxtyped.py")
    loaded = load_target(f"{target}:f")
    assert [(a.shape, a.dtype) for a in loaded.args] == [((3, 4), jnp.float32), ((), jnp.int32)]
    assert loaded.drawn
    assert set(loaded.annotations) == {"x", "i", "return"}
    with pytest.raises(UsageError, match="cannot infer inputs for parameter 'x' of batched.*no fixed size"):
        load_target(f"{target}:batched")
    callable_object = load_target(f"{target}:layer")  # postponed annotations of __call__
    assert callable_object.arg_names == ["x"] and callable_object.args[0].shape == (2,)


def test_jaxtyping_annotations_of_other_dtypes_draw_one_of_them():
    # Float16, Int8 (and Float32 under --x64) named no "default dtype": exit 2
    from jaxtool.specs import spec_of_annotation

    class Size3:
        size, broadcastable = 3, False

    def like(*dtypes):
        return type("Annotated", (), {"dtypes": list(dtypes), "dims": (Size3(),), "dim_str": "3"})

    for dtypes, expected in ((("float16",), jnp.float16), (("int8",), jnp.int8),
                             (("bfloat16", "float16"), jnp.bfloat16), (("float32", "float16"), jnp.float32)):
        assert spec_of_annotation(like(*dtypes)) == jax.ShapeDtypeStruct((3,), expected), dtypes
    with pytest.raises(SpecError, match=r"no dtype to draw inputs of among float64 \(64-bit: pass --x64\)"):
        spec_of_annotation(like("float64"))


@pytest.mark.parametrize("name, fragment", [
    ("affine", "cannot infer inputs for parameter 'w' of affine; give a spec such as 'f32[3]'"),
    ("unannotated", "cannot infer inputs for parameter 'x' of unannotated"),
    ("bad_annotation", "parameter 'x' of bad_annotation from its annotation (bad spec 'f32[3,x]': "
                       "dimension 'x' is a name, not a size;"),
])
def test_cannot_infer_inputs(name, fragment):
    with pytest.raises(UsageError) as info:
        load_target(f"{BASIC}:{name}")
    assert fragment in str(info.value)


# --- --inputs -------------------------------------------------------------------------------------


def test_inputs_npz(tmp_path):
    path = tmp_path / "in.npz"
    w, b, x = np.ones((3, 2), np.float32), np.arange(2, dtype=np.float32), np.full((4, 3), 0.5, np.float32)
    np.savez(path, arg0=w, arg1=b, arg2=x)
    loaded = load_target(f"{BASIC}:affine", inputs=str(path))
    assert not loaded.drawn
    for got, want in zip(loaded.args, (w, b, x)):
        np.testing.assert_array_equal(got, want)
    checked = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], inputs=str(path))
    np.testing.assert_array_equal(checked.args[2], x)


def test_inputs_for_a_pytree_parameter_are_refused_naming_it(tmp_path):
    # the dict parameter got a plain array and the user's code failed on it: "JAX does not support
    # string indexing" at its own line, exit 3
    (tmp_path / "tree.py").write_text(
        "import jax.numpy as jnp\n\n\ndef loss(params, x):\n    return jnp.sum(params['w'] * x)\n\n\n"
        "def loss_example_args():\n    return {'w': jnp.ones(3)}, jnp.ones(3)\n\n\n"
        "def noted(params: '{\"w\": \"f32[3]\"}', x: 'f32[3]'):\n    return jnp.sum(params['w'] * x)\n")
    np.savez(tmp_path / "in.npz", arg0=np.ones(3, np.float32), arg1=np.ones(3, np.float32))
    for name, where in (("loss", "loss_example_args() (dict)"), ("noted", "its annotation (dict)")):
        with pytest.raises(UsageError, match=re.escape(f"parameter 'params' is a pytree in {where}; --inputs "
                                                       "supports plain array arguments only")):
            load_target(f"{tmp_path / 'tree.py'}:{name}", inputs=str(tmp_path / "in.npz"))


def test_inputs_narrowed_by_32_bit_mode_are_noted(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, arg0=np.ones((3, 2)), arg1=np.arange(2, dtype=np.float32), arg2=np.ones((4, 3)))
    loaded = load_target(f"{BASIC}:affine", inputs=str(path))
    assert [a.dtype for a in loaded.args] == [jnp.float32] * 3
    assert loaded.narrowed == ("arg0 (f64[3,2])", "arg2 (f64[4,3])")
    assert loaded.notes(0) == ["note: --inputs arg0 (f64[3,2]), arg2 (f64[4,3]) taken at 32 bits: 64-bit mode "
                               "is off (pass --x64 to keep 64 bits)"]
    specified = load_target(f"{BASIC}:affine", ["f32[3,2]", "f32[2]", "f32[4,3]"], inputs=str(path))
    assert specified.narrowed == () and specified.notes(0) == []  # the specs asked for float32


def test_inputs_cast_to_spec_dtype(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, arg0=np.arange(3))
    loaded = load_target(f"{BASIC}:with_attribute", ["f32[3]"], inputs=str(path))
    assert loaded.args[0].dtype == jnp.float32
    np.savez(path, arg0=np.array([0.25, 1.0, 2.0]))  # float64 data, float32 spec: same kind
    loaded = load_target(f"{BASIC}:with_attribute", ["bf16[3]"], inputs=str(path))
    assert loaded.args[0].dtype == jnp.bfloat16 and float(loaded.args[0][0]) == 0.25


@pytest.mark.parametrize("arrays, specs, fragment", [
    ({"arg0": np.ones(2)}, None, "affine takes 3 array arguments (w, b, x), but --inputs has 1 array"),
    ({"arg0": np.ones((3, 2)), "arg1": np.ones(2)}, ["f32[3,2]", "f32[2]", "f32[4,3]"], "missing arg2"),
    ({"arg0": np.ones((3, 2)), "arg1": np.ones(2), "arg2": np.ones((4, 3)), "w": np.ones(1)},
     ["f32[3,2]", "f32[2]", "f32[4,3]"], "unexpected w"),
    ({"arg0": np.ones((2, 3), np.float32), "arg1": np.ones(2), "arg2": np.ones((4, 3))},
     ["f32[3,2]", "f32[2]", "f32[4,3]"], "arg0 is f32[2,3] but its spec is f32[3,2]"),
    ({"arg0": np.ones(2)}, ['{"w": "f32[2]"}'], "pytree spec"),
    ({"arg0": np.full(2, 1.5)}, ["i32[2]"],
     "arg0 is f64[2] but its spec is i32[2]; converting would drop its fractions"),
    ({"arg0": np.ones(2, np.complex64)}, ["f32[2]"], "would drop its imaginary parts"),
    ({"arg0": np.arange(2)}, ["bool[2]"], "save booleans for a boolean argument"),
])
def test_inputs_errors(tmp_path, arrays, specs, fragment):
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    target = f"{BASIC}:with_attribute" if specs and len(specs) == 1 else f"{BASIC}:affine"
    with pytest.raises(UsageError) as info:
        load_target(target, specs or [], inputs=str(path))
    assert fragment in str(info.value)


def test_inputs_unreadable(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_target(f"{BASIC}:affine", inputs=str(tmp_path / "missing.npz"))
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not an archive")
    with pytest.raises(UsageError, match="not an .npz file"):  # (numpy's message: "pickled data")
        load_target(f"{BASIC}:affine", inputs=str(garbage))
    strings = tmp_path / "strings.npz"
    np.savez(strings, arg0=np.array(["a", "b"]), arg1=np.ones(2), arg2=np.ones((4, 3)))
    with pytest.raises(UsageError, match="arg0 has dtype <U1 \\(expected numbers or booleans\\)"):
        load_target(f"{BASIC}:affine", inputs=str(strings))
    bad_member = tmp_path / "bad_member.npz"
    with zipfile.ZipFile(bad_member, "w") as archive:  # numpy returns such a member's bytes
        archive.writestr("arg0.npy", b"garbage")
    with pytest.raises(UsageError, match="arg0 is not a NumPy array"):
        load_target(f"{BASIC}:with_attribute", inputs=str(bad_member))
    with pytest.raises(UsageError, match="cannot draw values for spec 'f32\\[99999999999999999999\\]'"):
        load_target(f"{BASIC}:with_attribute", ["f32[99999999999999999999]"])
    single = tmp_path / "single.npy"
    np.save(single, np.ones(2))
    with pytest.raises(UsageError, match="not an .npz file"):
        load_target(f"{BASIC}:affine", inputs=str(single))


# --- load errors ----------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(LoadError, match=r"no such file: .*nope\.py") as info:
        load_target(str(FIXTURES / "nope.py") + ":f")
    assert info.value.exit_code == EXIT_LOAD


def test_not_a_python_file(tmp_path):
    (tmp_path / "model.txt").write_text("x = 1\n")
    with pytest.raises(LoadError, match="is not a Python file"):
        load_target(str(tmp_path / "model.txt") + ":x")
    with pytest.raises(LoadError, match="is a directory"):
        load_target(str(tmp_path) + "/:x")


def test_syntax_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "fx_syntax_broken.py").write_text("import jax\n\n\ndef f(x):\n    return x +\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoadError) as info:
        load_target("fx_syntax_broken.py:f")
    assert str(info.value) == "fx_syntax_broken.py:5: SyntaxError: invalid syntax"
    assert "fx_syntax_broken" not in sys.modules
    # in a module the target imports: which target that was (neither it nor its line was named)
    (tmp_path / "fx_syntax_importer.py").write_text("import fx_syntax_broken\n\n\ndef f(x):\n    return x\n")
    with pytest.raises(LoadError) as info:
        load_target("fx_syntax_importer.py:f")
    expected = "fx_syntax_broken.py:5: SyntaxError: invalid syntax (while importing fx_syntax_importer.py)"
    assert str(info.value) == expected


@pytest.mark.parametrize("raised", ["SystemExit(0)", "SystemExit('bye')", "GeneratorExit('x')"])
def test_base_exceptions_while_tracing_are_load_errors(tmp_path, monkeypatch, raised):
    # (a user's sys.exit while tracing ended jaxtool with its code and no message; GeneratorExit
    # printed a raw traceback)
    (tmp_path / "fx_exits.py").write_text(f'def f(x: "f32[3]"):\n    raise {raised}\n')
    monkeypatch.chdir(tmp_path)
    loaded = load_target("fx_exits.py:f")
    with pytest.raises(LoadError, match=f"^fx_exits.py:2: {raised.split('(')[0]}"):
        trace(loaded.fn, loaded.args, source_file=loaded.source_file)


def test_exception_while_importing(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    line = marker_line(FIXTURES / "fx_import_error.py", "import_error")
    with pytest.raises(LoadError) as info:
        load_target("fx_import_error.py:f")
    assert str(info.value).startswith(f"fx_import_error.py:{line}: KeyError: 'learning_rate'")


def test_missing_dependency_is_reported_at_its_import(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    with pytest.raises(LoadError, match=r"^fx_missing_dep.py:3: ModuleNotFoundError: No module named "
                                        r"'fx_no_such_module_anywhere'"):
        load_target("fx_missing_dep.py:f")


def test_module_not_found(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    with pytest.raises(LoadError, match="no module named 'fx_no_such_mod'"):
        load_target("fx_no_such_mod:f")
    with pytest.raises(LoadError, match="no module named 'fx_pkg.nope'"):
        load_target("fx_pkg.nope:f")


def test_missing_name_suggests_close_names():
    with pytest.raises(LoadError, match=r"name 'afine' not found in .*fx_basic.py; did you mean 'affine'\?"):
        load_target(f"{BASIC}:afine")
    with pytest.raises(LoadError, match=r"did you mean 'Model.loss'\?"):
        load_target(f"{BASIC}:Model.los")
    with pytest.raises(LoadError, match=r"callables there: .*affine"):
        load_target(f"{BASIC}:zzzzqqq")


def test_not_callable_and_uninstantiable():
    with pytest.raises(LoadError, match="NOT_CALLABLE is not callable"):
        load_target(f"{BASIC}:NOT_CALLABLE")
    with pytest.raises(LoadError, match=r"Needy.go is an instance method and Needy\(\) failed"):
        load_target(f"{BASIC}:Needy.go")


@pytest.mark.parametrize("target, fragment", [
    ("fx_basic.py", "expected FILE.py:NAME or MODULE:NAME"),
    ("fx_basic.py:", "expected FILE.py:NAME or MODULE:NAME"),
    ("fx-basic:f", "is neither a .py file nor a module name"),
    (f"{BASIC}:Model..loss", "expected a dotted Python name"),
])
def test_bad_target_syntax(target, fragment):
    with pytest.raises(UsageError, match=fragment):
        load_target(target)


def _edit(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with a modification time one second later than before."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


@contextlib.contextmanager
def _model(tmp_path, monkeypatch, prefix: str, layout: str):
    """``(source, target)`` of a module laid out as ``layout`` (a plain file, a file in a package, or
    named as a module) whose function ``f`` the test writes; what importing it left is removed after."""
    package = f"{prefix}_{layout.replace(' ', '_')}"
    folder = tmp_path / package if layout != "file" else tmp_path
    folder.mkdir(exist_ok=True)
    if layout != "file":
        (folder / "__init__.py").write_text("")
    source = folder / f"{package}_model.py"
    monkeypatch.chdir(tmp_path)
    try:
        yield source, f"{package}.{source.stem}:f" if layout == "module name" else f"{source}:f"
    finally:
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]
        for entry in (str(tmp_path), str(folder)):
            while entry in sys.path:
                sys.path.remove(entry)


@pytest.mark.parametrize("layout", ["file", "package file", "module name"])
def test_an_edit_of_the_same_size_within_the_second_is_seen(tmp_path, monkeypatch, layout):
    # Python's bytecode cache checks a source's mtime in whole seconds and its size: the old code ran
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    second = 1_700_000_000 * 10**9
    with _model(tmp_path, monkeypatch, "same_size", layout) as (source, target):
        source.write_text("def f(x):\n    return x * 2.0\n")
        os.utime(source, ns=(second + 1000, second + 1000))
        assert float(resolve(target)(1.0)) == 2.0
        source.write_text("def f(x):\n    return x * 3.0\n")
        os.utime(source, ns=(second + 2000, second + 2000))
        assert float(resolve(target)(1.0)) == 3.0


def test_a_file_imported_as_a_sibling_is_seen_edited_when_loaded_itself(tmp_path):
    # it stayed as first imported, however often it was edited and loaded
    (tmp_path / "edited_sibling_helper.py").write_text("def h(x):\n    return x * 2.0\n")
    (tmp_path / "edited_sibling_main.py").write_text("from edited_sibling_helper import h\n\n\n"
                                                    "def f(x):\n    return h(x)\n")
    try:
        assert float(resolve(f"{tmp_path}/edited_sibling_main.py:f")(1.0)) == 2.0
        for factor in (3.0, 4.0):
            _edit(tmp_path / "edited_sibling_helper.py", f"def h(x):\n    return x * {factor}\n")
            assert float(resolve(f"{tmp_path}/edited_sibling_helper.py:h")(1.0)) == factor
        assert float(resolve(f"{tmp_path}/edited_sibling_main.py:f")(1.0)) == 2.0  # (its import, as Python has it)
    finally:
        for name in [m for m in sys.modules if m.startswith("edited_sibling")]:
            del sys.modules[name]
        while str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("layout", ["file", "package file", "module name"])
def test_a_load_after_an_edit_sees_the_edited_file(tmp_path, monkeypatch, layout):
    # jaxtool.load in a notebook, the file edited, jaxtool.load again: it returned the function as first imported
    with _model(tmp_path, monkeypatch, "edited", layout) as (source, target):
        source.write_text("def f(x):\n    return x * 1.0\n")
        first = resolve(target)
        assert resolve(target) is first  # unchanged: the module imported before
        _edit(source, "def f(x):\n    return x * 2.0\n")  # (the same size)
        fn, (x,) = load(target, "f32[]")
        assert float(fn(x)) == 2 * float(x) and resolve(target) is not first
        _edit(source, "def f(x):\n    return x *\n")  # an error in the edit: one line, as on a first import
        with pytest.raises(LoadError, match="SyntaxError"):
            resolve(target)
