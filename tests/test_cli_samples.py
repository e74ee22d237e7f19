"""Every bundled sample program through `show` (every format and annotation) and `typecheck`, with no specs."""

from __future__ import annotations

import json
import pathlib

import pytest
from click.testing import CliRunner

from jaxtool.cli import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
FUNCTION_NAMES = {"mlp": "mlp_loss", "branches": "piecewise", "scan_rnn": "rnn", "pytree_params": "loss"}
TARGETS = [f"sample_programs/{p.stem}.py:{FUNCTION_NAMES.get(p.stem, p.stem)}"
           for p in sorted((ROOT / "sample_programs").glob("*.py"))]


def invoke(*args):
    result = CliRunner().invoke(cli, ["--color", "never", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("target", TARGETS)
def test_show_and_typecheck_every_sample_without_specs(target, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = invoke("show", target, "--vertices", "--source")
    assert "v1" in text and ".py:" in text
    data = json.loads(invoke("show", target, "--format", "json"))
    assert data["jaxpr"]["eqns"] and data["inputs"] and data["outputs"]
    dot = invoke("show", target, "--format", "dot")
    assert dot.lstrip().startswith("digraph") and dot.rstrip().endswith("}")
    invoke("typecheck", target)
