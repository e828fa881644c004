#!/usr/bin/env bash
# Call 2: the landed fused low-latency kernel (variant D of call 1): its GPU suite, tp_decode
# with whole logs, and the Python fused tests on the wheel built from the same tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
L=$OUT/c2; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1; cat $L/gpu.txt
(python3 -m pip install --quiet --no-deps --force-reinstall .gpux2/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?" >> $L/pip.log) &
timeout 90 .gpux2/test-gpu_fused --test-threads=1 > $L/gpu_fused.log 2>&1; echo "gpu_fused rc=$? t=$((SECONDS-T0))"
grep -hE "^test |^test result|FAILED|panicked" $L/gpu_fused.log | head -20
for h in 4096 8192; do
  timeout 40 .gpux2/tp_decode --world 8 --hidden $h --batch 1,2,8,32 --steps 100 --layers 4 > $L/tp-h$h.log 2>&1; echo "tp h$h rc=$? t=$((SECONDS-T0))"
done
wait; cat $L/pip.log
timeout 120 python3 -m pytest -q -x python/tests/test_gpu.py -k "fused" > $L/pytest-fused.log 2>&1; echo "pytest fused rc=$? t=$((SECONDS-T0))"
tail -3 $L/pytest-fused.log
cat $L/tp-h4096.log $L/tp-h8192.log
tar -C $L -czf $OUT/c2.tgz . && rm -rf $L
echo "total t=$((SECONDS-T0))"
