#!/usr/bin/env bash
# Call 2: the two-shot over the low-latency lines past the published low-latency threshold
# (`old`: the tree before the bound, .gpux/old-symm-bench; `new`: this tree), where a larger
# low-latency limit used to carry it at W = 8; what a larger limit and a larger capacity cost
# the small calls; then every Rust GPU suite on this tree. Every step is skipped past LIMIT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
set -u
T0=$SECONDS
LIMIT=${LIMIT:-570}
L=$OUT/c2; mkdir -p $L/exp $L/suite
left() { echo $((LIMIT-(SECONDS-T0))); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $L/gpu.txt 2>&1; nproc >> $L/gpu.txt
tar -xJf .gpux/gpu.tar.xz
[ -f .gpux/old.tar.xz ] && tar -xJf .gpux/old.tar.xz -C .gpux
B=.gpu/bin
sb() {  # sb <name> <binary> <args...>
  local name=$1 bin=$2; shift 2
  [ $(left) -gt 40 ] || { echo "no time for $name"; return; }
  timeout 40 $bin --world 8 --virtual --dtype bf16 --modes graph_amortised "$@" --out $L/exp/$name > /dev/null 2> $L/exp/$name.err \
    || echo "$name failed"
}
for r in 1 2; do
  for v in old new; do
    X=$B/bin-symm-bench; [ $v = old ] && X=.gpux/old-symm-bench
    sb ll-default-$v-r$r $X --sizes 8K,16K,32K --algos low_latency,one_shot
    sb ll-256k-$v-r$r $X --sizes 8K,16K,32K --algos low_latency,one_shot --low-latency-max 256K
    sb mid-default-$v-r$r $X --sizes 128K,384K,512K,1M --algos one_shot,two_shot
    sb mid-256k-$v-r$r $X --sizes 128K,384K,512K,1M --algos one_shot,two_shot --low-latency-max 256K
  done
  sb cap32m-new-r$r $B/bin-symm-bench --sizes 8K,32K,128K,1M,32M --algos auto,one_shot
  echo "exp r$r t=$((SECONDS-T0))"
done
cd $OUT && tar czf c2a.tgz c2 && cd - > /dev/null
for t in $B/test-*; do
  [ $(left) -gt 15 ] || { echo "no time for $t"; continue; }
  n=$(basename $t)
  timeout $(left) $t --test-threads=1 > $L/suite/$n.log 2>&1; echo "$n rc=$? t=$((SECONDS-T0))"
done
grep -hE "^test result|FAILED|panicked" $L/suite/*.log | sort | uniq -c | head -40
cd $OUT && tar czf c2b.tgz c2/suite; rm -rf c2
echo "total t=$((SECONDS-T0))"
