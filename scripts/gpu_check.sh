#!/usr/bin/env bash
# The GPU checks in one run, within BUDGET_S seconds (default 540: a device call's limit is 600), from
# the repository root:
#   PYTHONPATH=. bash scripts/gpu_check.sh
# Needs torch with CUDA, numpy, typer, rich and pytest (installs nothing).  Each step's timeout is its own
# cap or what the budget has left after the later steps' shares, whichever is less, so a cold cache of
# kernels compiled ahead cuts a step short (its output so far is kept) rather than the whole run.  Every step's output also goes to
# $OUT_DIR: warm.log (each method's first steps side by side, compiling its kernels ahead: WARM_JOBS),
# step.json/step.log (gradzip bench step), gpu_tests.log, kernels.json/kernels.log,
# gpu_kernel_tests.log (the kernels compiled ahead against their references, on CUDA), each failed
# compile's NAME.failed (the reason, then the compiler's output); optional
# steps: ISSUE_METHODS (step_inline.*: issued from DDP's hook), MEMORY_METHODS (memory.log: what is alive
# at each method's memory peak, by the line that allocated it; about 40 s a method).
# A failing step does not stop the later ones; the script exits 1 if bench step or bench kernels failed
# (the GPU tests' result is reported, not fatal: GPU_TESTS may select tests that do not exist yet).
set -euo pipefail

OUT_DIR=${OUT:-/tmp/gradzip_gpu}
# The bucket route's tests by name: a bare "bucket" also picks the GPT scripts' bucket_view feature, whose
# torchrun plan runs every method (it took most of a 170 s budget on 2026-11-27).
# The kernels' tests (bucket_kernels: each may first compile its method's kernels, tens of seconds) run
# last, on their own, so that a cold cache cannot leave the others unrun.
GPU_TESTS=${GPU_TESTS:-"sync_debug or bucket_route or bucket_draws or state_loaded or links_timed or nccl_alone or overlapped_diloco or callers_stream"}
KERNEL_TESTS=${KERNEL_TESTS:-"bucket_kernels"}
PYTHON=${PYTHON:-python}
STEP_ARGS=${STEP_ARGS:-"--steps 15 --warmup 2 --profile-steps 1"}  # more options for bench step
BUDGET_S=${BUDGET_S:-540}
WARM_TIMEOUT=${WARM_TIMEOUT:-100}
STEP_TIMEOUT=${STEP_TIMEOUT:-200}  # a method whose kernels compile ahead waits for them (tens of seconds each, once)
TESTS_TIMEOUT=${TESTS_TIMEOUT:-110}
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-60}
KERNEL_TESTS_TIMEOUT=${KERNEL_TESTS_TIMEOUT:-120}  # the kernels compiled ahead that the benchmarks did not need compile here
# The timeout of a step: its cap ($1), or the budget left less the later steps' least shares ($2), at least 20 s.
timeout_for() { local left=$((BUDGET_S - SECONDS - $2)); local t=$(( $1 < left ? $1 : left )); echo $(( t < 20 ? 20 : t )); }
ISSUE_METHODS=${ISSUE_METHODS:-}  # e.g. topk,qsgd: bench step again with GRADZIP_ISSUE=inline (thread vs hook)
MEMORY_METHODS=${MEMORY_METHODS:-}  # e.g. sketch: what is alive at each one's memory peak (and DDP's), by line
# The optional steps, when asked for, keep their shares of the budget from the start.
optional_s=$(( ${ISSUE_METHODS:+90} + ${MEMORY_METHODS:+150} + 0 ))
mkdir -p "$OUT_DIR"
# A contender list split as gradzip bench step splits it (a method's own parameters are comma-separated too).
split_methods() { "$PYTHON" -c 'import sys; from gradzip.bench.step import split_methods; print("\n".join(split_methods(sys.argv[1])))' "$1"; }
export PYTHONPATH=${PYTHONPATH:-.}
# One cache of kernels compiled ahead for the benchmarks and the tests: each compiles once (in a child
# process, tens of seconds), the first time a bucket route needs it.
export GRADZIP_KERNEL_CACHE=${GRADZIP_KERNEL_CACHE:-/tmp/gradzip_kernels}

nvidia-smi -L | tee "$OUT_DIR/nvidia-smi.txt"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
  | tee "$OUT_DIR/torch.txt"

step_rc=0; start=$SECONDS
# Each contender in a fresh process (peak memory of its own): about 18 s each on an H100 (2026-11-26:
# start-up, NCCL, model, steps, profiler), 35-45 s for a method whose kernels compile ahead into a cold
# cache (2026-11-27), so the quick check takes the baselines and a few methods, and STEP_METHODS=all
# (26 contenders, 8-15 minutes) needs a run of its own.
# torch-allreduce and the two probes beside DDP: where a Python hook's own cost goes (DDP's C++ hook
# path, then a Python hook doing nothing, then PyTorch's plain allreduce hook); none now leaves DDP's own
# allreduce in place (it took 1.38x and 1.48x DDP through a hook in two runs of docs/results/gpu.md,
# torch-allreduce 1.03x in one).
# powersgd:rank=4: PyTorch's hook's rank, like for like (gradzip's default is rank 2).
# Ten contenders fit STEP_TIMEOUT with a warm cache; the probes, bf16 and the others by STEP_METHODS.
STEP_METHODS=${STEP_METHODS:-ddp,torch-allreduce,torch-fp16,torch-powersgd,none,fp16,topk,qsgd,powersgd:rank=4,dgc}
[ "$STEP_METHODS" = all ] && STEP_METHODS=

