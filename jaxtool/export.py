"""A jaxpr for machines: JSON, Graphviz DOT, and the lowered StableHLO/HLO module.

:func:`to_json` and :func:`to_dot` read the :class:`jaxtool.printing.JaxprView` that ``jaxtool show``
prints, so names, vertex numbers, folding (``--depth``) and inlining (``--inline``) agree with the
text output. :func:`lowered_text` lowers a function for a platform, which needs no device of it.
"""

from __future__ import annotations

import math

import numpy as np

import jax

from jaxtool.errors import UnsupportedError
from jaxtool.printing import Atom, JaxprView, Summary, function_name, param_text, vertex_label

# ------------------------------------------------------------------------------------- JSON


def to_json(view: JaxprView, summary: Summary) -> dict:
    """The program as a JSON-ready dict: ``inputs``, ``outputs``, ``jaxpr`` and ``summary``.

    Each equation has ``path`` (its position in the nested jaxpr), ``primitive``, ``params`` (every
    parameter; jaxprs as nested objects, or ``{"folded": true, "eqns": N}`` beyond ``--depth``),
    ``invars``/``outvars`` (``name``, ``shape``, ``dtype``; literals also ``value``), ``source``
    (``file``, ``line``, ``function``, ``code``, or null) and ``vertices`` (null where the equation
    is not part of the flat program).
    """
    ports = lambda items: [{"name": p.name, "var": p.var, "shape": list(p.shape), "dtype": p.dtype,
                            "bytes": p.bytes} for p in items]
    return {
        "inline": view.inline,
        "inputs": ports(summary.inputs),
        "outputs": ports(summary.outputs),
        "jaxpr": _jaxpr_json(view),
        "summary": {
            "equations": summary.total,
            "by_primitive": dict(summary.counts),
            "vertices": summary.num_vertices,
            "input_bytes": sum(p.bytes for p in summary.inputs),
            "output_bytes": sum(p.bytes for p in summary.outputs),
        },
    }


def _jaxpr_json(view: JaxprView) -> dict:
    return {
        "constvars": [_atom_json(a) for a in view.constvars],
        "invars": [_atom_json(a) for a in view.invars],
        "eqns": [_eqn_json(e) for e in view.eqns],
        "outvars": [_atom_json(a) for a in view.outvars],
    }


def _atom_json(atom: Atom) -> dict:
    shape = getattr(atom.aval, "shape", None)
    dtype = getattr(atom.aval, "dtype", None)
    out = {"name": atom.name, "shape": list(shape) if shape is not None else None,
           "dtype": str(dtype) if dtype is not None else str(atom.aval)}
    if atom.is_literal:
        out["value"] = json_value(atom.value)
    return out


def _eqn_json(eqn) -> dict:
    params = {k: json_value(v) for k, v in sorted(eqn.params.items())}
    for nested in eqn.nested:
        obj = _jaxpr_json(nested.view) if nested.view is not None else {"folded": True, "eqns": nested.num_eqns}
        if nested.index is None:
            params[nested.param] = obj
        else:
            if not isinstance(params.get(nested.param), list) or len(params[nested.param]) <= nested.index:
                params[nested.param] = [None] * len(eqn.params[nested.param])
            params[nested.param][nested.index] = obj
    source = eqn.source
    return {
        "path": list(eqn.path),
        "primitive": eqn.primitive,
        "params": params,
        "invars": [_atom_json(a) for a in eqn.invars],
        "outvars": [_atom_json(a) for a in eqn.outvars],
        "source": None if source is None else {"file": source.file, "line": source.line,
                                               "function": source.function, "code": source.code},
        "vertices": list(eqn.vertices) if eqn.vertices is not None else None,
    }


