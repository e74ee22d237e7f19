"""Typecheck jaxprs and report problems as ``file:line:col: CODE message``.

:func:`check_jaxpr` runs JAX's own checker (``jax.extend.core.check_jaxpr``) and then a pass of
its own over the jaxpr and every jaxpr nested in an equation's params. That pass never raises on
a malformed jaxpr: whatever it finds becomes a :class:`Problem`. :func:`check_annotations`
compares a function's traced input and output types with its shape annotations (spec strings
such as ``"f32[n,4]"`` or jaxtyping annotations such as ``Float[Array, "batch dim"]``).

Problem codes:

| code  | severity | meaning                                                                        |
|-------|----------|--------------------------------------------------------------------------------|
| JT001 | error    | ``jax.extend.core.check_jaxpr`` rejected the jaxpr (its first line is shown)   |
| JT002 | error    | an operand is undefined: used before its definition, from another jaxpr, a     |
|       |          | dropped ``_`` variable, or not a variable or literal at all                    |
| JT003 | error    | a variable is bound twice (as an input, constant or equation result)           |
| JT004 | error    | a jaxpr output is not defined by an input, constant or earlier equation        |
| JT005 | error    | an equation's declared result types differ from the primitive's abstract       |
|       |          | evaluation of its operand types                                                |
| JT006 | error    | a literal's or a closed jaxpr's constant's value does not match its declared   |
|       |          | type (dtype or shape)                                                          |
| JT007 | error    | a nested call does not fit its jaxpr: operand/result counts or types of        |
|       |          | ``jit``, ``cond`` branches, ``while`` cond/body, ``scan`` body, custom_jvp/vjp |
| JT008 | error    | a primitive's abstract evaluation failed on the equation's operand types       |
| JT009 | error    | malformed structure: not a jaxpr, not an equation, not a primitive, a binder   |
|       |          | or result that is not a variable, an equation that cannot be checked at all    |
| JT101 | error    | a traced input or output does not match its shape/dtype annotation             |
| JT102 | error    | a named dimension is bound to different sizes across arguments and outputs     |
| W201  | warning  | a silent down-cast: ``convert_element_type`` to a narrower floating type       |
| W202  | warning  | a float64/complex128 value appears although x64 was not requested              |
| W203  | warning  | a host callback: ``pure_callback``, ``io_callback``, ``debug_callback`` or     |
|       |          | ``debug_print`` (``jax.debug.print``)                                          |

Warnings count as errors with ``strict=True``.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import primitives as prims

from jaxtool import source
from jaxtool._compat import scan_layout
from jaxtool.specs import format_spec, is_jaxtyping, short_dtype

HOST_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "debug_print"})
"""Primitives that call back into Python on the host (W203)."""

# Call-like primitives whose whole operand list is passed to one nested jaxpr (``jaxpr`` or
# ``call_jaxpr`` param) and whose results are that jaxpr's results.
_CALLS = frozenset(p.name for p in (prims.jit_p, prims.closed_call_p, prims.call_p, prims.remat_p,
                                    prims.custom_jvp_call_p, prims.custom_vjp_call_p))

#: Primitives whose body runs per device (jax.extend.core.primitives exports neither). Their body's
#: collectives are typed against a mesh and axis environment that only JAX's own checker sets up, so
#: jaxtool leaves the types of their equations to it (JT001) and checks the rest of the body.
_MAPPED = frozenset({"shard_map", "xla_pmap"})


@dataclass(frozen=True)
class Problem:
    """One finding. ``file``/``line`` are the user's source when known; ``where`` is the
    position in the jaxpr (``<jaxpr>:eqn 3/branches[1]:eqn 0``), used when they are not."""

    code: str
    message: str
    where: str = "<jaxpr>"
    file: str | None = None
    line: int | None = None
    col: int = 1
    primitive: str | None = None
    equation: str | None = None

    @property
    def is_warning(self) -> bool:
        return self.code.startswith("W")

    def severity(self, strict: bool = False) -> str:
        """``"error"`` or ``"warning"``; with ``strict`` every problem is an error."""
        return "warning" if self.is_warning and not strict else "error"

    @property
    def location(self) -> str:
        """``file:line:col`` where the source is known, else :attr:`where`."""
        if self.file is not None and self.line is not None:
            return f"{self.file}:{self.line}:{self.col}"
        return self.where

    def to_dict(self, strict: bool = False) -> dict:
        return {"code": self.code, "severity": self.severity(strict), "message": self.message,
                "file": self.file, "line": self.line, "col": self.col if self.line is not None else None,
                "primitive": self.primitive,
                "equation": self.equation, "where": self.where}


@dataclass
class Report:
    """The problems found in one jaxpr and how many equations (nested ones included) it has."""

    problems: list[Problem] = field(default_factory=list)
    n_equations: int = 0

    def counts(self, strict: bool = False) -> tuple[int, int]:
        """``(errors, warnings)`` under the given strictness."""
        errors = sum(p.severity(strict) == "error" for p in self.problems)
        return errors, len(self.problems) - errors


# --------------------------------------------------------------------------------------------
# Small helpers that never raise.

def _fmt(aval) -> str:
    """``f32[3,4]`` for an array type, ``repr`` for anything else."""
    try:
        return aval.str_short(short_dtypes=True)
    except Exception:
        return repr(aval)


def _fmt_all(avals: Iterable) -> str:
    return "(" + ", ".join(_fmt(a) for a in avals) + ")"


def _same_type(a, b) -> bool:
    """Whether two abstract values have the same type, ignoring weak typing and sharding."""
    if a is None or b is None or type(a) is not type(b):
        return False
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        try:
            return tuple(a.shape) == tuple(b.shape) and bool(a.dtype == b.dtype)
        except Exception:  # exotic dtypes that refuse comparison
            return False
    return True


#: a terminal colour code: JAX's printer colours types where stdout is a terminal, also in messages
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(obj) -> str:
    """``str(obj)`` without JAX's terminal colour codes (a report is data, coloured or not by jaxtool)."""
    return _ANSI.sub("", str(obj))


