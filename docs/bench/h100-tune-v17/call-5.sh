#!/usr/bin/env bash
# Call 5: the two-words-per-thread path of the low-latency all-reduce as landed (`new2`, the
# staged tree: the one-word path's code as before, the two-word path its own branch) against
# the first form (`new1`, .gpux/new1-symm-bench: one branch for both) and the tree before
# (`base`, .gpux/base-symm-bench), alternating, two rounds; odd sizes in every path; then the
# Rust GPU suites that reach the low-latency kernel, on the staged tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-400}
L=$OUT/c5; mkdir -p $L/ab $L/odd $L/suite
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
tar -xJf .gpux/gpu.tar.xz
tar -xJf .gpux/base.tar.xz -C .gpux
tar -xJf .gpux/new1.tar.xz -C .gpux
B=.gpu/bin
sb() {  # sb <name> <binary> <world> <args...>
  local name=$1 bin=$2 w=$3; shift 3
  [ $(left) -gt 40 ] || { echo "no time for $name"; return; }
  timeout 40 $bin --world $w --virtual --dtype bf16,f32 "$@" --out $L/$name > /dev/null 2> $L/$name.err \
    || echo "$name failed"
}
for r in 1 2; do
  for v in base new1 new2; do
    X=$B/bin-symm-bench; [ $v = base ] && X=.gpux/base-symm-bench; [ $v = new1 ] && X=.gpux/new1-symm-bench
    sb ab/w8-$v-r$r $X 8 --sizes 4K,8K,16K,32K,48K,64K --algos auto --low-latency-max 128K --modes graph_amortised
    sb ab/w4-$v-r$r $X 4 --sizes 8K,32K,64K,128K --algos auto --modes graph_amortised
    sb ab/w2-$v-r$r $X 2 --sizes 8K,64K,128K,256K --algos auto --modes graph_amortised
  done
  echo "ab r$r t=$((SECONDS-T0))"
done
sb odd/w8 $B/bin-symm-bench 8 --sizes 30002,32772,49998,65534,70002 --algos low_latency --low-latency-max 128K --modes graph_amortised,graph_isolated,eager
sb odd/w4 $B/bin-symm-bench 4 --sizes 65540,99998,131070,140002 --algos low_latency --modes graph_amortised,graph_isolated,eager
sb odd/w3 $B/bin-symm-bench 3 --sizes 90002,150002,180002 --algos low_latency --modes graph_amortised,graph_isolated,eager
sb odd/w2 $B/bin-symm-bench 2 --sizes 135172,199998,262140 --algos low_latency --modes graph_amortised,graph_isolated,eager
echo "odd t=$((SECONDS-T0))"
cd $OUT && tar czf c5a.tgz c5 && cd - > /dev/null
for n in gpu_all_reduce gpu_candle agreement protocol reliability gpu_pool gpu_fused; do
  t=$B/test-$n
  [ $(left) -gt 15 ] || { echo "no time for $n"; continue; }
  timeout $(left) $t --test-threads=1 > $L/suite/test-$n.log 2>&1; echo "$n rc=$? t=$((SECONDS-T0))"
done
grep -hE "^test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -30
cd $OUT && tar czf c5b.tgz c5/suite c5/gpu.txt; rm -rf c5
echo "total t=$((SECONDS-T0))"
