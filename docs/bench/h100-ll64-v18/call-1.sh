#!/usr/bin/env bash
# Call 1 (run v18): the published low-latency threshold of W > 4 at 64 KiB and the tuning
# table's two-shot band over the low-latency lines, on one GPU with virtual ranks.
#  - `symm-bench --tune` of this tree (the table committed under docs/tuning);
#  - `Auto` under that table beside the forced algorithms, W = 8, 4, 2;
#  - W = 8 before / after without a table: `--low-latency-max 32K` is the threshold before
#    (and the two-shot's bound with it), the default the threshold after; two rounds;
#    the forced low-latency kernel past 64 KiB; the forced two-shot at 96–256 KiB (its bound
#    moves with the threshold); the all-gather and reduce-scatter likewise;
#  - the README's sweep (W = 8) and the W = 4 / W = 2 sweeps, bf16 and f32, both graph modes;
#  - the Rust GPU suites that route by size (every step below is skipped past LIMIT);
#  - tp_decode at batch 1, 8, 32: hidden 4096 with the whole GPU's SMs, the old threshold
#    through a tuning table that holds it (old.json) against the default; hidden 4096 and
#    8192 with the library's SM share;
#  - the Python bench beside symm-bench (eager host time), pinned to two CPUs, two rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/c1; mkdir -p $L/tune $L/auto $L/ab $L/coll $L/sweep $L/tp $L/host
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
B=.gpu/bin; X=$B/bin-symm-bench; TP=$B/example-tp_decode
OLD=docs/bench/h100-ll64-v18/old.json
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
  echo "auto t=$((SECONDS-T0))"
fi
for r in 1 2; do
  sb ab/w8-old-r$r 8 --dtype bf16,f32 --sizes 32K,48K,64K,96K,128K --algos auto --low-latency-max 32K --modes graph_amortised,graph_isolated
  sb ab/w8-new-r$r 8 --dtype bf16,f32 --sizes 32K,48K,64K,96K,128K --algos auto --modes graph_amortised,graph_isolated
done
sb ab/w8-ts-old 8 --dtype bf16,f32 --sizes 96K,128K,192K,256K --algos two_shot --low-latency-max 32K --modes graph_amortised
sb ab/w8-ts-new 8 --dtype bf16,f32 --sizes 96K,128K,192K,256K --algos two_shot --modes graph_amortised
sb ab/w8-forced 8 --dtype bf16,f32 --sizes 48K,64K,80K,96K,128K --algos low_latency,one_shot --low-latency-max 128K --modes graph_amortised
sb coll/old 8 --dtype bf16 --sizes 64K,128K,256K,384K,512K,768K --collectives all_gather,reduce_scatter --low-latency-max 32K --modes graph_amortised
sb coll/new 8 --dtype bf16 --sizes 64K,128K,256K,384K,512K,768K --collectives all_gather,reduce_scatter --modes graph_amortised
echo "ab t=$((SECONDS-T0))"
sb sweep/w8 8 --dtype bf16 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto,one_shot,two_shot,pool --modes graph_amortised,graph_isolated
sb sweep/w8-f32 8 --dtype f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
sb sweep/w4 4 --dtype bf16,f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
sb sweep/w2 2 --dtype bf16,f32 --sizes 1K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated
echo "sweep t=$((SECONDS-T0))"
cd $OUT && tar czf c1a.tgz c1 && cd - > /dev/null
mkdir -p $L/suite
for n in gpu_all_reduce gpu_collectives gpu_pool gpu_tuning gpu_fused agreement; do
  [ $(left) -gt 150 ] || { echo "no time for $n"; continue; }
  timeout $(( $(left) - 120 )) $B/test-$n --test-threads=1 > $L/suite/test-$n.log 2>&1; echo "$n rc=$? t=$((SECONDS-T0))"
done
grep -hE "^test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf c1s.tgz c1/suite && cd - > /dev/null
tp() {  # tp <name> <extra args...>
  local name=$1; shift
  [ $(left) -gt 60 ] || { echo "no time for $name"; return; }
  timeout 60 $TP --world 8 --batch 1,8,32 --steps 100 --layers 4 "$@" > $L/tp/$name.log 2>&1; echo "$name rc=$? t=$((SECONDS-T0))"
}
SYMM_ALLREDUCE_TUNING=$OLD tp old-h4096-sm100 --hidden 4096 --shared-sm-percent 100
tp new-h4096-sm100 --hidden 4096 --shared-sm-percent 100
for h in 4096 8192; do
  tp new-h$h --hidden $h
done
cd $OUT && tar czf c1b.tgz c1/tp && cd - > /dev/null
wait; cat $L/pip.log
PIN="taskset -c 2,3"; $PIN true || PIN=""
for r in 1 2; do
  [ $(left) -gt 35 ] || { echo "no time for host round $r"; break; }
  $PIN timeout 40 python3 -m symm_allreduce.bench --world 8 --dtype bf16 --sizes 8K,32K,512K,8M --modes eager \
    --csv $L/host/py-r$r.csv > $L/host/py-r$r.log 2>&1; echo "py r$r rc=$? t=$((SECONDS-T0))"
  $PIN timeout 30 $X --world 8 --virtual --dtype bf16 --sizes 8K,32K,512K,8M --algos auto \
    --modes eager --out $L/host/rust-r$r > $L/host/rust-r$r.log 2>&1; echo "rust r$r rc=$? t=$((SECONDS-T0))"
done
cd $OUT && tar czf c1c.tgz c1/host c1/pip.log c1/gpu.txt; rm -rf c1
echo "total t=$((SECONDS-T0))"
