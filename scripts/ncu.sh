#!/usr/bin/env bash
# Nsight Compute over symm-bench's kernels, with the card's clocks left alone, then a summary
# of achieved DRAM bandwidth per kernel.
#
#   bash scripts/ncu.sh [path/to/symm-bench] [extra symm-bench flags]
#
# ncu serialises kernels to read counters, so ranks that wait for each other inside a kernel
# would only time out under it: the profile runs ONE rank (--world 1), which still exercises
# the whole data path of each kernel (fused copy-in, 16-byte loads, fp32 sums, stores).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench=${1:-target/release/symm-bench}; shift || true
csv="$OUT/ncu.csv"
ncu --clock-control none --nvtx --kernel-name regex:"symm_(one|two|in)" --launch-count 12 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
    --csv --page raw \
    "$bench" --world 1 --sizes 64M --dtype bf16 --algos one_shot,two_shot --modes eager --iters 2 --out "$OUT/ncu-bench" "$@" \
    > "$csv"
python3 "$(dirname "$0")/ncu_summary.py" "$csv" | tee "$OUT/ncu-summary.txt"
# The NVTX ranges the crate opens around each collective (ncu injects NVTX with --nvtx).
grep -o 'symm all_reduce[^",]*' "$csv" | sort | uniq -c | head -20 || true
