"""The README's examples run and print what the README says they print.

Fenced blocks of README.md, by info string:

* ``console``: lines ``$ jaxtool ARGS`` (optionally ending ``  # exit N``) are commands, the
  lines after each are its output. Each command runs in-process through
  :func:`jaxtool.cli.main`; its exit status must be N (0 when not given) and every shown
  output line must be a line of its real stdout or stderr (trailing spaces ignored). A line
  ``...`` marks a trim and is skipped; ``...`` inside a line matches any text (used for
  floating-point noise); lines with timings are skipped.
* ``python`` whose first line is ``# NAME.py...``: a file the examples use, written as NAME.py.
* other ``python``: executed with :func:`exec`; it must not raise.

Everything runs in a scratch copy of the repository root (``sample_programs/`` plus the files
above), in document order, so ``--source`` paths read as in the README.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\S*)\s*$")
_EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")
_FILE_HEADER = re.compile(r"^#\s*([A-Za-z_]\w*\.py)\b")
_TIMING = re.compile(r"\b\d+(\.\d+)?\s?(ns|us|µs|ms)\b")


@dataclass
class Block:
    info: str
    line: int  # 1-based line of the opening fence
    lines: list


@dataclass
class Command:
    argv: list
    exit_code: int
    expected: list
    line: int

    @property
    def id(self) -> str:
        return f"L{self.line}:" + " ".join(self.argv[:2])


def _blocks(text: str) -> list:
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if current is None and match:
            current = Block(match.group(1), number, [])
        elif current is not None and line.strip() == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    assert current is None, f"README.md: code block opened at line {current.line} is not closed"
    return blocks


def _commands(block: Block) -> list:
    commands = []
    for offset, line in enumerate(block.lines):
        if line.startswith("$ "):
            text = line[2:]
            match = _EXIT.search(text)
            code = int(match.group(1)) if match else 0
            argv = shlex.split(text[:match.start()] if match else text)
            assert argv[0] == "jaxtool", f"README.md:{block.line + 1 + offset}: console commands must run jaxtool"
            commands.append(Command(argv[1:], code, [], block.line + 1 + offset))
        else:
            assert commands, f"README.md:{block.line + 1 + offset}: output before any `$ jaxtool` command"
            commands[-1].expected.append(line)
    return commands


BLOCKS = _blocks(README.read_text(encoding="utf-8"))
FILES = [b for b in BLOCKS if b.info == "python" and b.lines and _FILE_HEADER.match(b.lines[0])]
SNIPPETS = [b for b in BLOCKS if b.info == "python" and b not in FILES]
COMMANDS = [c for b in BLOCKS if b.info == "console" for c in _commands(b)]


@contextlib.contextmanager
def _isolated(workspace: Path):
    """Run in ``workspace``, then restore the working directory, sys.path, the modules loaded from
    ``workspace``, the environment variables and the JAX settings jaxtool changes."""
    import jax

    saved_cwd, saved_path, saved_env = os.getcwd(), list(sys.path), dict(os.environ)
    saved_x64, saved_device = jax.config.jax_enable_x64, jax.config.jax_default_device
    os.chdir(workspace)
    os.environ["NO_COLOR"] = "1"
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update({k: v for k, v in saved_env.items() if os.environ.get(k) != v})
        jax.config.update("jax_enable_x64", saved_x64)
        jax.config.update("jax_default_device", saved_device)
        prefix = str(workspace)
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(prefix):
                del sys.modules[name]


def _run(argv: list) -> tuple:
    """``(exit status, stdout, stderr)`` of ``jaxtool ARGV``, in-process."""
    from jaxtool.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def _matches(expected: str, actual_lines: set) -> bool:
    if expected in actual_lines:
        return True
    if "..." not in expected:
        return False
    pattern = re.compile(".*".join(re.escape(part) for part in expected.split("...")))
    return any(pattern.fullmatch(line) for line in actual_lines)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A scratch repository root: sample_programs/, the README's files, and the effects of its
    Python snippets (run once, in document order; their errors are kept for the snippet tests)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "sample_programs", root / "sample_programs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for block in FILES:
        name = _FILE_HEADER.match(block.lines[0]).group(1)
        (root / name).write_text("\n".join(block.lines) + "\n", encoding="utf-8")
    errors = {}
    for block in SNIPPETS:
        with _isolated(root), contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile("\n".join(block.lines), f"README.md:{block.line + 1}", "exec"), {"__name__": "__readme__"})
            except Exception as exc:  # reported by test_python_snippet
                errors[block.line] = exc
    return root, errors


def test_readme_has_examples():
    assert FILES and SNIPPETS and COMMANDS
    assert len(COMMANDS) <= 20, "keep the README's executed examples few: the suite must stay fast"
    for block in BLOCKS:
        if block.info == "console":
            assert block.lines and block.lines[0].startswith("$ jaxtool"), \
                f"README.md:{block.line}: a console block must start with a `$ jaxtool` command"


@pytest.mark.parametrize("block", SNIPPETS, ids=[f"L{b.line}" for b in SNIPPETS])
def test_python_snippet(workspace, block):
    _, errors = workspace
    error = errors.get(block.line)
    if error is not None:
        raise AssertionError(f"README.md:{block.line}: the python block raised {type(error).__name__}: {error}") \
            from error


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_console_example(workspace, command):
    root, _ = workspace
    with _isolated(root):
        code, out, err = _run(command.argv)
    actual = {line.rstrip() for line in (out + err).splitlines()}
    shown = f"$ jaxtool {shlex.join(command.argv)}\n--- stdout ---\n{out}--- stderr ---\n{err}"
    assert code == command.exit_code, f"README.md:{command.line}: exit {code}, README says {command.exit_code}\n{shown}"
    missing = [line for line in (e.rstrip() for e in command.expected)
               if line and line.strip() != "..." and not _TIMING.search(line) and not _matches(line, actual)]
    assert not missing, f"README.md:{command.line}: lines not in the real output:\n" + "\n".join(missing) + "\n" + shown
