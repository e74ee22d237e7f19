"""``make fuzz``: compare ``jaxtool.jacve`` with ``jax.jacrev`` on many random programs.

Each seed is one program from ``tests/program_generator.py`` (3..``--max-ops`` operations),
checked with the ``fwd``, ``rev`` and ``markowitz`` orders and ``--random-orders`` random valid
orders (compiled without XLA's optimisation passes, see ``program_generator.quick_compilation``).
Progress and the report of every failure go to stderr; stdout gets the summary
``N passed, M failed`` (plus rounding-dependent seeds, see below, and skipped seeds: no valid
program in 20 attempts) and the seed of every failure. Exit status 1 if any seed failed, else 0.

A seed whose comparison fails only in values, where ``jax.jacrev`` differentiates another primal
output than the program computes, or where the comparison passes with both run eagerly
(``jax.disable_jit``), is *rounding-dependent*, not failed: its program decides a discontinuity (a
tied sort key, a max) on values that two evaluations round differently. So is one whose float32
reference is itself off its float64 value by more than the tolerance (a cancellation), where the
comparison passes in float64 (``program_generator.check_case``). Such seeds are reported on stderr,
with the second opinion that cleared them, and listed. The list also takes a seed where only the
reference, ``jax.jit(jax.jacrev)``, differs from eager ``jax.jacrev``, ``jax.jit(jax.jacfwd)`` and
every jacve order, which all agree: not rounding, but not the engine either (JAX 0.10.2 has such
programs; ``jax.jit(jax.jacrev(lambda v: jnp.cumsum(v)[2]))`` of 5 elements returns all ones). And
a seed that differs only without XLA's optimisation passes, where compiled with them (JAX's default)
``jax.jacrev`` and every order agree: XLA:CPU (JAX 0.10.2) without them computes some fused scalar
programs wrongly (seed 101906).

With ``--dtype`` every program runs on inputs of another floating dtype and is compared at its
tolerance (``program_generator.TOLERANCES``): float64 (under ``jax_enable_x64``) at 1e-10, for engine
code that assumes 32-bit types (there a seed whose program computes some values in float32, a cast of
a comparison or a scatter into such an array, and agrees to float32's tolerance is
rounding-dependent); float16 and bfloat16 at 0.1, for crashes and wrong dtypes. With ``--promotion
strict`` every check runs under ``jax_numpy_dtype_promotion="strict"`` (a program that mixes types
implicitly is then invalid, and the next attempt of its seed is checked instead), and with
``--rank-promotion raise`` under ``jax_numpy_rank_promotion="raise"`` (the same for programs that
broadcast arrays of different ranks implicitly): settings that must apply to the program and not to
the engine's own arithmetic. With ``--check-leaks`` every check runs under ``jax_check_tracer_leaks``:
no value of a trace the engine opens (``jax.vmap`` of a map, ``jax.eval_shape``, ...) may outlive it.
With ``--small-thresholds`` the engine's size thresholds are ``program_generator.SMALL_THRESHOLDS``,
so that the paths it takes for large partials run on these small programs.

    python scripts/fuzz.py                   # seeds 0..9999 on every CPU
    python scripts/fuzz.py -n 500 --start 20000 --jobs 2
    python scripts/fuzz.py --seeds 9,417      # re-check some seeds
    python scripts/fuzz.py --show 417         # print a seed's program as a runnable reproducer
    python scripts/fuzz.py -n 500 --dtype float64   # the same programs in float64, compared at 1e-10
    python scripts/fuzz.py -n 500 --promotion strict   # under jax_numpy_dtype_promotion="strict"
    python scripts/fuzz.py -n 500 --rank-promotion raise   # under jax_numpy_rank_promotion="raise"
    python scripts/fuzz.py -n 500 --check-leaks   # under jax_check_tracer_leaks
    python scripts/fuzz.py -n 500 --small-thresholds   # the paths for large partials, on small programs
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import program_generator as pg  # noqa: E402

#: each JAX setting of :func:`settings`: the flag that sets it, and the value JAX starts with
OPTIONS = {"jax_numpy_dtype_promotion": ("--promotion", "standard"),
           "jax_numpy_rank_promotion": ("--rank-promotion", "allow"),
           "jax_check_tracer_leaks": ("--check-leaks", False)}


def check(task):
    """Worker: ``(seed, status, report)``, status "passed", "failed" or "skipped"."""
    seed, max_ops, n_random, dtype = task
    return (seed,) + pg.check_seed_outcome(seed, n_random, max_ops, reproducer=False, dtype=dtype)


def settings(args) -> dict:
    """The JAX settings every check runs under: ``{option: value}`` from ``--promotion``,
    ``--rank-promotion`` and ``--check-leaks``."""
    return {"jax_numpy_dtype_promotion": args.promotion, "jax_numpy_rank_promotion": args.rank_promotion,
            "jax_check_tracer_leaks": args.check_leaks}


def initialize(options: dict, small: bool = False) -> None:
    """Worker set-up: compile without XLA's optimisation passes; JAX's ``options``; with ``small``,
    the engine's :data:`program_generator.SMALL_THRESHOLDS`."""
    import jax

    pg.quick_compilation()
    for name, value in options.items():
        jax.config.update(name, value)
    if small:
        pg.set_thresholds(pg.SMALL_THRESHOLDS)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--count", type=int, default=10000, help="number of seeds (default 10000)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", help="comma-separated seeds to check instead of a range")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)")
    parser.add_argument("--max-ops", type=int, default=25, help="most operations per program (default 25)")
    parser.add_argument("--random-orders", type=int, default=2, help="random orders per program (default 2)")
    parser.add_argument("--dtype", choices=tuple(pg.TOLERANCES), default="float32",
                        help="the inputs' dtype (default float32; float64 under jax_enable_x64, compared at "
                             "1e-10; float16 and bfloat16 at 0.1)")
    parser.add_argument("--promotion", choices=("standard", "strict"), default="standard",
                        help="jax_numpy_dtype_promotion while checking (default standard): with strict, "
                             "programs that mix types implicitly are invalid and regenerated")
    parser.add_argument("--rank-promotion", choices=("allow", "raise"), default="allow",
                        help="jax_numpy_rank_promotion while checking (default allow): with raise, programs "
                             "that broadcast arrays of different ranks implicitly are invalid and regenerated")
    parser.add_argument("--check-leaks", action="store_true",
                        help="check under jax_check_tracer_leaks (a tracer that outlives its trace fails)")
    parser.add_argument("--small-thresholds", action="store_true",
                        help="shrink the engine's size thresholds (program_generator.SMALL_THRESHOLDS), so that "
                             "the paths for large partials run on these small programs")
    parser.add_argument("--show", type=int, metavar="SEED", help="print SEED's reproducer script and exit")
    return parser.parse_args(argv)


