#!/usr/bin/env bash
# Call 3: `symm-bench --tune` once the tuning sweep runs with the run's own configuration
# (every SM for virtual ranks, as a sweep), `Auto` under the table it wrote beside the forced
# algorithms, the Python suite on this tree's wheel, then two more rounds of the Python bench
# beside symm-bench (eager host time). Every step is skipped past LIMIT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/c3; mkdir -p $L/tune $L/auto $L/host
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/new.tar.xz -C .gpux
X=.gpux/new-symm-bench
python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$? t=$((SECONDS-T0))"
timeout 200 $X --tune $L/tune/virtual.json --world 8 --virtual --dtype bf16,f16,f32 --iters 40 \
  --out $L/tune/run > $L/tune/tune.log 2>&1; echo "tune rc=$? t=$((SECONDS-T0))"
if [ -f $L/tune/virtual.json ]; then
  for w in 8 4 2; do
    [ $(left) -gt 200 ] || { echo "no time for auto w$w"; break; }
    SYMM_ALLREDUCE_TUNING=$L/tune/virtual.json timeout 40 $X --world $w --virtual --dtype bf16,f32 \
      --sizes 8K,32K,64K,128K,256K,384K,512K,1M,2M,4M --algos auto,low_latency,one_shot,two_shot \
      --modes graph_amortised --out $L/auto/w$w > /dev/null 2> $L/auto/w$w.err || echo "auto w$w failed"
  done
  echo "auto t=$((SECONDS-T0))"
fi
cd $OUT && tar czf c3a.tgz c3 && cd - > /dev/null
if [ $(left) -gt 170 ]; then
  (cd python && timeout 160 python3 -m pytest -q -rs tests > $L/pytest.log 2>&1); echo "pytest rc=$? t=$((SECONDS-T0))"
  tail -4 $L/pytest.log
else echo "no time for pytest"; fi
PIN="taskset -c 2,3"; $PIN true || PIN=""
for r in 1 2; do
  [ $(left) -gt 30 ] || { echo "no time for host round $r"; break; }
  $PIN timeout 30 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/host/py-r$r.csv > $L/host/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  $PIN timeout 30 $X --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto \
    --modes eager --out $L/host/rust-r$r > $L/host/rust-r$r.log 2>&1; echo "rust r$r rc=$? t=$((SECONDS-T0))"
done
cd $OUT && tar czf c3b.tgz c3/pytest.log c3/host c3/pip.log; rm -rf c3
echo "total t=$((SECONDS-T0))"