# Kernels compiled ahead, once per machine: each contender's first steps in processes side by side (up
# to WARM_JOBS at once, each waiting for its packages, their compiles on every core), so that the timed
# table below loads them instead of compiling one contender at a time (35-45 s each when cold).
WARM_JOBS=${WARM_JOBS:-6}  # 0: no warm-up
if [ "$WARM_JOBS" -gt 0 ]; then
  warm_start=$SECONDS
  echo "== warming the cache of kernels compiled ahead ($WARM_JOBS at once) =="
  methods=${STEP_METHODS:-$("$PYTHON" -c 'import gradzip; print(",".join(gradzip.compressors()))')}
  split_methods "$methods" | grep -v -E '^(ddp|torch-.*|probe-.*)$' \
    | timeout "$(timeout_for "$WARM_TIMEOUT" $((230 + optional_s)))" xargs -P "$WARM_JOBS" -I{} "$PYTHON" -m gradzip bench step --device cuda --methods {} \
        --steps 1 --warmup 1 --profile-steps 1 --no-isolate > "$OUT_DIR/warm.log" 2>&1 || true
  echo "warm-up: $((SECONDS - warm_start)) s (its output: warm.log)"
fi

start=$SECONDS
echo "== gradzip bench step (DDP, PyTorch's hooks, gradzip methods: ${STEP_METHODS:-all}) =="
timeout "$(timeout_for "$STEP_TIMEOUT" $((130 + optional_s)))" "$PYTHON" -m gradzip bench step --device cuda $STEP_ARGS ${STEP_METHODS:+--methods "$STEP_METHODS"} --json "$OUT_DIR/step.json" 2>&1 \
  | tee "$OUT_DIR/step.log" || step_rc=$?
step_s=$((SECONDS - start)); start=$SECONDS

echo "== GPU tests: -k \"$GPU_TESTS\" =="
tests_rc=0
timeout "$(timeout_for "$TESTS_TIMEOUT" $((70 + optional_s)))" "$PYTHON" -m pytest -q --maxfail=25 tests/stacks/test_gpu.py -k "$GPU_TESTS" 2>&1 \
  | tee "$OUT_DIR/gpu_tests.log" || tests_rc=$?
tests_s=$((SECONDS - start)); start=$SECONDS

echo "== gradzip bench kernels (flat 25M, 3 rounds, each method's top operators by GPU time) =="
kernels_rc=0
timeout "$(timeout_for "$KERNELS_TIMEOUT" $((40 + optional_s)))" "$PYTHON" -m gradzip bench kernels --device cuda --workloads flat --repeat 3 --no-selection --no-alone --profile \
  --json "$OUT_DIR/kernels.json" 2>&1 | tee "$OUT_DIR/kernels.log" || kernels_rc=$?
kernels_s=$((SECONDS - start)); start=$SECONDS

echo "== GPU tests of the kernels compiled ahead: -k \"$KERNEL_TESTS\" =="
kernel_tests_rc=0
timeout "$(timeout_for "$KERNEL_TESTS_TIMEOUT" "$optional_s")" "$PYTHON" -m pytest -q --maxfail=25 tests/stacks/test_gpu.py \
  -k "$KERNEL_TESTS" 2>&1 | tee "$OUT_DIR/gpu_kernel_tests.log" || kernel_tests_rc=$?
kernel_tests_s=$((SECONDS - start))

if [ -n "$ISSUE_METHODS" ]; then
  echo "== bench step with each bucket's work issued from DDP's hook (GRADZIP_ISSUE=inline): $ISSUE_METHODS =="
  GRADZIP_ISSUE=inline timeout "$(timeout_for 90 $(( ${MEMORY_METHODS:+150} + 0 )))" "$PYTHON" -m gradzip bench step --device cuda $STEP_ARGS --methods "ddp,$ISSUE_METHODS" \
    --json "$OUT_DIR/step_inline.json" 2>&1 | tee "$OUT_DIR/step_inline.log" || true
fi

if [ -n "$MEMORY_METHODS" ]; then
  echo "== memory at the peak of the first and warm-up steps: ddp,$MEMORY_METHODS =="
  snapshots=$(mktemp -d)  # the histories stay on the machine (tens of MB each); their summaries come back
  timeout "$(timeout_for 150 0)" "$PYTHON" -m gradzip bench step --device cuda --methods "ddp,$MEMORY_METHODS" --steps 2 --warmup 2 \
    --profile-steps 1 --memory-snapshot "$snapshots" > "$OUT_DIR/memory.log" 2>&1 || true
  for name in ddp $(split_methods "$MEMORY_METHODS"); do
    [ -f "$snapshots/$name.pickle" ] && timeout 30 "$PYTHON" benchmarks/memory_peak.py "$snapshots/$name.pickle" 2>&1 \
      | tee -a "$OUT_DIR/memory.log"
  done
  rm -rf "$snapshots"
fi

# Compiles that failed: each .failed file's first line is the reason, then the compiler's output.
for failed in "$GRADZIP_KERNEL_CACHE"/*.failed; do
  [ -f "$failed" ] && cp "$failed" "$OUT_DIR/" && echo "a compile failed: $(basename "$failed"): $(head -c 300 "$failed" | head -1)"
done

echo "exit codes (124: timed out): bench step $step_rc in ${step_s} s, GPU tests $tests_rc (5: none selected)" \
  "in ${tests_s} s, bench kernels $kernels_rc in ${kernels_s} s, kernels' GPU tests $kernel_tests_rc in" \
  "${kernel_tests_s} s; ${SECONDS} s in all" \
  | tee "$OUT_DIR/summary.txt"
echo "outputs in $OUT_DIR"
[ "$step_rc" = 0 ] && [ "$kernels_rc" = 0 ]
