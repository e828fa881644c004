#!/usr/bin/env bash
# The follow-up on the same warm machine (after call.sh): three more rounds of the two-shot
# A/B, a second tp_decode round at batch 1, and the W = 8 and W = 4 sweeps, new and old.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1
tar -xJf .gpux/bench-at-commits.tar.xz; xz -dkf .gpux/tp-old.xz; chmod +x .gpux/tp-old
L=$OUT/c; mkdir -p $L/twoshot $L/logs $L/sweep; B=.gpu/bin
declare -A SB=([old]=.gpux/at/ad00aae [new]=$B/bin-symm-bench); T0=$SECONDS
for r in 3 4 5; do for v in new old; do for w in 2 4 8; do
  timeout 30 ${SB[$v]} --world $w --virtual --dtype bf16 --sizes 1M,4M --algos two_shot --modes graph_amortised --out $L/twoshot/w$w-r$r-$v >/dev/null 2>&1 || echo fail
done; done; done
for h in 8192 4096; do for v in new old; do
  X=$B/example-tp_decode; [ $v = old ] && X=.gpux/tp-old
  timeout 30 $X --world 8 --hidden $h --batch 1 --steps 100 --layers 4 > $L/logs/tp-$v-h$h-r2.log 2>&1
done; done
for w in 8 4; do for v in new old; do
  [ $((SECONDS-T0)) -lt 110 ] || break 2
  timeout 40 ${SB[$v]} --world $w --virtual --dtype bf16,f32 --sizes 1K,4K,8K,32K,64K,128K,256K,512K,1M,4M --algos auto --modes graph_amortised,graph_isolated --out $L/sweep/r1-w$w-$v >/dev/null 2>&1 || echo sfail
done; done
cd $OUT && tar czf c.tgz c && rm -rf c
