"""``jaxtool show``: text (vertices, source, folding, inlining, summary), JSON, DOT, colour, lowering.

The programs shown are defined in this file (the CLI loads ``tests/test_show.py:NAME``), so ``--source``
must point back at lines here. Expected vertex numbers come from :func:`jaxtool.graph.flatten`,
expected counts from walking the jaxpr with ``jax.extend.core.jaxprs_in_params``.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import pytest
from click.testing import CliRunner
from jax import lax

from jaxtool.cli import cli, main
from jaxtool.errors import UsageError
from jaxtool.graph import INLINED, flatten

HERE = Path(__file__).resolve()
ANSI = "\x1b["


# ----------------------------------------------------------------------------- programs


def mlp(params, x):
    for layer in params:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])  # mlp-hidden-line
    return jnp.sum(x)


def mlp_example_args():
    f32 = jnp.float32
    params = [{"w": jax.ShapeDtypeStruct((3, 4), f32), "b": jax.ShapeDtypeStruct((4,), f32)},
              {"w": jax.ShapeDtypeStruct((4, 2), f32), "b": jax.ShapeDtypeStruct((2,), f32)}]
    return params, jax.ShapeDtypeStruct((5, 3), f32)


def keyed(key, x):
    """A typed PRNG key in and out (its dtype, key<fry>, is no NumPy dtype: show exited 70)."""
    return jax.random.normal(key, x.shape) + x, jax.random.split(key)


def keyed_example_args():
    return jax.random.key(1), jnp.ones(3)


def control(x):
    y = lax.cond(x[0] > 0, lambda v: v * 2.0, jnp.sin, x)
    total, ys = lax.scan(lambda c, xi: (c + xi, c * xi), 0.0, y)
    a, b = jnp.split(x, 2)
    norm = jax.jit(jnp.linalg.norm)(a)
    count, grown = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, norm))
    return total + grown, ys * jnp.cos(b).sum(), count


def control_example_args():
    return (jax.ShapeDtypeStruct((4,), jnp.float32),)


def tiny(x):
    return jnp.sin(x) * 2.0


def tiny_example_args():
    return (jax.ShapeDtypeStruct((3,), jnp.float32),)


def noisy(x):
    print("noisy: traced")  # JAX caches its trace: it prints the first time this process traces it
    return jnp.sin(x)


def noisy_example_args():
    return (jnp.ones(3),)


def noisy_lowered(x):
    print("noisy: traced")
    return jnp.cos(x)


noisy_lowered_example_args = noisy_example_args


def solve(a, b):
    return jnp.linalg.solve(a, b)  # custom_linear_solve: its jaxprs are a NamedTuple


def solve_example_args():
    return jax.ShapeDtypeStruct((3, 3), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32)


def target(name: str) -> str:
    return f"{HERE}:{name}"


def jaxpr_of(name: str):
    fn = globals()[name]
    return jax.make_jaxpr(fn)(*globals()[f"{name}_example_args"]())


def show(*args: str, global_args: tuple = ()) -> str:
    """Run ``jaxtool [global_args] show ARGS`` in-process; return stdout (exit status must be 0)."""
    result = CliRunner().invoke(cli, [*global_args, "show", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def count_independently(jaxpr) -> Counter:
    counts = Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jcore.jaxprs_in_params(eqn.params):
            counts.update(count_independently(sub))
    return counts


EQN_LINE = re.compile(r"^(?P<label>\S*)\s+(?P<lhs>(?:\S+:\S+ )+)= (?P<prim>[a-z_0-9]+)")


def labelled_eqns(text: str) -> list:
    """``(label, primitive)`` of every printed equation with a vertex label."""
    found = []
    for line in text.splitlines():
        m = EQN_LINE.match(line)
        if m and m["label"].startswith("v"):
            found.append((m["label"], m["prim"]))
    return found


def expected_labels(name: str) -> list:
    program = flatten(jaxpr_of(name))
    return [(",".join(f"v{n}" for n in e.outvars), e.name) for e in program.eqns]


# ----------------------------------------------------------------------------- text


@pytest.mark.parametrize("name", ["mlp", "control"])
def test_vertex_column_matches_flatten(name):
    text = show(target(name), "--vertices", "--no-summary")
    leaves = [(label, prim) for label, prim in labelled_eqns(text) if prim not in INLINED]
    assert leaves == expected_labels(name)


def test_vertices_for_multi_result_call_and_custom_jvp():
    text = show(target("control"), "--vertices", "--no-summary")
    split = [label for label, prim in labelled_eqns(text) if prim == "split"]
    assert len(split) == 1 and re.fullmatch(r"v\d+,v\d+", split[0])
    # the jit call is labelled with the vertex its body's result resolves to (the inner sqrt)
    calls = [label for label, prim in labelled_eqns(text) if prim == "jit"]
    sqrt = [label for label, prim in labelled_eqns(text) if prim == "sqrt"]
    assert calls and set(calls) == set(sqrt)
    text = show(target("mlp"), "--vertices", "--no-summary")
    assert [prim for _, prim in labelled_eqns(text)].count("custom_jvp_call") == 2
    assert "call_jaxpr={ lambda" in text and "max" in text


def test_inline_names_results_by_vertex():
    text = show(target("control"), "--inline", "--no-summary")
    binders = []
    for line in text.splitlines():
        m = re.match(r"^    ((?:v\d+:\S+ )+)= ([a-z_0-9]+)", line)
        if m:
            binders.append((",".join(b.split(":")[0] for b in m[1].split()), m[2]))
    assert binders == expected_labels("control")
    assert "jit[" not in text  # inlined away
    assert "branches[1]={ lambda" in text  # control flow stays opaque, its jaxprs nested


def test_source_points_at_this_file():
    line = next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if "# mlp-hidden-line" in text)
    text = show(target("mlp"), "--source", "--no-summary")
    dot_general = [row for row in text.splitlines() if "= dot_general" in row]
    assert len(dot_general) == 2
    for row in dot_general:
        assert re.search(rf"# \S*test_show\.py:{line}  x = jax\.nn\.relu\(x @ layer\[\"w\"\] \+ layer\[\"b\"\]\)", row)
    assert "test_show.py" not in show(target("mlp"), "--no-summary")


def test_inlined_equations_of_a_library_jit_take_the_line_of_its_call():
    # jnp.where's select_n is inside a jit of JAX's with no user frame: it had no source when inlined
    sample = Path(__file__).parent.parent / "sample_programs" / "branches.py"
    text = show(f"{sample}:piecewise", "--inline", "--source", "--no-summary")
    [row] = [row for row in text.splitlines() if "= select_n" in row]
    assert re.search(r"# \S*branches\.py:18  a = jnp\.where\(x > 0, x \* y, -x\)$", row), row


def test_depth_folds_nested_jaxprs():
    closed = jaxpr_of("control")
    full = show(target("control"), "--no-summary")
    assert "sin" in full and "sqrt" in full and "{ ..." not in full
    folded = show(target("control"), "--depth", "0", "--no-summary")
    folded_dot = show(target("control"), "--depth", "0", "--format", "dot")  # (it said "1 eqns")
    assert "sin" not in folded and "sqrt" not in folded
    for eqn in closed.jaxpr.eqns:
        for sub in jcore.jaxprs_in_params(eqn.params):
            n = sum(count_independently(sub).values())
            assert f"{{ ... {n} eqn{'' if n == 1 else 's'} }}" in folded
            assert f"{{ ... {n} eqn{'' if n == 1 else 's'} }}" in folded_dot
    assert "{ ... 1 eqn }" in folded_dot
    # depth 1: the outer jit body shows, the jit nested inside it folds
    one = show(target("control"), "--depth", "1", "--no-summary")
    assert "sin" in one and "sqrt" not in one and "jaxpr={ ... 3 eqns }" in one


def test_summary_counts_and_inputs():
    text = show(target("mlp"))
    summary = text[text.index("\ninputs:"):]
    counts = dict(re.findall(r"^  ([a-z_0-9]+)\s+(\d+)$", summary, re.M))
    expected = count_independently(jaxpr_of("mlp").jaxpr)
    assert {k: int(v) for k, v in counts.items()} == dict(expected)
    assert f"equations: {sum(expected.values())} (nested included)" in summary
    assert re.search(r'params\[0\]\["w"\]\s+\S+\s+f32\[3,4\]\s+48 B', summary)
    assert re.search(r"^  x\s+\S+\s+f32\[5,3\]\s+60 B$", summary, re.M)
    assert "outputs: 1, 4 bytes" in summary


# ----------------------------------------------------------------------------- JSON


def _walk_json(jaxpr: dict):
    for eqn in jaxpr["eqns"]:
        yield eqn
        for value in eqn["params"].values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict) and "eqns" in item:
                    yield from _walk_json(item)


def test_json_has_every_equation_nested_jaxprs_and_shapes():
    data = json.loads(show(target("control"), "--format", "json"))
    closed = jaxpr_of("control")
    eqns = list(_walk_json(data["jaxpr"]))
    assert Counter(e["primitive"] for e in eqns) == count_independently(closed.jaxpr)
    assert data["summary"]["equations"] == len(eqns)
    cond = next(e for e in data["jaxpr"]["eqns"] if e["primitive"] == "cond")
    assert [len(b["eqns"]) for b in cond["params"]["branches"]] == [1, 1]
    scan = next(e for e in data["jaxpr"]["eqns"] if e["primitive"] == "scan")
    assert scan["params"]["length"] == 4 and scan["outvars"][1]["shape"] == [4]
    program = flatten(closed)
    top = [e for e in data["jaxpr"]["eqns"] if e["primitive"] not in INLINED]
    by_path = program.vertices_by_path()
    assert all(e["vertices"] == list(by_path[tuple(e["path"])]) for e in top)
    assert [(v["shape"], v["dtype"]) for v in data["jaxpr"]["invars"]] == [([4], "float32")]
    assert [o["shape"] for o in data["outputs"]] == [[], [4], []]
    gt = next(e for e in eqns if e["primitive"] == "gt")
    assert gt["invars"][1]["value"] == 0.0 and gt["source"]["file"].endswith("test_show.py")
    assert gt["source"]["function"] == "control" and "lax.cond" in gt["source"]["code"]
    json.dumps(data, allow_nan=False)  # strict JSON


def test_the_jaxprs_of_a_linear_solve_are_nested_and_folded_like_any_other():
    closed = jaxpr_of("solve")
    data = json.loads(show(target("solve"), "--format", "json"))
    assert Counter(e["primitive"] for e in _walk_json(data["jaxpr"])) == count_independently(closed.jaxpr)
    assert data["summary"]["equations"] == sum(count_independently(closed.jaxpr).values())
    folded = show(target("solve"), "--depth", "1", "--no-summary")
    assert "jaxprs[0]={ ... 1 eqn }" in folded and "jaxprs[3]={ ... " in folded
    assert "lambda" not in folded.split("custom_linear_solve", 1)[1].split("in (c,)")[0]  # no raw jaxpr text


def test_json_depth_and_inline():
    data = json.loads(show(target("mlp"), "--format", "json", "--depth", "0"))
    relu = next(e for e in data["jaxpr"]["eqns"] if e["primitive"] == "custom_jvp_call")
    assert relu["params"]["call_jaxpr"] == {"folded": True, "eqns": 2}
    assert relu["params"]["jvp_jaxpr_fun"] == "jvp"
    assert data["inputs"][0]["name"] == 'params[0]["b"]' and data["inputs"][0]["bytes"] == 16
    flat = json.loads(show(target("mlp"), "--format", "json", "--inline"))
    assert flat["inline"] and [e["vertices"] for e in flat["jaxpr"]["eqns"]] == [
        list(e.outvars) for e in flatten(jaxpr_of("mlp")).eqns]
    # the summary counts the program printed: inlined, its calls are gone (it counted the jit of control)
    inlined = json.loads(show(target("control"), "--format", "json", "--inline"))
    printed = Counter(e["primitive"] for e in inlined["jaxpr"]["eqns"])
    assert "jit" not in inlined["summary"]["by_primitive"] and "jit" not in printed
    nested = sum(sum(count_independently(sub).values()) for e in flatten(jaxpr_of("control")).eqns
                 for sub in jcore.jaxprs_in_params(e.params))
    assert inlined["summary"]["equations"] == sum(printed.values()) + nested


# ----------------------------------------------------------------------------- DOT


DOT_TOKEN = re.compile(r'\s*(?:(?P<id>\w+)|(?P<str>"(?:[^"\\\n]|\\.)*")|(?P<op>->|[{}\[\];=,]))')


def parse_dot(text: str) -> tuple:
    """Parse the DOT subset ``to_dot`` writes (a digraph of node, edge, attribute and cluster
    statements); return (declared node ids, edges). Raises AssertionError on malformed text."""
    tokens, pos = [], 0
    while text[pos:].strip():
        m = DOT_TOKEN.match(text, pos)
        assert m, f"bad DOT at {text[pos:pos + 40]!r}"
        tokens.append(m[m.lastgroup])
        pos = m.end()
    declared, edges, i = set(), [], 0

    def take(expected=None):
        nonlocal i
        assert i < len(tokens), "unexpected end of DOT"
        token = tokens[i]
        assert expected is None or token == expected, f"expected {expected!r}, got {token!r}"
        i += 1
        return token

    def ident():
        token = take()
        assert re.fullmatch(r'\w+|".*"', token, re.S), f"expected an id, got {token!r}"
        return token

    def attrs():
        take("[")
        while tokens[i] != "]":
            ident(), take("="), ident()
            if tokens[i] in (",", ";"):
                take()
        take("]")

    def statements():
        take("{")
        while tokens[i] != "}":
            if tokens[i] == "subgraph":
                take(), ident()
                statements()
            else:
                first = ident()
                if tokens[i] == "=":
                    take(), ident()
                elif tokens[i] == "->":
                    while tokens[i] == "->":
                        take()
                        edges.append((first, ident()))
                    if tokens[i] == "[":
                        attrs()
                else:
                    attrs()
                    if first not in ("node", "edge", "graph"):
                        declared.add(first)
            if tokens[i] == ";":
                take()
        take("}")

    take("digraph"), ident()
    statements()
    assert i == len(tokens), "text after the graph"
    return declared, edges


def _check_dot(text: str) -> None:
    declared, edges = parse_dot(text)
    assert edges and all(a in declared and b in declared for a, b in edges)


@pytest.mark.parametrize("extra", [(), ("--inline",), ("--depth", "0")])
def test_dot_is_well_formed(extra):
    text = show(target("control"), "--format", "dot", *extra)
    _check_dot(text)
    assert ("cluster_" in text) == (extra != ("--depth", "0"))  # folded jaxprs draw no clusters
    text = show(target("mlp"), "--format", "dot", *extra)
    _check_dot(text)
    assert r'params[0][\"w\"]' in text  # quotes in labels are escaped


# ----------------------------------------------------------------------------- colour


def test_color_always_styles_and_never_does_not():
    assert ANSI in show(target("tiny"), "--no-summary", global_args=("--color", "always"))
    assert ANSI not in show(target("tiny"), "--no-summary", global_args=("--color", "never"))


def _on_terminal(args) -> str:
    """Run ``main(args)`` in-process with stdout on a pseudo-terminal; return what it printed."""
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "w", encoding="utf-8")
    saved, sys.stdout = sys.stdout, tty
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        tty.flush()
    finally:
        sys.stdout = saved
        tty.close()
    assert exit_info.value.code == 0
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything has been read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return b"".join(chunks).decode()


def test_no_color_honoured_on_a_terminal(monkeypatch):
    args = ["show", target("tiny"), "--no-summary"]
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = _on_terminal(args)
    assert ANSI in coloured and "sin" in coloured
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _on_terminal(args)
    assert ANSI not in plain and "sin" in plain


# ----------------------------------------------------------------------------- lowering and errors


def test_stage_stablehlo_and_hlo_for_cpu():
    text = show(target("tiny"), "--stage", "stablehlo")
    assert "func.func public @main" in text and "stablehlo.sine" in text
    assert "HloModule" in show(target("tiny"), "--stage", "hlo")
    data = json.loads(show(target("tiny"), "--stage", "stablehlo", "--format", "json"))
    assert data["platform"] == "cpu" and "stablehlo.sine" in data["text"]


def test_stage_stablehlo_for_gpu_needs_no_gpu():
    text = show(target("tiny"), "--stage", "stablehlo", global_args=("--backend", "gpu"))
    assert "func.func public @main" in text and "stablehlo.sine" in text


def test_usage_errors():
    result = CliRunner().invoke(cli, ["show", target("tiny"), "--format", "dot", "--stage", "hlo"])
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    result = CliRunner().invoke(cli, ["show", target("tiny"), "--depth", "-1"])
    assert result.exit_code == 2 and "--depth" in result.output
    result = CliRunner().invoke(cli, ["show", target("tiny"), "--stage", "stablehlo", "--vertices", "--source"])
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert str(result.exception) == "--source and --vertices apply to --stage jaxpr only, not to the lowered " \
                                    "stablehlo module"
    for extra in (("--format", "json"), ("--format", "dot"), ("--stage", "hlo")):  # (silently ignored before)
        result = CliRunner().invoke(cli, ["show", target("tiny"), "--no-summary", *extra])
        assert isinstance(result.exception, UsageError) and "--summary/--no-summary apply to the text" in \
            str(result.exception), extra


def test_typed_prng_keys_are_shown_in_every_format():
    for extra in ((), ("--format", "json"), ("--format", "dot"), ("--vertices", "--source")):
        result = CliRunner().invoke(cli, ["show", target("keyed"), *extra])
        assert result.exit_code == 0, (extra, result.output)
    report = json.loads(CliRunner().invoke(cli, ["show", target("keyed"), "--format", "json"]).output)
    assert report["inputs"][0]["dtype"] == "key<fry>" and report["inputs"][0]["bytes"] == 8
    assert report["outputs"][1]["bytes"] == 16  # two keys


def test_a_parameter_whose_repr_raises_is_shown_by_its_type():
    from jaxtool.printing import param_text

    class Opaque:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert param_text(Opaque()) == "<Opaque: str() raised RuntimeError>"  # (show exited 70)
    assert param_text(frozenset({2, 1})) == "frozenset({1, 2})" and param_text(jnp.sin) == "sin"


def test_a_reader_that_stops_early_gives_the_broken_pipe_status(tmp_path):
    # rich's own handler would exit with 1, which means "check failed"
    (tmp_path / "long.py").write_text("import jax.numpy as jnp\n\n\ndef long(x: 'f32[3]'):\n"
                                      "    for _ in range(3000):\n        x = jnp.sin(x)\n    return x\n")
    process = subprocess.Popen([sys.executable, "-m", "jaxtool", "show", "long.py:long"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"{ lambda")
    process.stdout.close()  # (3000 equations: far more than a pipe buffers)
    assert process.wait(timeout=120) == 141 and process.stderr.read() == b""


@pytest.mark.parametrize("closed", ["early", "at start"])
def test_data_written_with_click_to_a_closed_stdout_gives_the_broken_pipe_status(tmp_path, closed):
    # click ended the process with status 1 on the EPIPE of its echo (JSON, DOT), and a stdout
    # closed from the start (>&-) was an internal error in `use_color`, exit 70, or data lost, exit 0
    (tmp_path / "vec.py").write_text("def vec(x: 'f32[2]'):\n    return x * 2\n")
    for args in (("jac", "vec.py:vec", "--format", "json"), ("show", "vec.py:vec", "--format", "dot"),
                 ("jac", "vec.py:vec")):
        command = [sys.executable, "-m", "jaxtool", "-q", *args]
        if closed == "at start":
            command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
        process = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE,
                                   stdout=subprocess.PIPE if closed == "early" else None)
        if process.stdout is not None:
            process.stdout.close()  # (before the child has imported JAX, let alone written)
        assert process.wait(timeout=120) == 141, args
        assert process.stderr.read() == b"", args


def test_a_command_with_no_data_for_a_closed_stdout_still_gives_its_verdict(tmp_path):
    # typecheck of a correct program writes nothing on stdout: with stdout closed from the start it
    # exited 141 and its verdict on stderr was lost
    (tmp_path / "vec.py").write_text("def vec(x: 'f32[2]'):\n    return x * 2\n")
    command = ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "jaxtool", "typecheck", "vec.py:vec"]
    process = subprocess.run(command, cwd=tmp_path, stderr=subprocess.PIPE, timeout=120)
    assert process.returncode == 0 and b"ok: no problems in vec" in process.stderr


def test_a_reader_that_stops_early_in_large_data_gives_the_broken_pipe_status(tmp_path):
    # one buffered write of the whole document, cut short by the reader, returned as if whole: exit 0
    (tmp_path / "long.py").write_text("import jax.numpy as jnp\n\n\ndef long(x: 'f32[3]'):\n"
                                      "    for i in range(300):\n        x = jnp.sin(x) * 1.001 + i\n    return x\n")
    for args in (("show", "long.py:long", "--format", "json"), ("show", "long.py:long", "--format", "dot"),
                 ("show", "long.py:long", "--stage", "stablehlo")):  # (700, 130 and 140 kB: more than a pipe holds)
        process = subprocess.Popen([sys.executable, "-m", "jaxtool", *args], cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout.read(100)  # (of some hundred kilobytes)
        process.stdout.close()
        assert process.wait(timeout=120) == 141, args
        assert process.stderr.read() == b"", args


def test_an_unwritable_stderr_keeps_the_documented_exit_codes(tmp_path):
    # stderr closed behind a pyenv shim is descriptor 2 open for reading: writing the error failed (exit 1)
    (tmp_path / "loud.py").write_text("import os\n\n\ndef loud(x: 'f32[2]'):\n"
                                      "    os.write(1, b'from the user')\n    return x * 2\n")
    (tmp_path / "readable").write_text("")
    for args, code in ((("show", "nope.py:f"), 3), (("jac", "loud.py:loud", "--format", "json"), 0)):
        with open(tmp_path / "readable", "rb") as readable:
            result = subprocess.run([sys.executable, "-m", "jaxtool", *args], cwd=tmp_path, stderr=readable,
                                    stdout=subprocess.PIPE, timeout=120)
        assert result.returncode == code, args
    assert json.loads(result.stdout)["blocks"]


def test_what_the_function_prints_goes_to_stderr():
    for name, extra in (("noisy", ()), ("noisy_lowered", ("--stage", "hlo"))):
        result = CliRunner().invoke(cli, ["show", target(name), *extra, "--format", "json"])
        assert result.exit_code == 0, (result.output, result.exception)
        json.loads(result.stdout)
        assert "noisy: traced" in result.stderr
