#!/usr/bin/env bash
# Call 1 (run v19): the published W > 4 low-latency threshold at 64 KiB, with the two-shot over
# the low-latency lines bounded by its own 32 KiB above four ranks (W = 8 calls to 128 KiB):
#  - `symm-bench --tune` (W = 8, 4, 2 × bf16 / f16 / f32): the table committed under docs/tuning;
#  - `Auto` under that table beside the forced algorithms, W = 8, 4, 2, bf16 and f32;
#  - `Auto` without a table (the published thresholds) around the sizes they moved, W = 8;
#  - the README's sweep at W = 8 (two rounds) and at W = 4 and 2;
#  - the Rust GPU suites that route by size; the Python GPU tests;
#  - tp_decode at batch 1, 8, 32 (hidden 4096 and 8192, the library's SM share);
#  - the Python bench beside symm-bench (eager host time), pinned to two CPUs, two rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-575}
L=$OUT/c1; mkdir -p $L/tune $L/auto $L/pub $L/sweep $L/suite $L/tp $L/host
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin; X=$B/bin-symm-bench; TP=$B/example-tp_decode
(python3 -m pip install --quiet --no-deps --force-reinstall .gpux/wheels/symm_allreduce-*.whl > $L/pip.log 2>&1; echo "pip rc=$?" >> $L/pip.log) &
sb() {  # sb <name> <world> <args...>
  local name=$1 w=$2; shift 2
  [ $(left) -gt 40 ] || { echo "no time for $name"; return; }
  timeout 40 $X --world $w --virtual "$@" --out $L/$name > /dev/null 2> $L/$name.err || echo "$name failed"
}
timeout 200 $X --tune $L/tune/virtual.json --world 8 --virtual --dtype bf16,f16,f32 --iters 40 \
  --out $L/tune/run > $L/tune/tune.log 2>&1; echo "tune rc=$? t=$((SECONDS-T0))"
if [ -f $L/tune/virtual.json ]; then
  for w in 8 4 2; do
    SYMM_ALLREDUCE_TUNING=$L/tune/virtual.json sb auto/w$w $w --dtype bf16,f32 \
      --sizes 8K,32K,48K,64K,96K,128K,256K,384K,512K,768K,1M,2M,4M --algos auto,low_latency,one_shot,two_shot \
      --modes graph_amortised
  done
fi
sb pub/w8 8 --dtype bf16,f32 --sizes 32K,48K,64K,80K,96K,128K,192K,256K --algos auto,one_shot,two_shot --modes graph_amortised
echo "auto t=$((SECONDS-T0))"
for r in 1 2; do
  sb sweep/w8-r$r 8 --dtype bf16 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto,one_shot,two_shot,pool --modes graph_amortised,graph_isolated
done
sb sweep/w8-f32 8 --dtype f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
sb sweep/w4 4 --dtype bf16,f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
sb sweep/w2 2 --dtype bf16,f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
echo "sweep t=$((SECONDS-T0))"
cd $OUT && tar czf c1a.tgz c1 && cd - > /dev/null
for n in gpu_all_reduce gpu_collectives gpu_pool gpu_tuning gpu_fused agreement; do
  [ $(left) -gt 200 ] || { echo "no time for $n"; continue; }
  timeout $(( $(left) - 180 )) $B/test-$n --test-threads=1 > $L/suite/test-$n.log 2>&1; echo "$n rc=$? t=$((SECONDS-T0))"
done
grep -hE "^test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf c1s.tgz c1/suite && cd - > /dev/null
for h in 4096 8192; do
  [ $(left) -gt 150 ] || { echo "no time for tp $h"; continue; }
  timeout 45 $TP --world 8 --hidden $h --batch 1,8,32 --steps 100 --layers 4 > $L/tp/h$h.log 2>&1; echo "tp h$h rc=$? t=$((SECONDS-T0))"
done
wait; cat $L/pip.log
PIN="taskset -c 2,3"; $PIN true || PIN=""
for r in 1 2; do
  [ $(left) -gt 75 ] || { echo "no time for host round $r"; break; }
  $PIN timeout 40 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/host/py-r$r.csv > $L/host/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  $PIN timeout 30 $X --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto \
    --modes eager --out $L/host/rust-r$r > $L/host/rust-r$r.log 2>&1; echo "rust r$r rc=$? t=$((SECONDS-T0))"
done
cat $L/host/py-r1.log $L/host/py-r2.log
cd $OUT && tar czf c1b.tgz c1/tp c1/host c1/pip.log && cd - > /dev/null
if [ $(left) -gt 60 ]; then
  (cd python && timeout $(( $(left) - 15 )) python3 -m pytest -q -x tests > $L/pytest.log 2>&1; echo "pytest rc=$? t=$((SECONDS-T0))")
  tail -5 $L/pytest.log
fi
cd $OUT && tar czf c1c.tgz c1/pytest.log 2>/dev/null; rm -rf c1
echo "total t=$((SECONDS-T0))"
