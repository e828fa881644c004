#!/usr/bin/env bash
# Call B: the fused call at W = 2 and 4 (tp_decode, half the SMs for the collectives: clusters
# for several rows), the Python suite on this tree's wheel, the Python bench beside symm-bench.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1
set -u
T0=$SECONDS
L=$OUT/b; mkdir -p $L/tp $L/py
[ -x .gpu/bin/bin-symm-bench ] || tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?"
for w in 2 4; do
  for h in 8192 4096; do
    timeout 60 $B/example-tp_decode --world $w --hidden $h --batch 1,2,4,8 --steps 100 --layers 4 \
      --shared-sm-percent 50 > $L/tp/w$w-h$h.log 2>&1 || echo "tp fail $w $h"
  done
done
grep -E 'path at|alone per call:' $L/tp/*.log | head -20
echo "tp t=$((SECONDS-T0))"
(cd python && timeout $((560-(SECONDS-T0))) python3 -m pytest -q -rs tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"; tail -4 $L/pytest.log
PIN="taskset -c 2,3"; $PIN true || PIN=""
echo "pin: '$PIN'" | tee -a $L/gpu.txt
for r in 1 2 3; do
  [ $((SECONDS-T0)) -lt 520 ] || break
  $PIN timeout 30 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager --csv $L/py/py-r$r.csv > $L/py/py-bench-r$r.log 2>&1; echo "py rc=$?"
  $PIN timeout 30 $B/bin-symm-bench --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto --modes eager --out $L/py/rust-r$r > $L/py/rust-bench-r$r.log 2>&1; echo "rust rc=$?"
done
cd $OUT && tar czf b.tgz b && rm -rf b
echo "total t=$((SECONDS-T0))"
