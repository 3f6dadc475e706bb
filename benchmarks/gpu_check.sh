#!/usr/bin/env bash
# The prepared GPU check of the CUDA backend (issue 13), for a machine with one or more GPUs.
#
#   bash benchmarks/gpu_check.sh
#
# From a clean checkout: makes .venv-gpu (seeing the system's packages, so an installed CUDA
# torch is reused; otherwise installs torch==2.13.0 from the default index, whose Linux wheels
# are CUDA builds), cupy-cuda12x (piper-runtime's `cuda` extra) and the Piper packages; then
#   1. the CUDA tests (device-side ordering between lanes, every communicator operation between
#      two processes over NCCL and host-staged, allocator figures, `piper check` through pytest,
#      a run resumed from a checkpoint with the fused AdamW, whose step count lives on the GPU)
#      and the CPU tests of the backend's logic on fakes;
#   2. `piper check --backend cuda` for 1f1b pp=2, 1f1b pp=2 on the `stack` model (whose 1 MiB
#      weights add their gradients inside the matrix product: piper_runtime.rank.accumulation),
#      dualpipev pp=2, 1f1b pp=2 x dp=2 zero=3 and
#      ep=2 (pp=2 x ep=2), against single-device training (ranks share GPUs when there are fewer
#      GPUs than ranks: --ranks-per-gpu, host-staged transport between ranks of one GPU);
#   3. whether two of the backend's streams overlap (a compute kernel and a copy on different
#      lanes take less than the sum of each alone: benchmarks/gpu_overlap.py);
#   4. `piper check --compile` under ZB1P (segments through inductor, BI and BW apart) and the
#      compiled step against the eager one on the `stack` model (benchmarks/bench_torch_compile.py).
# and prints a summary table. Exit code 0 when everything passed. Each step has a time limit;
# the whole check takes well under 8 minutes on one GPU once the packages are installed, plus
# up to 9 minutes for step 4 (inductor compiles on the first step of each run).
#
# Environment: PYTHON (default python3), PIPER_GPU_VENV (default .venv-gpu),
# TORCH_SPEC (default torch==2.13.0), PIPER_GPU_LOGS (default a temporary folder),
# PIPER_GPU_SKIP_SETUP=1 (use PIPER_GPU_VENV as it is: a dry run of the script elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STARTED=$(date +%s)
PY=${PYTHON:-python3}
VENV=${PIPER_GPU_VENV:-.venv-gpu}
LOGS=${PIPER_GPU_LOGS:-$(mktemp -d -t piper-gpu-check-XXXX)}
mkdir -p "$LOGS"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1

say() { printf '== %s\n' "$*" >&2; }

# -- set-up -------------------------------------------------------------------------------------
VPY="$ROOT/$VENV/bin/python"
if [ "${PIPER_GPU_SKIP_SETUP:-0}" != 1 ]; then
say "setting up $VENV (logs: $LOGS)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" || { echo "cannot make $VENV"; exit 2; }
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "no CUDA torch here: installing ${TORCH_SPEC:-torch==2.13.0}"
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}" >"$LOGS/setup-torch.log" 2>&1 || { tail -20 "$LOGS/setup-torch.log"; exit 2; }
fi
grep -v '^torch' requirements-dev.txt >"$LOGS/requirements.txt"
"${PIP[@]}" -r "$LOGS/requirements.txt" cupy-cuda12x >"$LOGS/setup.log" 2>&1 || { tail -20 "$LOGS/setup.log"; exit 2; }
"$VPY" -c "import nvidia.nccl" 2>/dev/null || "${PIP[@]}" nvidia-nccl-cu12 >>"$LOGS/setup.log" 2>&1
"${PIP[@]}" --no-deps -e packages/piper-ir -e packages/piper-memory -e packages/piper-scheduler \
  -e packages/piper-directives -e "packages/piper-runtime[cuda]" -e packages/piper-train >>"$LOGS/setup.log" 2>&1 \
  || { tail -20 "$LOGS/setup.log"; exit 2; }
