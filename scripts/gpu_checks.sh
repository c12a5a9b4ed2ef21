#!/usr/bin/env bash
# The checks that need one CUDA GPU, in one go (docs/BENCHMARKS.md quotes their figures):
#
#   bash scripts/gpu_checks.sh OUT_DIR [STEP...]
#
# Steps (all by default, in this order): tests (pytest -m gpu: every CUDA kernel against float64
# on the ring's block shapes, head dims 64 and 128, GQA; the ring engine on thread-ranks of the
# GPU with every kernel), kernels (scripts/bench_kernels.py: accuracy, TFLOP/s against dense
# SDPA, ring blocks), profile (zeppelin profile in bf16 into OUT_DIR/<gpu>-bf16.json: every
# kernel that runs, one curve each), train (the training job on one GPU in bf16, world 1, with
# the kernel the profile found fastest), validate (validate-cost-model with that file), host
# (scripts/bench_host_overhead.py --device cuda: host work per layer next to the calibrated GPU
# time), host-scale (the same on bench_plan_scale.py's 512-1024 GPU shapes), compare (zeppelin compare with the profile: same kernel and as deployed, TE's kernel
# measured where TransformerEngine is installed). Each step's log goes to OUT_DIR/<step>.log; a
# failed step is reported and the next one still runs; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash scripts/gpu_checks.sh OUT_DIR [STEP...]}"
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests kernels profile train validate host host-scale compare)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
gpu="$("$python" -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower())')" ||
  { echo "gpu_checks: no CUDA GPU visible" >&2; exit 1; }
calibration="$out/$gpu-bf16.json"
model=${MODEL:-llama-7b}

# The kernel the profile found fastest (its file's "kernel"), else auto.
fastest_kernel() {
  "$python" -c 'import json, sys
try:
    print(json.load(open(sys.argv[1])).get("kernel") or "auto")
except OSError:
    print("auto")' "$calibration"
}

run_step() {
  case "$1" in
    tests) "$python" -m pytest -q -p no:cacheprovider -m gpu -rA tests ;;
    kernels) "$python" scripts/bench_kernels.py --json "$out/kernels.json" ;;
    profile) "$python" -m megatron_zeppelin.cli profile --model "$model" --dtype bf16 \
               --device cuda --rounds "${PROFILE_ROUNDS:-3}" --output "$calibration" ;;
    validate) "$python" -m megatron_zeppelin.cli validate-cost-model --calibration "$calibration" \
                --model "$model" --dtype bf16 --device cuda --tokens 65536 --batches 6 \
                --json "$out/validate.json" ;;
    train) "$python" -m torch.distributed.run --nproc-per-node 1 \
             -m megatron_zeppelin.job.train_cpu --device cuda --dtype bf16 \
             --zeppelin-kernel "$(fastest_kernel)" \
             --zeppelin-nodes 1 --zeppelin-capacity 16384 --tokens-per-step 16384 \
             --zeppelin-max-document-length 8192 --num-layers 4 --hidden-size 1024 --num-heads 16 \
             --num-kv-heads 4 --ffn-hidden-size 2816 --lr 5e-4 --steps 300 \
             --dataset-tokens 2000000 --run-dir "${TMPDIR:-/tmp}/zeppelin-gpu-train" --json "$out/train.json" ;;
    host) "$python" scripts/bench_host_overhead.py --device cuda ;;
    host-scale) "$python" scripts/bench_host_overhead.py --device cuda --scale --repeats 3 ;;
    compare) "$python" -m megatron_zeppelin.cli compare --topology dgx-h100 --nodes 2 \
               --model "$model" --dist wikipedia --tokens 262144 --steps 4 --quiet \
               --cost-model "$calibration" --json "$out/compare.json" ;;
    *) echo "gpu_checks: no step called $1" >&2; return 2 ;;
  esac
}

status=0
for step in "${steps[@]}"; do
  echo "== $step"
  start=$(date +%s)
  if ! run_step "$step" 2>&1 | tee "$out/$step.log"; then
    echo "gpu_checks: $step failed" >&2
    status=1
  fi
  echo "== $step: $(( $(date +%s) - start )) s"
done
exit "$status"
