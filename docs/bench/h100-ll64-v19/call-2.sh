#!/usr/bin/env bash
# Call 2 (run v19): the Python bench with the call-by-call pairing (py_minus_rust_interleaved_us)
# beside the round pairing, pinned to two CPUs, two rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1
set -u
T0=$SECONDS
L=$OUT/c2; mkdir -p $L
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?"
PIN="taskset -c 2,3"; $PIN true || PIN=""
for r in 1 2; do
  $PIN timeout 60 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/py-r$r.csv > $L/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  cat $L/py-r$r.log
done
