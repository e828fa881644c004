#!/usr/bin/env bash
# Builds every test, bench, example and binary of the workspace in release mode on this
# machine (no GPU needed, nvcc needed: scripts/install-nvcc.sh) and stages them in .gpu/ so
# that one command on a GPU machine runs them all:
#
#   bash scripts/gpu-stage.sh [cargo build flags...]     e.g. --features cuda-12080
#   (copy the repository with .gpu/ to the GPU machine; .gpu/ is git-ignored)
#   bash .gpu/run.sh                                     on the GPU machine
#
# .gpu/run.sh exports the multicast vetoes (this crate never creates NVLink multicast
# objects, and nothing it runs may), sets REQUIRE_GPU=1 so that a GPU test that cannot run
# fails instead of skipping, runs every staged test binary one test at a time (each log also
# goes to $OUT/<binary>.log, default /tmp/out), then .gpu/after.sh if there is one (write
# your benchmark or profiling commands there, e.g. `.gpu/bin/bin-symm-bench --quick` or
# `.gpu/bin/bench-host_overhead --bench`).
# It exits non-zero when any test binary or after.sh failed.
#
# The device tool carries at most 64 MiB of ignored files; the staged tree is larger. With
# GPU_STAGE_PACK=1 the script also packs .gpu/ (symbols stripped) into .gpux/gpu.tar.xz:
# carry `.gpux` and run `tar -xJf .gpux/gpu.tar.xz && bash .gpu/run.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
export SYMM_ALLREDUCE_REQUIRE_KERNELS="${SYMM_ALLREDUCE_REQUIRE_KERNELS:-1}"

rm -rf .gpu
mkdir -p .gpu/bin
{
    cargo build --release --workspace --exclude symm-allreduce-candle --tests --benches --examples --bins \
        --message-format=json "$@"
    # The candle adapter in its own invocation (candle's cudarc features must not reach the
    # core crate's binaries: docs/design.md, "The candle adapter"), for sm_90, linked against
    # the stand-ins of scripts/cuda-link-stubs.sh: the GPU machine's CUDA libraries have the
    # same SONAMEs.
    (
        export PATH="$PWD/.toolchain/nvcc/nvidia/cu13/bin:$PATH"
        export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
        stubs=$(bash scripts/cuda-link-stubs.sh)
        export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
        cargo build --release -p symm-allreduce-candle --tests --examples --message-format=json
    )
} | python3 -c '
import json, os, shutil, sys
staged = set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-message":
        sys.stderr.write(m["message"].get("rendered") or "")
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m["target"]["kind"][0]
    if kind != "bench" and m["profile"]["test"]:
        kind = "test"  # unit tests of the lib and bins, and the tests/ files
    dst = ".gpu/bin/%s-%s" % (kind, m["target"]["name"])
    if dst in staged:
        # A library and a binary of the same name: keep both apart.
        dst += "-" + m["package_id"].split("#")[-1].split("@")[0].replace("/", "_")
    staged.add(dst)
    shutil.copy2(m["executable"], dst)
    print("staged %s (%d KiB)" % (dst, os.path.getsize(dst) // 1024), file=sys.stderr)
if not staged:
    sys.exit("gpu-stage: cargo produced no executables")
'
# Debug info off: the staged tree is carried to the GPU machine.
for f in .gpu/bin/*; do
    strip --strip-debug "$f" 2>/dev/null || true
done

cat > .gpu/run.sh <<'RUN'
#!/usr/bin/env bash
# Made by scripts/gpu-stage.sh. Runs on the GPU machine, from anywhere.
# Never enable NVLink multicast (NVLS): not in NCCL, torch or NVSHMEM, not here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -o pipefail
# A GPU test that cannot run is a failure, not a skip.
export REQUIRE_GPU=1 RUST_BACKTRACE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
for t in .gpu/bin/test-*; do
    [ -x "$t" ] || continue
    echo "=== $t"
    if ! "$t" --test-threads=1 2>&1 | tee "$OUT/$(basename "$t").log"; then
        rc=1
        echo "FAILED: $t"
    fi
done
if [ -f .gpu/after.sh ]; then
    echo "=== .gpu/after.sh"
    bash .gpu/after.sh || rc=1
fi
echo "gpu run exit: $rc"
exit $rc
RUN
chmod +x .gpu/run.sh
echo "staged: $(ls .gpu/bin | wc -l) binaries, $(du -sh .gpu | cut -f1); on the GPU machine: bash .gpu/run.sh"
if [ "${GPU_STAGE_PACK:-0}" = 1 ]; then
    for f in .gpu/bin/*; do
        strip --strip-unneeded "$f" 2>/dev/null || true
    done
    mkdir -p .gpux
    # One xz stream with a 64 MiB dictionary: every binary embeds the same fatbin, so the
    # copies after the first cost almost nothing (31 binaries: 23 MiB, against 61 MiB with -6).
    tar -cf - .gpu | xz -T1 -9 > .gpux/gpu.tar.xz
    size=$(stat -c %s .gpux/gpu.tar.xz)
    echo "packed: .gpux/gpu.tar.xz, $((size >> 20)) MiB (carry .gpux; there: tar -xJf .gpux/gpu.tar.xz && bash .gpu/run.sh)"
    if [ "$size" -gt $((64 << 20)) ]; then
        echo "gpu-stage: the pack is over the 64 MiB the device tool carries" >&2
        exit 1
    fi
fi
