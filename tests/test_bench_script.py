"""Smoke test of ``scripts/bench.py`` (``make bench``): its machinery on one tiny program.

No timing is asserted: the counts are tiny and the program is a two-input toy, so that the test
costs a few small compilations. What is checked is that every measurement is made, the Jacobians
are compared with ``jax.jacrev``'s, the operation counts are jaxtool's own, and the markdown has
every table with one row per program and a ratio that follows from the times it shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def toy(x, n, y):
    """Two float inputs (one a vector) and an integer one, which must not be differentiated."""
    return jnp.sin(x) * y + jnp.cos(x * y) * n, jnp.sum(x * x) + y


def toy_args():
    return jnp.asarray([0.3, -0.2, 0.5], jnp.float32), jnp.int32(2), jnp.float32(1.5)


@pytest.fixture(scope="module")
def measured(bench):
    opts = argparse.Namespace(**bench.QUICK, quick=True)
    result = bench.bench_program("toy", toy, toy_args(), opts)
    text = bench.report([result], opts, bench.machine_description(), (1.0, 1.0, 1.0), None, 1.0)
    return result, text


def _table(text: str, heading: str) -> list:
    """The rows (lists of cells) of the table under the ``## heading...`` line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## " + heading))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_every_measurement_is_made(bench, measured):
    result, _ = measured
    assert result.argnums == (0, 2)  # the floating-point arguments only
    for times in (result.run, result.batched, result.first):
        assert set(times) == set(bench.COMPETITORS)
        assert all(0 < t < 60 for t in times.values())
    assert 0 < result.floor < 60
    assert -60 < result.handoff < 60  # a difference of two timed probes (see bench.PROBES)
    assert set(result.flops) == set(bench.COMPETITORS) and all(f > 0 for f in result.flops.values())
    assert set(result.deviation) == set(bench.ORDERS)
    assert max(result.deviation.values()) <= bench.TOLERANCE


def test_operation_counts_are_jaxtools(bench, measured):
    from jaxtool.elimination import run
    from jaxtool.jacobian import trace_problem
    from jaxtool.orders import resolve_order

    result, _ = measured
    problem = trace_problem(toy, *toy_args(), argnums=(0, 2))
    for order in bench.ORDERS:
        cost = run(problem.plan(), resolve_order(order, problem))
        assert result.ops[order] == (cost.mults, cost.adds)
        assert cost.mults > 0


def test_markdown_report(bench, measured):
    result, text = measured
    assert text.startswith("# Benchmarks")
    assert "## Machine" in text and "jax 0." in text and "`--quick`" in text
    assert "toy: 2 of 3" in text

    for heading, unit, key in (("Run time", 1e6, "run"), ("Batched", 1e3, "batched")):
        header, _, row, mean = _table(text, heading)
        assert header[:6] == ["program", "`jax.jacfwd`", "`jax.jacrev`", "`jacve fwd`", "`jacve rev`",
                              "`jacve markowitz`"]
        assert row[0] == "toy"
        times = dict(zip(header[1:6], (float(c.rstrip(bench.INLINE_MARK)) for c in row[1:6])))
        for competitor, cell in zip(bench.COMPETITORS, row[1:6]):  # the mark: XLA runs the call inline
            assert cell.endswith(bench.INLINE_MARK) == (key == "run" and bench.runs_inline(result, competitor))
        best = row[6]
        assert best in bench.ORDERS
        assert times[f"`jacve {best}`"] == min(times[f"`jacve {o}`"] for o in bench.ORDERS)
        ratio = float(row[7])
        expected = times[f"`jacve {best}`"] / min(times["`jax.jacfwd`"], times["`jax.jacrev`"])
        assert math.isclose(ratio, expected, rel_tol=0.05, abs_tol=0.01)  # shown times are rounded
        assert ratio == pytest.approx(bench.speed_ratio(getattr(result, key)), abs=0.006)
        if key == "run":  # the call floor, floor bound and hand-off are the last columns of the point table only
            assert header[-3:] == ["call floor", "floor bound", "hand-off"]
            assert float(row[-3]) == pytest.approx(result.floor * unit, rel=0.01)
            bound = result.floor / min(result.run[c] for c in bench.JAX_COMPETITORS)
            assert float(row[-2]) == pytest.approx(bound, abs=0.006) and mean[-2] == f"**{row[-2]}**"
            assert float(row[-1]) == pytest.approx(result.handoff * unit, rel=0.01, abs=0.01)
            header, row, mean = header[:-3], row[:-3], mean[:-3]
        else:
            assert len(header) == 8
        assert mean[0] == "**geo. mean**" and mean[-1] == f"**{row[7]}**"  # one program: the mean is its ratio

    header, _, row, mean = _table(text, "First call")
    assert header[-3:] == ["fwd / jacrev", "rev / jacrev", "markowitz / jacrev"]
    for order, cell in zip(bench.ORDERS, row[-3:]):
        assert float(cell) == pytest.approx(result.first[f"jacve {order}"] / result.first["jax.jacrev"], abs=0.006)

    header, _, row = _table(text, "Operation counts")
    assert row[0] == "toy"
    assert row[1:4] == [f"{m} ({a})" for m, a in (result.ops[o] for o in bench.ORDERS)]
    assert row[4:8] == ["-"] * 4  # graphax has no counts for this program
    assert "MISMATCH" not in row[8]


