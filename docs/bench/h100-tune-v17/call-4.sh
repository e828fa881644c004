#!/usr/bin/env bash
# Call 4: the low-latency all-reduce with two words per thread where the message has up to twice
# as many words as the grid has threads (`new`, the staged tree) against the tree before it
# (`base`, .gpux/base-symm-bench: a 16-byte line per thread there), alternating, two rounds;
# odd sizes in the new path checked at every world; then the Rust GPU suites on the staged tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/c4; mkdir -p $L/ab $L/odd $L/suite
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
tar -xJf .gpux/gpu.tar.xz
tar -xJf .gpux/base.tar.xz -C .gpux
B=.gpu/bin
sb() {  # sb <name> <binary> <world> <args...>
  local name=$1 bin=$2 w=$3; shift 3
  [ $(left) -gt 40 ] || { echo "no time for $name"; return; }
  timeout 40 $bin --world $w --virtual --dtype bf16,f32 "$@" --out $L/$name > /dev/null 2> $L/$name.err \
    || echo "$name failed"
}
for r in 1 2; do
  for v in base new; do
    X=$B/bin-symm-bench; [ $v = base ] && X=.gpux/base-symm-bench
    sb ab/w8-$v-r$r $X 8 --sizes 16K,32K,40K,48K,64K,96K --algos auto,low_latency,one_shot --low-latency-max 128K --modes graph_amortised
    sb ab/w4-$v-r$r $X 4 --sizes 32K,64K,96K,128K,192K,256K --algos auto,low_latency,one_shot --modes graph_amortised
    sb ab/w2-$v-r$r $X 2 --sizes 64K,128K,192K,256K --algos auto,low_latency,one_shot --modes graph_amortised
  done
  echo "ab r$r t=$((SECONDS-T0))"
done
sb odd/w8 $B/bin-symm-bench 8 --sizes 32772,49998,65534 --algos low_latency --low-latency-max 128K --modes graph_amortised,graph_isolated,eager
sb odd/w4 $B/bin-symm-bench 4 --sizes 65540,99998,131070 --algos low_latency --modes graph_amortised,graph_isolated,eager
sb odd/w3 $B/bin-symm-bench 3 --sizes 90002,150002,180002 --algos low_latency --modes graph_amortised,graph_isolated,eager
sb odd/w2 $B/bin-symm-bench 2 --sizes 135172,199998,262140 --algos low_latency --modes graph_amortised,graph_isolated,eager
echo "odd t=$((SECONDS-T0))"
cd $OUT && tar czf c4a.tgz c4 && cd - > /dev/null
for n in gpu_all_reduce agreement protocol reliability gpu_pool gpu_collectives gpu_fused gpu_tuning multiprocess no_alloc multicast gpu_candle symm_allreduce; do
  t=$B/test-$n
  [ -x $t ] || { echo "missing $t"; continue; }
  [ $(left) -gt 15 ] || { echo "no time for $n"; continue; }
  timeout $(left) $t --test-threads=1 > $L/suite/test-$n.log 2>&1; echo "$n rc=$? t=$((SECONDS-T0))"
done
grep -hE "^test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf c4b.tgz c4/suite c4/gpu.txt; rm -rf c4
echo "total t=$((SECONDS-T0))"