def _show(eqn) -> str:
    try:
        return _plain(eqn)
    except Exception as exc:  # printing a malformed equation can fail anywhere inside JAX
        return f"<unprintable equation: {type(exc).__name__}: {exc}>"


def _first_line(exc: BaseException) -> str:
    text = _plain(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _prim_name(eqn) -> str:
    return str(getattr(getattr(eqn, "primitive", None), "name", None) or "<no primitive>")


def _locate(source_info) -> tuple[str, int, int] | None:
    """The user's ``(file, line, col)`` for an equation's source info, or ``None``.

    JAX's public traceback frames carry no column, so ``col`` is 1.
    """
    frame = source.user_frame(source_info)
    return (source.display_path(frame.file_name), frame.line_num, 1) if frame else None


def _is_jaxpr(obj) -> bool:
    return isinstance(obj, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _open(obj) -> jcore.Jaxpr:
    return obj.jaxpr if isinstance(obj, jcore.ClosedJaxpr) else obj


def _nested(params) -> Iterator[tuple[str, object]]:
    """``(label, value)`` for each jaxpr-valued param (tuples labelled ``key[i]``)."""
    if not isinstance(params, Mapping):
        return
    for key, value in params.items():
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                if _is_jaxpr(item):
                    yield f"{key}[{i}]", item
        elif _is_jaxpr(value):
            yield str(key), value


def _literal_problem(literal) -> str | None:
    """Why a literal's value does not match its declared type, or ``None`` when it does."""
    return _value_problem(literal.val, getattr(literal, "aval", None), "literal")


def _value_problem(value, aval, kind: str) -> str | None:
    """Why a ``kind`` (literal, constant) value does not match its declared type ``aval``, or ``None``."""
    if not (hasattr(aval, "shape") and hasattr(aval, "dtype")):
        return f"{kind} {value!r} has no array type ({aval!r})"
    try:
        dtype = np.dtype(aval.dtype)
    except TypeError:  # an extended dtype (PRNG keys): nothing to compare with
        return None
    if not hasattr(value, "dtype") and isinstance(value, (bool, int, float, complex)):
        # a plain Python scalar: check its kind only (bool is an int, so test it first)
        kinds = next(k for t, k in ((bool, "b"), (int, "iufc"), (float, "fc"), (complex, "c"))
                     if isinstance(value, t))
        if aval.shape != () or dtype.kind not in kinds:
            return f"{kind} {value!r} ({type(value).__name__}) does not match its type {_fmt(aval)}"
        return None
    shape, vdtype = np.shape(value), getattr(value, "dtype", None)
    if tuple(shape) != tuple(aval.shape) or vdtype is None or not _same_dtype(vdtype, dtype):
        got = ShapedArray(tuple(shape), vdtype) if vdtype is not None else type(value).__name__
        return f"{kind} value {_fmt(got)} does not match its declared type {_fmt(aval)}"
    return None


def _same_dtype(a, b) -> bool:
    try:
        return np.dtype(a) == np.dtype(b)
    except TypeError:  # an extended dtype (a PRNG key's) where a NumPy one is declared
        return False


def _is_wide(aval) -> bool:
    """Whether an abstract value is float64 or complex128."""
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and np.dtype(dtype) in (np.dtype(np.float64), np.dtype(np.complex128))
    except TypeError:
        return False


def _downcast(src, dst) -> str | None:
    """Why converting ``src`` to ``dst`` silently loses floating-point precision, or ``None``."""
    try:
        if not (jnp.issubdtype(src, jnp.inexact) and jnp.issubdtype(dst, jnp.inexact)):
            return None
        if jnp.issubdtype(src, jnp.complexfloating) and not jnp.issubdtype(dst, jnp.complexfloating):
            return "drops the imaginary part"
        if jnp.finfo(dst).bits < jnp.finfo(src).bits:
            return "narrows the floating-point type"
    except (TypeError, ValueError):
        return None
    return None


# --------------------------------------------------------------------------------------------
# The checker.

class _Checker:
    """Walks a jaxpr and its nested jaxprs, collecting problems."""

    def __init__(self, *, warn_float64: bool):
        self.warn_float64 = warn_float64
        self.report = Report()
        self.mapped_depth = 0  # how many _MAPPED bodies enclose the equations being checked

    def add(self, code: str, message: str, where: str, loc=None, eqn=None) -> None:
        file, line, col = loc if loc else (None, None, 1)
        self.report.problems.append(Problem(
            code=code, message=message, where=where, file=file, line=line, col=col,
            primitive=_prim_name(eqn) if eqn is not None else None,
            equation=_show(eqn) if eqn is not None else None))

    # -- jaxprs -------------------------------------------------------------------------------

    def jaxpr(self, jaxpr, where: str, loc=None, parent=None) -> None:
        """Check one jaxpr (a closed one's constant values too); a nested one's problems without an
        equation of their own are reported at the enclosing equation ``parent`` and its location ``loc``."""
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            self.consts(jaxpr, where, loc, parent)
            jaxpr = jaxpr.jaxpr
        bound: dict[int, str] = {}  # id(var) -> what binds it
        binders = [("constvar", v) for v in jaxpr.constvars] + [("input", v) for v in jaxpr.invars]
        later = self._binders_by_eqn(jaxpr)
        for i, (kind, var) in enumerate(binders):
            what = f"{kind} {i if kind == 'constvar' else i - len(jaxpr.constvars)}"
            if not isinstance(var, jcore.Var):
                self.add("JT009", f"{what} is not a variable ({type(var).__name__})", where, loc, parent)
            elif isinstance(var, jcore.DropVar):
                continue
            elif id(var) in bound:
                self.add("JT003", f"{what} ({_fmt(var.aval)}) rebinds the variable of {bound[id(var)]}",
                         where, loc, parent)
            else:
                bound[id(var)] = what
        for i, eqn in enumerate(jaxpr.eqns):
            try:
                self.equation(eqn, f"{where}:eqn {i}", bound, later, i, loc)
            except Exception as exc:  # malformed in a way no check above anticipates: report, go on
                self.add("JT009", f"could not check this equation: {_first_line(exc)}", f"{where}:eqn {i}",
                         loc, eqn if isinstance(eqn, jcore.JaxprEqn) else None)
        for k, atom in enumerate(jaxpr.outvars):
            if isinstance(atom, jcore.Literal):
                why = _literal_problem(atom)
                if why:
                    self.add("JT006", f"output {k}: {why}", where, loc, parent)
            elif isinstance(atom, jcore.DropVar):
                self.add("JT004", f"output {k} is a dropped variable `_`", where, loc, parent)
            elif not isinstance(atom, jcore.Var):
                self.add("JT004", f"output {k} is not a variable or literal ({type(atom).__name__})",
                         where, loc, parent)
            elif id(atom) not in bound:
                self.add("JT004", f"output {k} ({_fmt(atom.aval)}) is not defined by any input, "
                                  "constvar or equation of this jaxpr", where, loc, parent)

    def consts(self, closed: jcore.ClosedJaxpr, where: str, loc=None, parent=None) -> None:
        """A closed jaxpr's constant values against its constvars (evaluating it would fail, or
        compute with values of other types)."""
        # (as many values as constvars: ClosedJaxpr asserts that)
        for i, (var, value) in enumerate(zip(closed.jaxpr.constvars, closed.consts)):
            why = _value_problem(value, getattr(var, "aval", None), "constant")
            if why:
                self.add("JT006", f"constvar {i}: {why}", where, loc, parent)

    @staticmethod
    def _binders_by_eqn(jaxpr) -> dict[int, int]:
        """id(var) -> index of the (first) equation binding it."""
        out: dict[int, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            outvars = getattr(eqn, "outvars", ())
            for var in outvars if isinstance(outvars, (list, tuple)) else ():
                out.setdefault(id(var), i)
        return out

    # -- equations ----------------------------------------------------------------------------

    def equation(self, eqn, where: str, bound: dict[int, str], later: dict[int, int], index: int,
                 parent_loc) -> None:
        if not isinstance(eqn, jcore.JaxprEqn):
            self.add("JT009", f"not a jaxpr equation: {type(eqn).__name__}", where, parent_loc)
            return
        self.report.n_equations += 1
        loc = _locate(eqn.source_info) or parent_loc
        name = _prim_name(eqn)
        in_avals = self.operands(eqn, where, bound, later, index, loc)
        out_avals = self.results(eqn, where, loc)
        if not isinstance(eqn.primitive, jcore.Primitive):
            self.add("JT009", f"the equation's primitive is not a JAX Primitive ({type(eqn.primitive).__name__})",
                     where, loc, eqn)
        elif in_avals is not None and out_avals is not None:
            if not self.calls(eqn, in_avals, out_avals, where, loc) and not self.mapped_depth:
                self.abstract_eval(eqn, in_avals, out_avals, where, loc)
            self.warnings(eqn, name, in_avals, out_avals, where, loc)
        mapped = name in _MAPPED
        self.mapped_depth += mapped
        try:
            for label, sub in _nested(eqn.params):
                self.jaxpr(sub, f"{where}/{label}", loc, eqn)
        finally:
            self.mapped_depth -= mapped
        for k, var in enumerate(eqn.outvars):
            if not isinstance(var, jcore.Var) or isinstance(var, jcore.DropVar):
                continue
            if id(var) in bound:
                self.add("JT003", f"result {k} ({_fmt(var.aval)}) of `{name}` rebinds the variable of "
                                  f"{bound[id(var)]}", where, loc, eqn)
            else:
                bound[id(var)] = f"eqn {index} (`{name}`)"

    def operands(self, eqn, where, bound, later, index, loc) -> list | None:
        """The operands' types, or ``None`` when some operand is unusable (reported)."""
        avals, ok = [], True
        for k, atom in enumerate(eqn.invars):
            if isinstance(atom, jcore.Literal):
                why = _literal_problem(atom)
                if why:
                    self.add("JT006", f"operand {k} of `{_prim_name(eqn)}`: {why}", where, loc, eqn)
            elif isinstance(atom, jcore.DropVar):
                self.add("JT002", f"operand {k} of `{_prim_name(eqn)}` is a dropped variable `_`",
                         where, loc, eqn)
                ok = False
            elif not isinstance(atom, jcore.Var):
                self.add("JT002", f"operand {k} of `{_prim_name(eqn)}` is not a variable or literal "
                                  f"({type(atom).__name__})", where, loc, eqn)
                ok = False
                continue
            elif id(atom) not in bound:
                j = later.get(id(atom))
                how = (f"is used before its definition by eqn {j}" if j is not None and j >= index
                       else "is not defined in this jaxpr (a variable from another jaxpr?)")
                self.add("JT002", f"operand {k} ({_fmt(atom.aval)}) of `{_prim_name(eqn)}` {how}",
                         where, loc, eqn)
            avals.append(getattr(atom, "aval", None))
        return avals if ok else None

    def results(self, eqn, where, loc) -> list | None:
        avals = []
        for k, var in enumerate(eqn.outvars):
            if not isinstance(var, jcore.Var):
                self.add("JT009", f"result {k} of `{_prim_name(eqn)}` is not a variable "
                                  f"({type(var).__name__})", where, loc, eqn)
                return None
            avals.append(var.aval)
        return avals

    def abstract_eval(self, eqn, in_avals, out_avals, where, loc) -> None:
        """Compare declared result types with ``primitive.abstract_eval`` (JT005, JT008)."""
        prim, name = eqn.primitive, _prim_name(eqn)
        try:
            out = prim.abstract_eval(*in_avals, **eqn.params)
        except NotImplementedError as exc:
            if name not in _CALLS | _MAPPED:  # calls are checked against their jaxpr instead
                self.add("JT008", f"cannot infer the result types of `{name}`: {_first_line(exc)}",
                         where, loc, eqn)
            return
        except Exception as exc:
            self.add("JT008", f"abstract evaluation of `{name}` on {_fmt_all(in_avals)} failed: "
                              f"{_first_line(exc)}", where, loc, eqn)
            return
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
            out = out[0]  # (avals, effects)
        expected = list(out) if getattr(prim, "multiple_results", False) else [out]
        if len(expected) != len(out_avals):
            self.add("JT005", f"`{name}` declares {len(out_avals)} result(s) but produces "
                              f"{len(expected)}: {_fmt_all(expected)}", where, loc, eqn)
            return
        for k, (want, got) in enumerate(zip(expected, out_avals)):
            if not _same_type(want, got):
                self.add("JT005", f"result {k} of `{name}` is declared {_fmt(got)} but `{name}` of "
                                  f"{_fmt_all(in_avals)} gives {_fmt(want)}", where, loc, eqn)

    # -- nested calls -------------------------------------------------------------------------

    def calls(self, eqn, in_avals, out_avals, where, loc) -> bool:
        """Check a call-like equation's operands and results against its nested jaxprs (JT007).

        Returns whether a problem was found (then abstract evaluation is skipped: it would
        repeat the same complaint or fail on the malformed call).
        """
        name, params = _prim_name(eqn), eqn.params
        before = len(self.report.problems)

        def fit(sub, args, results, what):
            self.fit(sub, args, results, what, where, loc, eqn)

        try:
            if name in _CALLS:
                key = "jaxpr" if "jaxpr" in params else "call_jaxpr"
                if key in params:
                    fit(params[key], in_avals, out_avals, f"`{name}` {key}")
            elif name == prims.cond_p.name:
                self.cond(eqn, in_avals, out_avals, fit, where, loc)
            elif name == prims.while_p.name:
                self.while_loop(eqn, in_avals, out_avals, fit, where, loc)
            elif name == prims.scan_p.name:
                self.scan(eqn, in_avals, out_avals, fit, where, loc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.add("JT007", f"malformed `{name}` params: {_first_line(exc)}", where, loc, eqn)
        return len(self.report.problems) > before

    def cond(self, eqn, in_avals, out_avals, fit, where, loc) -> None:
        if not in_avals:
            self.add("JT007", "`cond` has no index operand", where, loc, eqn)
            return
        index = in_avals[0]
        if not (getattr(index, "shape", None) == () and
                jnp.issubdtype(getattr(index, "dtype", np.float32), jnp.integer)):
            self.add("JT007", f"`cond` index operand is {_fmt(index)}, expected an integer scalar",
                     where, loc, eqn)
        for b, branch in enumerate(eqn.params["branches"]):
            fit(branch, in_avals[1:], out_avals, f"`cond` branch {b}")

    def while_loop(self, eqn, in_avals, out_avals, fit, where, loc) -> None:
        params = eqn.params
        cn, bn = int(params["cond_nconsts"]), int(params["body_nconsts"])
        carry = in_avals[cn + bn:]
        fit(params["cond_jaxpr"], in_avals[:cn] + carry, None, "`while` cond_jaxpr")
        fit(params["body_jaxpr"], in_avals[cn:cn + bn] + carry, carry, "`while` body_jaxpr")
        self.match(carry, out_avals, "`while`", "carry input", "equation result", where, loc, eqn)
        if _is_jaxpr(params["cond_jaxpr"]):
            # one boolean; vmap may batch it (bool[n]), which the lowering reduces with `any`
            preds = [getattr(v, "aval", None) for v in _open(params["cond_jaxpr"]).outvars]
            if len(preds) != 1 or getattr(preds[0], "dtype", None) != np.dtype(np.bool_):
                self.add("JT007", f"`while` cond_jaxpr returns {_fmt_all(preds)}, expected one boolean",
                         where, loc, eqn)

    def scan(self, eqn, in_avals, out_avals, fit, where, loc) -> None:
        params = eqn.params
        (nconsts, ncarry), length = scan_layout(params), int(params["length"])
        consts, init, xs = in_avals[:nconsts], in_avals[nconsts:nconsts + ncarry], in_avals[nconsts + ncarry:]
        slices = []
        for k, x in enumerate(xs):
            shape = tuple(getattr(x, "shape", ()))
            if not shape or shape[0] != length:
                self.add("JT007", f"`scan` xs operand {k} is {_fmt(x)}, expected a leading axis of "
                                  f"length {length}", where, loc, eqn)
                return
            slices.append(ShapedArray(shape[1:], x.dtype))
        body = params["jaxpr"]
        if not _is_jaxpr(body):
            fit(body, [], [], "`scan` body")
            return
        jaxpr = _open(body)
        self.match(consts + init + slices, [getattr(v, "aval", None) for v in jaxpr.invars],
                   "`scan` body", "operand", "body input", where, loc, eqn)
        gives = [getattr(v, "aval", None) for v in jaxpr.outvars]
        if len(gives) < ncarry:
            self.add("JT007", f"`scan` body returns {len(gives)} result(s), fewer than its {ncarry} carry value(s)",
                     where, loc, eqn)
            return
        self.match(init, gives[:ncarry], "`scan` body", "carry input", "carry output", where, loc, eqn)
        ys = [ShapedArray((length, *a.shape), a.dtype) if hasattr(a, "shape") else a for a in gives[ncarry:]]
        self.match(init + ys, out_avals, "`scan`", "carry/stacked output", "equation result",
                   where, loc, eqn)

    def fit(self, sub, args, results, what, where, loc, eqn) -> None:
        """Check that jaxpr ``sub`` takes ``args`` and returns ``results`` (unchecked when ``None``)."""
        if not _is_jaxpr(sub):
            self.add("JT007", f"{what} is not a jaxpr ({type(sub).__name__})", where, loc, eqn)
            return
        jaxpr = _open(sub)
        self.match(args, [getattr(v, "aval", None) for v in jaxpr.invars], what, "operand",
                   "jaxpr input", where, loc, eqn)
        if results is not None:
            self.match(results, [getattr(v, "aval", None) for v in jaxpr.outvars], what, "equation result",
                       "jaxpr result", where, loc, eqn)

    def match(self, expected, actual, what, left, right, where, loc, eqn) -> None:
        """Report a count mismatch or each pairwise type mismatch (JT007)."""
        if len(expected) != len(actual):
            self.add("JT007", f"{what}: {len(expected)} {left}(s) {_fmt_all(expected)} but "
                              f"{len(actual)} {right}(s) {_fmt_all(actual)}", where, loc, eqn)
            return
        for k, (a, b) in enumerate(zip(expected, actual)):
            if not _same_type(a, b):
                self.add("JT007", f"{what}: {left} {k} is {_fmt(a)} but {right} {k} is {_fmt(b)}",
                         where, loc, eqn)

    # -- warnings -----------------------------------------------------------------------------

    def warnings(self, eqn, name, in_avals, out_avals, where, loc) -> None:
        if name == prims.convert_element_type_p.name and in_avals and "new_dtype" in eqn.params:
            src, dst = getattr(in_avals[0], "dtype", None), eqn.params["new_dtype"]
            why = _downcast(src, dst) if src is not None else None
            if why:
                self.add("W201", f"silent down-cast {_fmt(in_avals[0])} -> {short_dtype(dst)} {why}",
                         where, loc, eqn)
        if name in HOST_CALLBACKS:
            callback = eqn.params.get("callback")
            func = getattr(callback, "callback_func", callback)
            label = getattr(func, "__qualname__", None)
            self.add("W203", f"host callback `{name}`" + (f" to {label}" if label else "") +
                     " leaves the compiled program and runs Python on the host", where, loc, eqn)
        if self.warn_float64 and any(map(_is_wide, out_avals)) and not any(map(_is_wide, in_avals)):
            wide = next(a for a in out_avals if _is_wide(a))
            self.add("W202", f"`{name}` introduces a {_fmt(wide)} value although x64 was not requested",
                     where, loc, eqn)


def _check_jaxpr_failure(jaxpr) -> Problem | None:
    """Run ``jax.extend.core.check_jaxpr``; its complaint (if any) as a JT001 problem."""
    try:
        jcore.check_jaxpr(jaxpr)
    except Exception as exc:  # it raises TypeError/AttributeError too on malformed jaxprs
        text = _plain(exc)
        head = text.strip().splitlines()[0] if text.strip() else ""
        message = head if isinstance(exc, jcore.JaxprTypeError) else \
            f"crashed with {type(exc).__name__}" + (f": {head}" if head else "")
        found = re.search(r"from source: (.+?):(\d+)(?::\d+)?(?: \(|$)", text, re.M)
        shown = re.search(r"in equation:\n\n(.*?)\n\n(?:from source|while checking)", text, re.S)
        return Problem("JT001", f"check_jaxpr: {message}",
                       file=source.display_path(found.group(1)) if found else None,
                       line=int(found.group(2)) if found else None,
                       equation=shown.group(1) if shown else None)
    return None


def check_jaxpr(jaxpr, *, warn_float64: bool = False) -> Report:
    """Typecheck a ``ClosedJaxpr`` or ``Jaxpr`` (JT001-JT009, W201-W203).

    ``warn_float64`` enables W202 (pass ``True`` when the user did not ask for x64).
    Never raises on a malformed jaxpr; a non-jaxpr argument is reported as JT009.
    """
    checker = _Checker(warn_float64=warn_float64)
    if not _is_jaxpr(jaxpr):
        checker.add("JT009", f"not a jaxpr: {type(jaxpr).__name__}", "<jaxpr>")
        return checker.report
    failure = _check_jaxpr_failure(_open(jaxpr))
    if failure:
        checker.report.problems.append(failure)
    top = _open(jaxpr)
    wide = [v for v in [*top.constvars, *top.invars] if _is_wide(getattr(v, "aval", None))]
    if warn_float64 and wide:
        checker.add("W202", f"{len(wide)} input(s) or constant(s) are float64/complex128 although x64 was "
                            "not requested (does the program enable jax_enable_x64 itself?)", "<jaxpr>")
    checker.jaxpr(jaxpr, "<jaxpr>")
    return checker.report


# --------------------------------------------------------------------------------------------
# Annotations.

_DTYPE = re.compile(r"^(bool|(bf|f|u|i|c)[0-9][a-z0-9_]*)$")
_SPEC = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*\[(.*)\]\s*$")
_DIM = re.compile(r"^(?:\d+|\.\.\.|[*#]?[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True)
class Annotation:
    """A parsed shape annotation: allowed dtype names, long or short (``None``: any), and dims.

    A dim is an ``int``, a name (bound consistently), ``"_"`` (any size), ``"..."`` (any number
    of dims), ``"*name"`` (any number of dims, bound consistently) or ``"=expr"`` (jaxtyping's
    symbolic size, such as ``n+1``: checked once its names are bound).
    """

    text: str
    dtypes: frozenset[str] | None
    dims: tuple[int | str, ...] | None


def parse_annotation(annotation) -> Annotation | None:
    """Parse a spec string (``"f32[n,4]"``), a ``jax.ShapeDtypeStruct`` or a jaxtyping annotation.

    Returns ``None`` for anything else (other strings, pytrees of specs, ``jax.Array``).
    """
    if isinstance(annotation, jax.ShapeDtypeStruct):
        return Annotation(format_spec(annotation), frozenset(_dtype_names(annotation.dtype)),
                          tuple(annotation.shape))
    if isinstance(annotation, str):
        match = _SPEC.match(annotation)
        if not match:
            return None
        dtype = match.group(1)
        if not _DTYPE.match(dtype):
            return None
        body = match.group(2).strip()
        dims = [d.strip() for d in body.split(",")] if body else []
        if not all(_DIM.match(d) for d in dims):
            return None
        return Annotation(annotation.strip(), frozenset({dtype}),
                          tuple(int(d) if d.isdigit() else d for d in dims))
    if not is_jaxtyping(annotation):
        return None
    dtypes = annotation.dtypes  # dtype names, or a sentinel object meaning any dtype
    allowed = frozenset(dtypes) if isinstance(dtypes, (list, tuple, set, frozenset)) and \
        all(isinstance(d, str) for d in dtypes) else None
    return Annotation(getattr(annotation, "__name__", None) or repr(annotation), allowed,
                      tuple(_jaxtyping_dim(token) for token in annotation.dim_str.split()))


def _jaxtyping_dim(token: str) -> int | str:
    """One jaxtyping dimension in :class:`Annotation` form.

    jaxtyping writes ``name=4`` for a documented fixed size, ``#name`` for a dimension that may
    also be 1, ``*name`` for several dimensions, ``_name``/``?name`` for unchecked or per-leaf
    names (not bound here), ``...`` for any dimensions; anything else is a symbolic expression
    (``dim+1``), checked once every name it uses is bound (see :func:`_evaluate`).
    """
    if token == "...":
        return token
    body = token.split("=")[-1] if token.count("=") == 1 else token
    prefix = re.match(r"^[#*_?]*", body).group(0)
    rest = body[len(prefix):]
    if "_" in prefix or "?" in prefix:
        return "..." if "*" in prefix else "_"
    if rest.isdigit():
        return "_" if "#" in prefix else int(rest)
    if rest.isidentifier():
        return "*" + rest if "*" in prefix else prefix + rest
    return "..." if "*" in prefix else "_" if "#" in prefix else "=" + rest


#: the operations a symbolic size may use (jaxtyping's are Python expressions; these cover sizes)
_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _evaluate(expression: str, sizes: Mapping[str, int]) -> int | float | None:
    """The value of a symbolic size (``n+1``, ``2*n``) for the bound ``sizes``; None where it uses
    an unbound name or anything but integers, names and arithmetic."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and isinstance(sizes.get(node.id), int):
            return sizes[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            return _OPERATIONS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(node)

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return None


def _dtype_names(dtype) -> set[str]:
    """The long and short names of a dtype: ``{"float32", "f32"}``."""
    try:
        return {np.dtype(dtype).name, short_dtype(dtype)}
    except TypeError:  # extended dtypes (PRNG keys)
        return {str(dtype)}


class _Dims:
    """Named-dimension bindings across one signature (JT102)."""

    def __init__(self):
        self.sizes: dict[str, tuple[object, str]] = {}
        #: symbolic sizes met, checked once every dim is bound: ``(expression, size, the start of
        #: the mismatch message)``
        self.symbolic: list[tuple[str, int, str]] = []

    def check_symbolic(self) -> list[tuple[str, str]]:
        """JT101 for each symbolic size whose value, with the names bound, differs from the size."""
        bound = {name: size for name, (size, _) in self.sizes.items()}
        found = []
        for expression, size, mismatch in self.symbolic:
            expected = _evaluate(expression, bound)
            if expected is not None and expected != size:
                found.append(("JT101", f"{mismatch}: {expression} = {expected})"))
        return found

    def bind(self, name: str, size, where: str) -> str | None:
        if name not in self.sizes:
            self.sizes[name] = (size, where)
            return None
        first, first_where = self.sizes[name]
        if first != size:
            return f"dimension '{name}' is {size} in {where} but {first} in {first_where}"
        return None


def _shape_problems(ann: Annotation, aval, what: str, dims: _Dims) -> list[tuple[str, str]]:
    """``(code, message)`` pairs for one annotated value."""
    shape, dtype = tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None)
    out = []

    def mismatch(why):
        out.append(("JT101", f"{what} is {_fmt(aval)} but annotated {ann.text} ({why})"))

    if ann.dtypes is not None and dtype is not None and ann.dtypes.isdisjoint(_dtype_names(dtype)):
        mismatch("dtype")
    if ann.dims is None:
        return out
    variadic = [i for i, d in enumerate(ann.dims) if isinstance(d, str) and d[:1] in (".", "*")]
    if len(variadic) > 1:  # ambiguous: nothing to check
        return out
    v = variadic[0] if variadic else len(ann.dims)
    before, after = ann.dims[:v], ann.dims[v + 1:]
    if len(shape) < len(before) + len(after) or (not variadic and len(shape) != len(ann.dims)):
        mismatch("rank")
        return out
    if variadic and ann.dims[v] not in ("...", "*"):
        why = dims.bind(ann.dims[v], shape[len(before):len(shape) - len(after)], what)
        if why:
            out.append(("JT102", why))
    first_after = len(shape) - len(after)
    axes = [(i, want) for i, want in enumerate(before)] + [(first_after + i, want) for i, want in enumerate(after)]
    for axis, want in axes:
        size = shape[axis]
        if isinstance(want, int):
            if want != size:
                mismatch(f"axis {axis}")
        elif want.startswith("="):
            dims.symbolic.append((want[1:], size, f"{what} is {_fmt(aval)} but annotated {ann.text} (axis {axis}"))
        elif want != "_" and not (want.startswith("#") and size == 1):  # '#name' broadcasts from 1
            why = dims.bind(want.lstrip("#"), size, f"{what} axis {axis}")
            if why:
                out.append(("JT102", why))
    return out


def _pytree_annotation(annotation):
    """The leaves of a pytree annotation, a JSON spec string (``'{"w": "f32[2,3]", "b": "f32[2]"}'``)
    or a dict, list or tuple of ``ShapeDtypeStruct`` or spec strings, as ``(path, Annotation)``
    pairs in JAX's flattening order, paths as :func:`~jaxtool.tracing.format_path` writes them;
    None for anything else, or one with a leaf that is not a spec."""
    import json

    from jaxtool.tracing import format_path

    if isinstance(annotation, str):
        if annotation.strip()[:1] not in ("{", "["):
            return None
        try:  # (its leaves are spec strings, named dimensions allowed: not parse_spec's input specs)
            annotation = json.loads(annotation)
        except ValueError:
            return None
    if not isinstance(annotation, (dict, list, tuple)):
        return None
    flat = [(format_path(path), parse_annotation(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(annotation)[0]]
    return None if any(ann is None for _, ann in flat) else flat


def is_shape_annotation(annotation) -> bool:
    """Whether :func:`check_annotations` checks ``annotation``: an array or a pytree annotation."""
    return parse_annotation(annotation) is not None or _pytree_annotation(annotation) is not None


def _positional(path: str) -> str:
    """A key path with its sequence indices and attribute names alike (a JSON list annotates a
    tuple or a NamedTuple), dict keys kept."""
    return re.sub(r"\.\w+|\[\d+\]", "[]", path)


def _structure_problem(what: str, text: str, leaves: Sequence, paths, annotated) -> str | None:
    """Why a value's leaves (``paths`` of them, when known) do not have an annotation's structure:
    ``annotated`` is its ``(path, Annotation)`` leaves, or None for an array annotation."""
    if annotated is None:
        if len(leaves) > 1:
            return f"{what} is a pytree of {len(leaves)} arrays but annotated {text} (structure)"
        return None
    want = [path for path, _ in annotated]
    mismatched = paths is not None and [_positional(p) for p in paths] != [_positional(p) for p in want]
    if len(want) != len(leaves) or mismatched:
        have = ", ".join(paths) if paths is not None else f"{len(leaves)} arrays"
        return f"{what} has leaves {have or 'none'} but annotated {', '.join(want) or 'none'} (structure)"
    return None


def check_annotations(annotations: Mapping[str, object], arguments: Mapping[str, Sequence],
                      results: Sequence, *, file: str | None = None, line: int | None = None,
                      name: str = "function", paths: Mapping[str, Sequence[str]] | None = None) -> list[Problem]:
    """Compare traced types with annotations (JT101) and bind named dims consistently (JT102).

    ``annotations`` maps parameter names (and ``"return"``) to anything :func:`parse_annotation`
    understands, or to a JSON pytree spec string; ``arguments`` maps parameter names to the
    abstract values of their leaves and ``results`` holds the output leaves. ``paths``, if given,
    maps parameter names (and ``"return"``) to their leaves' key paths (``["w"]``, ``[0]``), which
    a pytree annotation's must equal; without them only the number of leaves is compared. An array
    annotation on a value of several leaves is a mismatch; values with no leaves (``None``) and
    unparseable annotations are not checked.
    """
    dims, problems = _Dims(), []
    where = f"<{name}>"
    items = [(p, arguments.get(p, ()), f"argument '{p}'") for p in annotations if p != "return"]
    if "return" in annotations:
        items.append(("return", results, "return value"))
    for param, leaves, what in items:
        if not leaves:  # (None, or a --static parameter: nothing traced to compare)
            continue
        text = annotations[param]
        annotated = _pytree_annotation(text)
        if annotated is None:
            ann = parse_annotation(text)
            if ann is None:
                continue
            text = ann.text
        found = []
        why = _structure_problem(what, text, leaves, (paths or {}).get(param), annotated)
        if why:
            found.append(("JT101", why))
        elif annotated is None:
            found = _shape_problems(ann, leaves[0], what, dims)
        else:
            for (path, leaf_ann), aval in zip(annotated, leaves):
                leaf = f"{what[:-1]}{path}'" if what.endswith("'") else f"{what} out{path}"
                found.extend(_shape_problems(leaf_ann, aval, leaf, dims))
        problems.extend(Problem(code, message, where=where, file=file, line=line) for code, message in found)
    symbolic = dims.check_symbolic()
    problems.extend(Problem(code, message, where=where, file=file, line=line) for code, message in symbolic)
    return problems


__all__ = ["Annotation", "HOST_CALLBACKS", "Problem", "Report", "check_annotations", "check_jaxpr",
           "is_shape_annotation", "parse_annotation"]