def test_graphax_counts_cover_every_program(bench):
    assert set(bench.GRAPHAX_MULS) == set(bench.PROGRAMS)
    for name in bench.PROGRAMS:
        assert (Path(bench.SAMPLES_DIR) / f"{name}.py").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--programs", "roe_flux_1d,nope"], "unknown program(s) nope"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_options_exit_2(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options(bench):
    quick = bench.parse_args(["--quick", "--programs", "encoder, perceptron", "--calls", "5"])
    assert quick.programs == ["encoder", "perceptron"]
    assert (quick.rounds, quick.calls, quick.batch) == (bench.QUICK["rounds"], 5, bench.QUICK["batch"])
    full = bench.parse_args([])
    assert full.programs == list(bench.PROGRAMS + bench.STRUCTURED + tuple(bench.OTHERS))
    assert full.batch == 1024 and full.output is None


def test_round_robin_caps_slow_calls_by_budget(bench):
    calls = {"slow": 0, "fast": 0}

    def make(name, seconds):
        def f():
            calls[name] += 1
            time.sleep(seconds)
            return jnp.zeros(())
        return f

    # (the fast competitor gets every call only if its warm-up call takes under budget / calls: 50 ms
    # here, far from a loaded machine's pauses; with 5 ms, one took 6 ms in a CI run)
    times = bench.time_round_robin({"slow": make("slow", 0.2), "fast": make("fast", 0.0)}, (), rounds=3,
                                   calls=10, budget=0.5)
    assert calls["fast"] == 2 + 3 * 10  # two warm-up calls, then every round in full
    assert 2 + 3 * 1 <= calls["slow"] <= 2 + 3 * 2  # 0.5 s affords at most two 0.2 s calls a round
    assert times["slow"] >= 0.2 > times["fast"]


def stencil(u):
    """A three-point stencil: a tridiagonal Jacobian."""
    p = jnp.pad(u, 1)
    return p[:-2] - 2.0 * p[1:-1] + p[2:] + jnp.exp(u)


def test_structured_programs_are_timed_and_checked(bench):
    opts = argparse.Namespace(**bench.QUICK, quick=True)
    result = bench.bench_structured("stencil", stencil, (jnp.linspace(0.0, 1.0, 50),), opts)
    assert set(result.run) == set(bench.COMPETITORS) and all(0 < t < 60 for t in result.run.values())
    assert max(result.deviation.values()) <= bench.TOLERANCE
    text = bench.report([], opts, bench.machine_description(), None, None, 1.0, [result])
    assert "## Run time" not in text  # no benchmark task was measured
    header, _, row, mean = _table(text, "Structured")
    assert row[0] == "stencil" and header[-1] == "max deviation from `jax.jacrev`"
    assert float(row[7]) == pytest.approx(bench.speed_ratio(result.run), abs=0.006)
    assert float(row[-1]) <= bench.TOLERANCE and mean[0] == "**geo. mean**"
    for name in bench.STRUCTURED:
        assert (Path(bench.SAMPLES_DIR) / f"{name}.py").is_file()