def json_value(value):
    """A parameter or literal value as plain JSON: arrays as lists, dtypes as strings, named tuples
    as objects, functions by name, anything else by ``str``; non-finite floats as strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return str(np.dtype(value))
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return json_value(np.asarray(value).tolist())
    if hasattr(value, "_asdict"):
        return {k: json_value(v) for k, v in value._asdict().items()}
    if isinstance(value, (tuple, list)):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(str(v) for v in value)
    name = function_name(value)
    return name if name is not None else param_text(value)


# -------------------------------------------------------------------------------------- DOT


def dot_quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class _Dot:
    """Collects node declarations (clusters included) and edges; every node is declared once."""

    def __init__(self):
        self.lines: list = []
        self.edges: list = []
        self.declared: set = set()
        self._ids = 0

    def fresh(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def node(self, indent: str, node_id: str, label: str, **attrs) -> str:
        if node_id not in self.declared:
            self.declared.add(node_id)
            extra = "".join(f", {k}={v}" for k, v in attrs.items())
            self.lines.append(f"{indent}{node_id} [label={dot_quote(label)}{extra}];")
        return node_id

    def atom(self, atom: Atom, indent: str, title: str = "", **attrs) -> str:
        """The node of a variable (declared on first sight) or a new node for a literal."""
        if atom.is_literal:
            return self.node(indent, self.fresh("l"), f"{atom.name}:{atom.type}", shape="plaintext")
        return self.node(indent, f"a{atom.key}", f"{title}{atom.name}: {atom.type}", **attrs)

    def edge(self, src: str, dst: str, dashed: bool = False) -> None:
        self.edges.append(f"  {src} -> {dst}{' [style=dashed]' if dashed else ''};")

    def jaxpr(self, view: JaxprView, indent: str, input_names=None, top: bool = False) -> tuple:
        """Declare the nodes of ``view``; return the node ids of its inputs and outputs."""
        for atom in view.constvars:
            self.atom(atom, indent, shape="note")
        names = input_names if input_names is not None else [""] * len(view.invars)
        inputs = [self.atom(a, indent, f"{n}\n" if n else "", style="bold" if top else "solid")
                  for a, n in zip(view.invars, names)]
        for eqn in view.eqns:
            self.eqn(eqn, indent)
        outputs = [self.atom(a, indent) for a in view.outvars]
        if top:
            self.lines.extend(f"{indent}{node_id} [peripheries=2];" for node_id in outputs)
        return inputs, outputs

    def eqn(self, eqn, indent: str) -> None:
        vertices = vertex_label(eqn.vertices)
        folded = [f"{n.label}: {{ ... {n.num_eqns} eqn{'s' * (n.num_eqns != 1)} }}" for n in eqn.nested
                  if n.view is None]
        label = "\n".join([eqn.primitive] + ([vertices] if vertices else []) + folded)
        node_id = self.node(indent, self.fresh("e"), label, shape="box")
        for atom in eqn.invars:
            self.edge(self.atom(atom, indent), node_id)
        outs = [self.atom(atom, indent) for atom in eqn.outvars]
        for out in outs:
            self.edge(node_id, out)
        for nested in eqn.nested:
            if nested.view is None:
                continue
            cluster = self.fresh("cluster_")
            self.lines.append(f"{indent}subgraph {cluster} {{")
            self.lines.append(f"{indent}  label={dot_quote(f'{eqn.primitive} {nested.label}')}; style=dashed;")
            inner_in, inner_out = self.jaxpr(nested.view, indent + "  ")
            self.lines.append(f"{indent}}}")
            for dst in inner_in:
                self.edge(node_id, dst, dashed=True)
            if len(inner_out) == len(outs):
                for src, dst in zip(inner_out, outs):
                    self.edge(src, dst, dashed=True)


def to_dot(view: JaxprView, summary: Summary | None = None, *, name: str = "jaxpr") -> str:
    """A Graphviz digraph of the program: variables as ellipses (inputs bold, outputs doubled),
    equations as boxes labelled with primitive and vertices, nested jaxprs as dashed clusters."""
    dot = _Dot()
    input_names = [p.name for p in summary.inputs] if summary is not None else None
    dot.jaxpr(view, "  ", input_names, top=True)
    header = [f"digraph {dot_quote(name)} {{", "  rankdir=TB;",
              '  node [fontname="monospace"]; edge [fontname="monospace"];']
    return "\n".join(header + dot.lines + dot.edges + ["}"]) + "\n"


# --------------------------------------------------------------------------------- lowering

#: ``--backend`` name -> the platform name ``lower(lowering_platforms=...)`` takes.
PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}


def lowered_text(fn, args, *, stage: str, backend: str) -> str:
    """The module ``jax.jit(fn)`` lowers to for ``backend`` ('cpu' or 'gpu'; no device needed):
    ``stage`` 'stablehlo' (MLIR text) or 'hlo' (XLA HLO text).

    A program JAX cannot lower for the platform is an :class:`UnsupportedError`.
    """
    platform = PLATFORMS[backend]
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    except Exception as exc:  # JAX raises assorted types (NotImplementedError, ValueError, ...)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"cannot lower for {platform}: {message}") from exc
    if stage == "stablehlo":
        return lowered.as_text()
    return lowered.as_text(dialect="hlo")