fi
# cupy's NCCL module loads libnccl.so.2: use the one the CUDA torch wheels ship.
NCCL_LIB=$("$VPY" -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SETUP_S=$(( $(date +%s) - STARTED ))

ENVIRONMENT=$("$VPY" - <<'EOF'
import torch
from piper_runtime.backends import cuda_missing
lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s)"]
for i in range(torch.cuda.device_count()):
    lines.append(f"  GPU {i}: {torch.cuda.get_device_name(i)}")
try:
    import cupy
    from cupy.cuda import nccl
    lines.append(f"cupy {cupy.__version__}, NCCL {nccl.get_version()}")
except Exception as exc:
    lines.append(f"cupy/NCCL: {type(exc).__name__}: {exc}")
lines.append(f"CUDA backend: {cuda_missing() or 'ready'}")
print("\n".join(lines))
EOF
)
echo "$ENVIRONMENT"
GPUS=$("$VPY" -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)
per_gpu() { echo $(( ($1 + GPUS - 1) / GPUS )); }  # ranks per GPU so that $1 ranks fit

# -- the checks ----------------------------------------------------------------------------------
NAMES=(); RESULTS=(); TIMES=(); NOTES=()
run() {  # run NAME LIMIT_S COMMAND...: record PASS/FAIL, seconds and the last line of output
  local name=$1 limit=$2 log="$LOGS/$(echo "$1" | tr -c 'a-zA-Z0-9=\n' '_').log" t0 rc
  shift 2
  say "$name"
  t0=$(date +%s)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  NAMES+=("$name"); TIMES+=($(( $(date +%s) - t0 )))
  if [ $rc -eq 0 ]; then RESULTS+=(PASS); elif [ $rc -eq 124 ]; then RESULTS+=("FAIL (over ${limit} s)"); else RESULTS+=("FAIL (exit $rc)"); fi
  NOTES+=("$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-110)")
}

run "CUDA tests (pytest)" 360 "$VPY" -m pytest -p no:cacheprovider --import-mode=importlib -q -rs \
  packages/piper-runtime/tests/test_cuda_gpu.py packages/piper-runtime/tests/test_cuda_backend.py \
  packages/piper-runtime/tests/test_accumulation.py integration/test_cuda_gpu.py integration/test_cuda_on_fakes.py
CHECK=("$VPY" -m piper_train.cli check --backend cuda --steps 2 --rtol 1e-4 --atol 1e-5)
run "check 1f1b pp=2" 120 "${CHECK[@]}" --schedule 1f1b --pp 2 --ranks-per-gpu "$(per_gpu 2)"
run "check stack 1f1b pp=2 (fused grads)" 150 "${CHECK[@]}" --model stack --schedule 1f1b --pp 2 --ranks-per-gpu "$(per_gpu 2)"
run "check dualpipev pp=2" 120 "${CHECK[@]}" --schedule dualpipev --pp 2 --ranks-per-gpu "$(per_gpu 2)"
run "check 1f1b pp=2 dp=2 zero=3" 150 "${CHECK[@]}" --schedule 1f1b --pp 2 --dp 2 --zero 3 --ranks-per-gpu "$(per_gpu 4)"
run "check ep=2 (moe pp=2 ep=2)" 150 "${CHECK[@]}" --model moe --pp 2 --ep 2 --microbatches 2 --ranks-per-gpu "$(per_gpu 4)"
run "streams overlap" 120 "$VPY" benchmarks/gpu_overlap.py
# --compile (issue 39, item 2; unverified on a GPU): segments as inductor's Triton kernels, the
# split backward of ZB1P included, against single-device eager; then compiled vs eager steps.
run "check --compile zb1p pp=2" 240 "${CHECK[@]}" --schedule zb1p --pp 2 --compile --timeout 200 --ranks-per-gpu "$(per_gpu 2)"
run "torch.compile vs eager (stack)" 300 "$VPY" benchmarks/bench_torch_compile.py --runtime ray --rounds 1 --steps 12

# -- summary ---------------------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - STARTED ))
failed=0
echo
echo "=================== Piper GPU check: summary ==================="
echo "$ENVIRONMENT"
echo "set-up: ${SETUP_S} s; checks and set-up: ${TOTAL} s; logs: $LOGS"
printf '%-32s %-18s %6s  %s\n' "check" "result" "secs" "last line"
for i in "${!NAMES[@]}"; do
  printf '%-32s %-18s %6s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
  [ "${RESULTS[$i]}" = PASS ] || failed=$((failed + 1))
done
echo "streams:"; sed -n '1,8p' "$LOGS/streams_overlap.log" 2>/dev/null | sed 's/^/  /'
if [ $failed -eq 0 ]; then echo "ALL PASSED (${#NAMES[@]} checks)"; else echo "$failed of ${#NAMES[@]} checks FAILED (see the logs)"; fi
exit $(( failed > 0 ))