def test_point_timing_in_a_pinned_child(bench):
    cpu = bench.pinnable_cpu()
    if cpu is None:
        pytest.skip("this process may run on one CPU only (or cannot set affinity): nothing to pin")
    opts = argparse.Namespace(**bench.QUICK, quick=True)
    times, flops = bench.time_point_pinned("roe_flux_1d", cpu, opts)
    assert set(times) == set(bench.COMPETITORS) | {bench.FLOOR} | set(bench.PROBES)
    assert all(0 < t < 60 for t in times.values())
    assert set(flops) == set(bench.COMPETITORS) and all(f > 0 for f in flops.values())
    assert bench.parse_args([]).pin_cpu == cpu and bench.parse_args(["--no-pin"]).pin_cpu is None


def test_other_sample_programs_load_with_pytree_arguments(bench, measured):
    for name, function in bench.OTHERS.items():
        fn, args = bench.load_program(name)
        assert fn.__name__ == function and bench.float_argnums(args)
    _, args = bench.load_program("scan_rnn")  # (params dict, xs): both differentiated
    assert bench.float_argnums(args) == (0, 1)
    batch = bench.batch_of(args, (0, 1), 3)
    assert batch[0]["w_h"].shape == (3, 4, 4) and batch[1].shape == (3, 5, 3)
    result, _ = measured
    opts = argparse.Namespace(**bench.QUICK, quick=True)
    text = bench.report([result], opts, bench.machine_description(), None, None, 1.0, (), [result])
    assert "## Other sample programs" in text and "largest deviation: toy" in text
    section = text[text.index("## Other sample programs"):].replace("### ", "## ")
    for heading, last in (("Run time", "hand-off"), ("Batched", "ratio")):  # the other programs' own tables
        header, _, row, _ = _table(section, heading)
        assert row[0] == "toy" and header[-1] == last


def test_a_stopped_run_keeps_what_it_measured(bench, measured, monkeypatch, tmp_path):
    # a GPU lease's timeout stopped a run on its eighth program: the seven before it were lost
    result, _ = measured

    def bench_program(name, fn, args, opts):
        if name == "roe_flux_3d":
            raise TimeoutError("the lease ended")
        return result

    monkeypatch.setattr(bench, "bench_program", bench_program)
    monkeypatch.setattr(bench, "load_program", lambda name: (toy, toy_args()))
    output = tmp_path / "bench.md"
    with pytest.raises(TimeoutError):
        bench.main(["--quick", "--no-pin", "--programs", "roe_flux_1d,roe_flux_3d", "--output", str(output)])
    text = output.read_text()
    assert text.startswith("**Partial: 1 of 2 programs measured; the run did not end.**")
    assert _table(text, "Run time")[2][0] == "toy"


def test_first_call_stages_prints_each_stage_as_it_ends():
    script = SCRIPT.parent / "first_call_stages.py"
    result = subprocess.run([sys.executable, str(script), "--programs", "human_heart_dipole", "--orders", "rev"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device: ")
    for label in ("jax.jacrev", "jax.jacfwd", "jacve rev"):
        mine = [line.split(": ", 2)[2] for line in lines if line.startswith(f"human_heart_dipole: {label}: ")]
        assert [m.split()[0] for m in mine] == ["lowered", "compiled", "first"], mine
        assert float(mine[-1].rsplit(" ", 1)[1]) < 1e-4  # largest difference from jax.jacrev
    bad = subprocess.run([sys.executable, str(script), "--programs", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown program(s) nope" in bad.stderr
