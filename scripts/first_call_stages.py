"""Where a first call's time goes: lowering, compiling and running each Jacobian of a sample program.

For each program and competitor (``jax.jacfwd``, ``jax.jacrev``, ``jaxtool.jacve`` in each order),
on JAX's default device: the seconds to trace and lower ``jax.jit`` of the Jacobian, to compile it,
to run it once, and the size of its StableHLO program (operations, ``dot_general``s). Each stage is
printed as soon as it ends, so that a run stopped by a timeout still shows which stage it was in.
``make bench`` times whole first calls; this script takes one apart, e.g. on a GPU machine:

    python scripts/first_call_stages.py --programs encoder --orders fwd,rev,markowitz
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ALL_PROGRAMS, ORDERS, float_argnums, load_program  # noqa: E402


def say(text: str) -> None:
    print(text, flush=True)


def stages(name: str, orders) -> None:
    import jax
    import numpy as np

    import jaxtool

    fn, args = load_program(name)
    args = jax.device_put(args, jax.devices()[0])
    argnums = float_argnums(args)
    competitors = [("jax.jacrev", jax.jacrev(fn, argnums)), ("jax.jacfwd", jax.jacfwd(fn, argnums))]
    competitors += [(f"jacve {o}", jaxtool.jacve(fn, o, argnums)) for o in orders]
    reference = None
    for label, jacobian in competitors:
        head = f"{name}: {label}:"
        started = time.perf_counter()
        lowered = jax.jit(jacobian).lower(*args)
        text = lowered.as_text()
        operations = len(re.findall(r"stablehlo\.\w+", text))
        dots = len(re.findall(r"stablehlo\.dot_general", text))
        say(f"{head} lowered in {time.perf_counter() - started:.2f} s "
            f"({operations} StableHLO operations, {dots} dot_general)")
        started = time.perf_counter()
        compiled = lowered.compile()
        say(f"{head} compiled in {time.perf_counter() - started:.2f} s")
        started = time.perf_counter()
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.block_until_ready(compiled(*args)))]
        reference = leaves if reference is None else reference
        error = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(leaves, reference))
        say(f"{head} first run in {1e3 * (time.perf_counter() - started):.1f} ms; "
            f"largest difference from jax.jacrev {error:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="encoder", help="comma-separated, of: " + ", ".join(ALL_PROGRAMS))
    parser.add_argument("--orders", default=",".join(ORDERS), help="comma-separated jacve orders")
    opts = parser.parse_args(argv)
    programs = [p for p in opts.programs.split(",") if p]
    unknown = [p for p in programs if p not in ALL_PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {', '.join(unknown)}")
    import jax

    say(f"device: {jax.devices()[0]} (jax {jax.__version__})")
    for name in programs:
        stages(name, [o for o in opts.orders.split(",") if o])
    return 0


if __name__ == "__main__":
    sys.exit(main())
