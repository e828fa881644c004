#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over the GPU test suite on virtual ranks.
# Run on the GPU machine after scripts/gpu-stage.sh (binaries in .gpu/bin):
#   bash scripts/sanitize.sh [TEST_FILTER...]
# Writes one log per tool under $OUT (or /tmp/out) and prints a summary line per tool.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
bin=${SANITIZE_BIN:-.gpu/bin/test-gpu_all_reduce}
# A subset that covers every kernel, dtype, world size 1..8, tails, graphs and the zero-copy
# path while keeping the slowed-down run to minutes.
filters=("$@")
[ ${#filters[@]} -eq 0 ] && filters=(edge_sizes one_shot_and_two_shot nan_and_inf in_place_all_reduce symmetric_in_place_replays bad_inputs)
rc=0
for tool in memcheck racecheck synccheck; do
  log="$OUT/sanitizer-$tool.log"
  : > "$log"
  for f in "${filters[@]}"; do
    compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
      "$bin" --include-ignored --test-threads=1 "$f" >> "$log" 2>&1
    code=$?
    [ $code -ne 0 ] && rc=1
    echo "$tool $f exit=$code $(grep -E 'ERROR SUMMARY|test result' "$log" | tail -2 | tr '\n' ' ')"
  done
done
exit $rc
