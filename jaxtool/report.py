"""Jacobian blocks as output for ``jaxtool jac``: a summary table, small blocks in full, sparsity drawings, JSON.

A *block* is the Jacobian of one flat output leaf with respect to one flat differentiated input
leaf, laid out ``out.shape + in.shape`` as ``jax.jacrev`` lays it out. Printed values and drawings
show it as a matrix of ``prod(out.shape)`` rows and ``prod(in.shape)`` columns.

Only numpy and rich are needed here: blocks arrive as numpy arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rich.text import Text

from jaxtool.specs import format_spec

#: Blocks with at most this many elements are printed in full (and given in full in JSON).
SMALL_BLOCK = 64

#: Drawings up to this many rows and columns show one character per element ('█' non-zero, '·' zero).
SPY_FULL_ROWS, SPY_FULL_COLS = 32, 64

#: Larger drawings use braille characters (4 rows x 2 columns of dots each), at most this many characters.
SPY_BRAILLE_ROWS, SPY_BRAILLE_COLS = 16, 64

#: Dot bits of a braille character by (row, column) in its 4 x 2 cell (Unicode block U+2800).
_BRAILLE_BITS = np.array([[0x01, 0x08], [0x02, 0x10], [0x04, 0x20], [0x40, 0x80]])


def _printable(values: np.ndarray) -> np.ndarray:
    """``values``, with bfloat16 and the other ml_dtypes floats as float32 (which holds them exactly):
    numpy prints those without aligning columns."""
    return values.astype(np.float32) if values.dtype.kind == "V" else values


@dataclass(frozen=True)
class Block:
    """One block of the Jacobian: output leaf ``output`` with respect to input leaf ``input``."""

    output: str
    input: str
    out_shape: tuple
    in_shape: tuple
    values: np.ndarray  # out_shape + in_shape

    @property
    def matrix(self) -> np.ndarray:
        """The block as a 2-D matrix, ``(prod(out.shape), prod(in.shape))``."""
        return self.values.reshape(math.prod(self.out_shape), math.prod(self.in_shape))

    @property
    def nnz(self) -> int:
        """Number of non-zero entries (NaN counts as non-zero)."""
        return int(np.count_nonzero(self.values))

    @property
    def max_abs(self) -> float:
        """Largest absolute entry (NaN if any entry is NaN; 0 for an empty block)."""
        if self.values.size == 0:
            return 0.0
        values = self.values if np.iscomplexobj(self.values) else self.values.astype(np.float64)
        return float(np.max(np.abs(values)))


@dataclass(frozen=True)
class Comparison:
    """The Jacobian against one reference (``jax.jacrev`` or ``jax.jacfwd``).

    ``max_rel_error`` is the largest ``|J - R| / |R|`` over the entries where ``|R| > atol`` (below
    that the absolute tolerance governs, and round-off relative to a near-zero ``R`` says little). An entry
    passes when ``|J - R| <= atol + rtol * |R|`` (or both are the same non-finite value).
    ``unavailable`` says why the reference could not be computed (then the other fields are unset).
    """

    reference: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    passed: bool = False
    unavailable: str | None = None


@dataclass(frozen=True)
class Check:
    """The outcome of ``--check``: comparisons with both references, at tolerances ``rtol``/``atol``."""

    rtol: float
    atol: float
    comparisons: tuple  # tuple[Comparison, ...]
    skipped_outputs: tuple = ()  # names of outputs without a derivative (integer, boolean) not compared

    @property
    def passed(self) -> bool:
        """Every available reference agrees (and at least one was available)."""
        available = [c for c in self.comparisons if c.unavailable is None]
        return bool(available) and all(c.passed for c in available)


@dataclass(frozen=True)
class JacobianReport:
    """Everything ``jaxtool jac`` prints: the blocks, the elimination that produced them, a check."""

    order_name: str  # 'rev', 'fwd', 'markowitz', ... or 'custom'
    order: tuple  # the vertices eliminated, in turn
    mults: int
    adds: int
    blocks: tuple  # tuple[Block, ...], output-major
    check: Check | None = None
    opaque: tuple = ()  # (vertex, primitive name) differentiated by JAX's AD of the whole equation


# ----------------------------------------------------------------------------------------- text


def _spec(block: Block) -> str:
    return format_spec(block.values)


def _number(value: float) -> str:
    return f"{value:.4g}"


def render_text(report: JacobianReport, *, spy: bool = False) -> Text:
    """The report as styled text: table, small blocks in full, drawings (``spy``), order and cost, check."""
    out = Text()
    rows = [("output", "input", "block", "nnz", "max |value|")]
    rows += [(b.output, b.input, _spec(b), f"{b.nnz}/{b.values.size}", _number(b.max_abs)) for b in report.blocks]
    widths = [max(len(row[k]) for row in rows) for k in range(5)]
    for n, row in enumerate(rows):
        cells = [cell.ljust(w) if k < 3 else cell.rjust(w) for k, (cell, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip() + "\n", "bold" if n == 0 else "")

    previous_single = False  # runs of one-element blocks are printed one per line, without blank lines
    for block in report.blocks:
        size = block.values.size
        if 0 < size <= SMALL_BLOCK:
            out.append("" if size == 1 and previous_single else "\n")
            out.append(f"{block.output} w.r.t. {block.input}", "bold")
            if size == 1:
                value = np.array2string(_printable(block.values).reshape(()), precision=6)
                out.append(f"  {_spec(block)} = {value}\n")
            else:
                out.append(f"  {_spec(block)}\n")
                out.append(np.array2string(_printable(block.matrix), precision=6, max_line_width=160) + "\n")
        previous_single = size == 1

    if spy:
        for block in report.blocks:
            rows_, cols = block.matrix.shape
            out.append(f"\n{block.output} w.r.t. {block.input}", "bold")
            density = f", {100 * block.nnz / block.values.size:.3g}% non-zero" if block.values.size else ""
            out.append(f"  {rows_}x{cols}{density}{spy_scale(block.matrix.shape)}\n")
            out.append(spy_drawing(block.matrix) + "\n")

    out.append("\n")
    out.append("elimination order: ", "bold")
    count = len(report.order)
    out.append(f"{report.order_name} ({count} {'vertex' if count == 1 else 'vertices'})  "
               f"multiplications: {report.mults}  additions: {report.adds}\n")
    if report.opaque:
        listed = ", ".join(f"v{v} {name}" for v, name in report.opaque)
        out.append(f"opaque vertices: {listed} (partials from JAX's AD of the whole equation; counted as one "
                   "multiplication per result element per application)\n")
    if report.check is not None:
        _render_check(out, report.check)
    out.rstrip()
    return out


def _render_check(out: Text, check: Check) -> None:
    for c in check.comparisons:
        out.append(f"check vs {c.reference}: ", "bold")
        if c.unavailable is not None:
            out.append(f"unavailable ({c.unavailable})\n", "yellow")
            continue
        out.append(f"max abs error {c.max_abs_error:.3g}, max rel error {c.max_rel_error:.3g}  ")
        out.append("ok\n" if c.passed else "FAILED\n", "green" if c.passed else "bold red")
    if check.skipped_outputs:
        out.append(f"not compared (no derivative): {', '.join(check.skipped_outputs)}\n")
    verdict = "passed" if check.passed else "failed"
    out.append(f"check {verdict}", "bold green" if check.passed else "bold red")
    out.append(f" (rtol {check.rtol:g}, atol {check.atol:g})\n")


# ----------------------------------------------------------------------------------------- spy


def _pool(mask: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``mask`` reduced to ``rows x cols`` cells, a cell set when any entry it covers is set."""
    r_starts = (np.arange(rows) * mask.shape[0]) // rows
    c_starts = (np.arange(cols) * mask.shape[1]) // cols
    return np.logical_or.reduceat(np.logical_or.reduceat(mask, r_starts, axis=0), c_starts, axis=1)