def _literal(value) -> str:
    """``value`` as Python source, strings in double quotes."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def show(seed: int, max_ops: int, dtype: str, options: dict, small: bool = False) -> int:
    """Print the reproducer of ``seed``'s first valid attempt (the one the fuzzer checks)."""
    import jax

    with jax.enable_x64(dtype == "float64"):
        for attempt in range(pg.MAX_ATTEMPTS):
            case = pg.generated(seed, attempt, max_ops, dtype)
            if pg.reference(case) is not None:
                break
    print("# " + case.description().replace("\n", "\n# "))
    reproducer = case.reproducer()
    changed = "".join(f'jax.config.update("{name}", {_literal(value)})\n' for name, value in options.items()
                      if value != OPTIONS[name][1])
    if small:
        changed += "".join(f"import jaxtool.{name}\n" + "".join(f"jaxtool.{name}.{attribute} = {value}\n"
                                                          for attribute, value in values.items())
                           for name, values in pg.SMALL_THRESHOLDS.items())
    reproducer = reproducer.replace("import jaxtool\n", "import jaxtool\n" + changed, 1)
    print(reproducer)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.show is not None:
        initialize(settings(args))  # (which attempt is valid may depend on it)
        return show(args.show, args.max_ops, args.dtype, settings(args), args.small_thresholds)
    seeds = ([int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds
             else list(range(args.start, args.start + args.count)))
    tasks = [(s, args.max_ops, args.random_orders, args.dtype) for s in seeds]
    flags = (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + \
        "".join(f" {OPTIONS[name][0]}" + ("" if value is True else f" {value}")
                for name, value in settings(args).items() if value != OPTIONS[name][1]) + \
        (" --small-thresholds" if args.small_thresholds else "")
    counts = {"passed": 0, "failed": 0, "rounding": 0, "skipped": 0}
    failed, rounding = [], []
    started = time.monotonic()
    jobs = max(1, min(args.jobs, len(tasks)))
    initialize(settings(args), args.small_thresholds)
    # fresh workers now and then: every compilation leaves something in JAX's caches
    pool = (multiprocessing.get_context("spawn").Pool(jobs, initializer=initialize,
                                                      initargs=(settings(args), args.small_thresholds),
                                                      maxtasksperchild=100)
            if jobs > 1 else None)
    results = pool.imap_unordered(check, tasks) if pool else map(check, tasks)
    try:
        for done, (seed, status, report) in enumerate(results, 1):
            counts[status] += 1
            if status == "failed":
                failed.append(seed)
                print(f"FAILED {report}\n(reproducer: python scripts/fuzz.py --max-ops {args.max_ops}{flags} "
                      f"--show {seed})\n",
                      file=sys.stderr, flush=True)
            elif status == "rounding":
                rounding.append(seed)
                print(f"ROUNDING-DEPENDENT {report}\n", file=sys.stderr, flush=True)
            if done % 50 == 0 or done == len(tasks):
                elapsed = time.monotonic() - started
                print(f"[{done}/{len(tasks)}] {counts['passed']} passed, {counts['failed']} failed, "
                      f"{counts['rounding']} rounding-dependent, {counts['skipped']} skipped ({elapsed:.0f} s)",
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        if pool:
            pool.terminate()
    summary = f"{counts['passed']} passed, {counts['failed']} failed"
    summary += f", {counts['rounding']} rounding-dependent" if counts["rounding"] else ""
    print(summary + (f", {counts['skipped']} skipped" if counts["skipped"] else ""))
    if failed:
        print("failed seeds: " + ",".join(map(str, sorted(failed))))
        print(f"(re-check: python scripts/fuzz.py --max-ops {args.max_ops}{flags} "
              f"--seeds {','.join(map(str, sorted(failed)))})")
    if rounding:
        print("rounding-dependent seeds: " + ",".join(map(str, sorted(rounding))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
