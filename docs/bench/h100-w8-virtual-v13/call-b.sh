#!/usr/bin/env bash
# Call B: the Python suite on this tree's wheel, then the Python bench beside symm-bench
# (eager host time), alternating, both pinned to the same two CPUs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1
set -u
T0=$SECONDS
L=$OUT/b; mkdir -p $L
[ -x .gpu/bin/bin-symm-bench ] || tar -xJf .gpux/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?"
python3 -c "import torch, symm_allreduce; print(torch.__version__, symm_allreduce.kernels_available())"
PIN="taskset -c 2,3"; $PIN true || PIN=""
echo "pin: '$PIN'" | tee -a $L/gpu.txt
for r in 1 2 3 4; do
  $PIN timeout 40 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager --csv $L/py-r$r.csv > $L/py-bench-r$r.log 2>&1; echo "py rc=$?"
  $PIN timeout 40 .gpu/bin/bin-symm-bench --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto --modes eager --out $L/rust-r$r > $L/rust-bench-r$r.log 2>&1; echo "rust rc=$?"
done
echo "bench t=$((SECONDS-T0))"
(cd python && timeout $((590-(SECONDS-T0))) python3 -m pytest -q -rs tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"; tail -4 $L/pytest.log
cd $OUT && tar czf b.tgz b && rm -rf b
echo "total t=$((SECONDS-T0))"
