#!/usr/bin/env bash
# The checks of one lent GPU machine, in one call of at most about 8.5 minutes: the GPU tests, the
# stages of the encoder's first calls, and `make bench` at reduced counts on the eight tasks (the
# report is rewritten after each program, so a step stopped by its timeout keeps what it measured).
# Each step has its own timeout; its log goes to $OUT.
#   OUT=/tmp/gpu bash scripts/gpu_check.sh
set -u
export PYTHONUNBUFFERED=1 NO_COLOR=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
started=$(date +%s)
step() {  # step NAME SECONDS COMMAND...: run COMMAND into $OUT/NAME.log with a timeout
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?" >> "$OUT/$name.log"
  echo "[$(( $(date +%s) - started )) s] $name: $(tail -n 1 "$OUT/$name.log")"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, jax; print(sys.version); print('jax', jax.__version__, jax.devices())"; } > "$OUT/machine.log" 2>&1
step test_gpu 120 python3 -m pytest -p no:cacheprovider -v tests/test_gpu.py
step stages 60 python3 scripts/first_call_stages.py --programs encoder --orders rev,markowitz,fwd
step bench 320 python3 scripts/bench.py --rounds 2 --calls 10 --batch-calls 3 --first-calls 1 --output "$OUT/bench.md" \
  --programs roe_flux_1d,roe_flux_3d,robot_arm_6dof,human_heart_dipole,propane_combustion,black_scholes_jacobian,perceptron,encoder
