#!/usr/bin/env bash
# Builds symm-bench at each given commit and packs the binaries for one GPU call, so that a
# speed difference between commits can be timed side by side in the same run (and bisected):
#
#   bash scripts/bench-at-commits.sh 9ca53d2 54a0c94 HEAD
#   (carry .gpux to the GPU machine; there:)
#   tar -xJf .gpux/bench-at-commits.tar.xz
#   for b in .gpux/at/*; do $b --world 2 --virtual --dtype bf16 --sizes 1K,128K \
#       --algos low_latency,one_shot --modes graph_amortised --out out-$(basename $b); done
#
# Each commit is checked out in a temporary git worktree and built in release mode into one
# target directory of its own (target/at-commits: dependencies are built once; the main
# target directory, whose kernel build outputs a worktree build would replace, is not
# touched). Binaries are named by their short commit, stripped, and packed with xz into
# .gpux/bench-at-commits.tar.xz (git-ignored; the device tool carries up to 64 MiB; one xz
# stream with a 64 MiB dictionary: eleven commits in 11 MiB). Needs the pinned nvcc
# (scripts/install-nvcc.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 COMMIT..." >&2; exit 2; }
root=$PWD
export PATH="$root/.toolchain/nvcc/nvidia/cu13/bin:$PATH"
export SYMM_ALLREDUCE_REQUIRE_KERNELS=1
export CARGO_TARGET_DIR="$root/target/at-commits"
work=$(mktemp -d)
trap 'for w in "$work"/*; do git -C "$root" worktree remove --force "$w" >/dev/null 2>&1 || true; done; rm -rf "$work"' EXIT
rm -rf .gpux/at
mkdir -p .gpux/at
for commit in "$@"; do
    short=$(git rev-parse --short "$commit")
    tree="$work/$short"
    git worktree add --detach "$tree" "$commit" >/dev/null
    # The worktree finds the pinned nvcc where build.rs looks for it.
    ln -s "$root/.toolchain" "$tree/.toolchain"
    (cd "$tree" && cargo build --release -p symm-bench --quiet)
    cp "$CARGO_TARGET_DIR/release/symm-bench" ".gpux/at/$short"
    strip --strip-unneeded ".gpux/at/$short"
    echo "built .gpux/at/$short ($commit)"
done
tar -cf - .gpux/at | xz -T1 -9 > .gpux/bench-at-commits.tar.xz
rm -rf .gpux/at
echo "packed .gpux/bench-at-commits.tar.xz ($(($(stat -c %s .gpux/bench-at-commits.tar.xz) >> 20)) MiB)"
