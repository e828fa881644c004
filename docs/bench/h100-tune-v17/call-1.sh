#!/usr/bin/env bash
# Call 1: the Python bench beside symm-bench (eager host time, alternating rounds, both pinned to
# the same two CPUs; the first process on the machine is a Python one), `symm-bench --tune` with
# the current kernels, then the Python suite on this tree's wheel (PYTEST=0: without it). Every step is skipped past LIMIT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/c1; mkdir -p $L/host $L/tune
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$? t=$((SECONDS-T0))"
PIN="taskset -c 2,3"; $PIN true || PIN=""
echo "pin: '$PIN'" | tee -a $L/gpu.txt
for r in 1 2 3 4; do
  [ $(left) -gt 300 ] || { echo "no time for host round $r"; break; }
  $PIN timeout 60 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/host/py-r$r.csv > $L/host/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  $PIN timeout 60 $B/bin-symm-bench --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto \
    --modes eager --out $L/host/rust-r$r > $L/host/rust-r$r.log 2>&1; echo "rust r$r rc=$? t=$((SECONDS-T0))"
done
if [ $(left) -gt 200 ]; then
  timeout 150 $B/bin-symm-bench --tune $L/tune/virtual.json --world 8 --virtual --dtype bf16,f16,f32 --iters 40 \
    --out $L/tune/run > $L/tune/tune.log 2>&1; echo "tune rc=$? t=$((SECONDS-T0))"
else echo "no time for tune"; fi
cd $OUT && tar czf c1a.tgz c1 && cd - > /dev/null
if [ "${PYTEST:-1}" = 1 ] && [ $(left) -gt 60 ]; then
  (cd python && timeout $(( $(left) - 10 )) python3 -m pytest -q -rs tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"
  tail -4 $L/pytest.log
else echo "no pytest"; fi
cd $OUT && tar czf c1b.tgz c1/pytest.log c1/gpu.txt; rm -rf c1
echo "total t=$((SECONDS-T0))"
