#!/usr/bin/env bash
# Call 5 of run v21: the protocol suite (refused and poisoned fused low-latency calls) on the landed kernel,
# and tp_decode at batch 3 and 4, where the plan now gives each row a block of its own.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1
T0=$SECONDS; L=$OUT/c3; mkdir -p $L
timeout 60 .gpux2/test-protocol --test-threads=1 > $L/protocol.log 2>&1; echo "protocol rc=$? t=$((SECONDS-T0))"
grep -hE "^test |^test result|panicked" $L/protocol.log
for h in 4096 8192; do
  timeout 30 .gpux2/tp_decode --world 8 --hidden $h --batch 3,4 --steps 100 --layers 4 > $L/tp-b34-h$h.log 2>&1; echo "tp h$h rc=$? t=$((SECONDS-T0))"
  grep -E "^batch|path at|forced|alone per call|per all-reduce \+" $L/tp-b34-h$h.log
done
tar -C $L -czf $OUT/c3.tgz . && rm -rf $L