def spy_scale(shape: tuple) -> str:
    """How many entries one drawn dot stands for, as a suffix for headings ('' when one per entry)."""
    rows, cols = shape
    if rows == 0 or cols == 0 or (rows <= SPY_FULL_ROWS and cols <= SPY_FULL_COLS):
        return ""
    dot_rows = math.ceil(rows / min(rows, 4 * SPY_BRAILLE_ROWS))
    dot_cols = math.ceil(cols / min(cols, 2 * SPY_BRAILLE_COLS))
    return f" (one dot per ~{dot_rows}x{dot_cols} entries)" if dot_rows * dot_cols > 1 else ""


def spy_drawing(matrix: np.ndarray) -> str:
    """The sparsity pattern of a 2-D ``matrix`` as lines of text.

    Up to :data:`SPY_FULL_ROWS` x :data:`SPY_FULL_COLS`: one character per entry, '█' for a
    non-zero (NaN included) and '·' for a zero. Larger: braille characters of 4 x 2 dots, a dot
    set when any entry it covers is non-zero, downsampled to at most
    :data:`SPY_BRAILLE_ROWS` x :data:`SPY_BRAILLE_COLS` characters.
    """
    rows, cols = matrix.shape
    if rows == 0 or cols == 0:
        return "(empty)"
    mask = matrix != 0
    if rows <= SPY_FULL_ROWS and cols <= SPY_FULL_COLS:
        return "\n".join("".join("█" if x else "·" for x in row) for row in mask)
    cells = _pool(mask, min(rows, 4 * SPY_BRAILLE_ROWS), min(cols, 2 * SPY_BRAILLE_COLS))
    padded = np.zeros((-(-cells.shape[0] // 4) * 4, -(-cells.shape[1] // 2) * 2), dtype=bool)
    padded[:cells.shape[0], :cells.shape[1]] = cells
    blocks = padded.reshape(padded.shape[0] // 4, 4, padded.shape[1] // 2, 2)
    codes = np.einsum("rkcl,kl->rc", blocks.astype(np.int64), _BRAILLE_BITS)
    return "\n".join("".join(chr(0x2800 + int(code)) for code in row) for row in codes)


# ----------------------------------------------------------------------------------------- JSON


def _json_number(value, dtype=np.dtype(np.float64)):
    """A JSON-safe number: ``None`` for NaN and infinities (JSON has none).

    A value of a dtype narrower than float64 is written with the fewest digits that read back
    to the same value of that dtype (``0.1`` rather than ``0.10000000149011612`` for float32).
    """
    value = float(value)
    if not math.isfinite(value):
        return None
    if dtype.kind in "fV" and dtype.itemsize < 8:
        return float(str(dtype.type(value)))
    return value


def _json_values(values: np.ndarray):
    """A block's entries as nested lists (its ``out.shape + in.shape``); non-finite entries as ``None``;
    complex entries as ``[real, imaginary]`` pairs."""
    if values.dtype.kind in "biu":
        return values.tolist()
    if np.iscomplexobj(values):
        return _json_values(np.stack([values.real, values.imag], axis=-1))
    flat = [_json_number(x, values.dtype) for x in values.astype(np.float64).ravel()]
    return np.array(flat, dtype=object).reshape(values.shape).tolist()


def to_json(report: JacobianReport) -> dict:
    """The report as a JSON-ready dict (non-finite numbers become ``null``)."""
    result = {
        "order": report.order_name,
        "vertices": list(report.order),
        "mults": report.mults,
        "adds": report.adds,
        "opaque_vertices": [{"vertex": v, "primitive": name} for v, name in report.opaque],
        "blocks": [],
    }
    for b in report.blocks:
        entry = {"output": b.output, "input": b.input, "shape": list(b.values.shape),
                 "dtype": str(b.values.dtype), "nnz": b.nnz, "max_abs": _json_number(b.max_abs, b.values.dtype)}
        if 0 < b.values.size <= SMALL_BLOCK:
            entry["values"] = _json_values(b.values)
        result["blocks"].append(entry)
    if report.check is not None:
        c = report.check
        result["check"] = {
            "passed": c.passed, "rtol": c.rtol, "atol": c.atol,
            "not_compared": list(c.skipped_outputs),
            **{comp.reference.removeprefix("jax."): (
                {"unavailable": comp.unavailable} if comp.unavailable is not None else
                {"max_abs_error": _json_number(comp.max_abs_error),
                 "max_rel_error": _json_number(comp.max_rel_error), "passed": comp.passed})
               for comp in c.comparisons},
        }
    return result
