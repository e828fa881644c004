#!/usr/bin/env bash
# The crate as a dependency of someone else's project (issue 16): `cargo check` of throwaway
# projects made in a temporary directory, so that cudarc's CUDA-version features are known to
# unify with the ways embedders select them.
#
#   (a) beside cudarc with `cuda-version-from-build-system` (what candle, mistral.rs and
#       candle-vllm select), with this crate's defaults;
#   (b) beside cudarc with an explicit `cuda-12040`, this crate with `default-features = false,
#       features = ["cuda-12040"]`;
#   (c) symm-bench from this workspace with `--no-default-features --features cuda-12040`.
#   (d) the crate as a git dependency (a `file://` clone of this checkout's HEAD) on a machine
#       without nvcc: with the `require-kernels` feature the build fails and says what to do;
#       without it the build succeeds, and the program sees `kernels_available() == false` and
#       the `KernelsUnavailable` message naming the fix; then `NVCC=...` and a plain rebuild
#       embed the kernels. The same clone as a path dependency: built without kernels, then
#       `scripts/install-nvcc.sh` in it and a plain rebuild embed them (no `cargo clean`).
#   (e) symm-allreduce-candle beside candle-core with `cuda`, used as candle's
#       llama_multiprocess example uses its NCCL `AllReduce` op: a row-parallel linear layer
#       that holds the op and applies it with `apply_op1_no_bwd`, the layer `Send + Sync`.
#       It checks into the workspace's ./target, so candle-kernels' CUDA build from
#       .ci/run's earlier steps is reused; it needs nvcc (scripts/install-nvcc.sh) and
#       CUDA_COMPUTE_CAP (default 90).
#
# (a)-(c) are type-checking only: SYMM_ALLREDUCE_NO_KERNELS=1 tells build.rs not to run nvcc
# (the kernels are compiled and checked by the rest of .ci/run). (d) builds and runs a small
# program (debug) and compiles the kernels twice; it needs the nvcc that .ci/run installed in
# .toolchain/ and is skipped, saying why, where an nvcc is installed system-wide
# (/usr/local/cuda), since "without nvcc" cannot be arranged there. The throwaway projects
# share one CARGO_TARGET_DIR under the temporary directory and start from this workspace's
# Cargo.lock.
#
#   bash .ci/dependents.sh           (from anywhere; needs crates.io or a warm cargo cache)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/symm-dependents.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

export CARGO_TARGET_DIR="$tmp/target"
export SYMM_ALLREDUCE_NO_KERNELS=1
unset SYMM_ALLREDUCE_REQUIRE_KERNELS

# A throwaway binary project: $1 = directory name, $2 = its [dependencies] lines.
make_project() {
    local dir="$tmp/$1"
    mkdir -p "$dir/src"
    cat > "$dir/Cargo.toml" <<EOF
[package]
name = "$1"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
$2

# Not part of any enclosing workspace.
[workspace]
EOF
    cat > "$dir/src/main.rs" <<'EOF'
// Uses the crate and its cudarc together, as an engine would: the types must be the same.
fn main() {
    let _cfg = symm_allreduce::Config::default();
    let ctx: Result<std::sync::Arc<cudarc::driver::CudaContext>, symm_allreduce::Error> =
        symm_allreduce::context(0);
    if let Err(e) = ctx {
        eprintln!("{e}");
    }
}
EOF
    cp "$repo/Cargo.lock" "$dir/Cargo.lock"
    echo "$dir"
}

step() {
    local name=$1
    shift
    local start=$SECONDS
    echo "--- dependents ($name): $*"
    "$@"
    echo "--- dependents ($name): ok in $((SECONDS - start)) s"
}

# (a) beside candle / mistral.rs: cudarc's features exactly as candle-core selects them.
a=$(make_project dep-from-build-system "\
cudarc = { version = \"0.19\", default-features = false, features = [\"std\", \"cublas\", \"cublaslt\", \"curand\", \"driver\", \"nvrtc\", \"f16\", \"f8\", \"cuda-version-from-build-system\", \"dynamic-linking\"] }
symm-allreduce = { path = \"$repo\" }")
step a cargo check --quiet --manifest-path "$a/Cargo.toml"

# (b) beside an explicit CUDA version, this crate's defaults off.
b=$(make_project dep-cuda-12040 "\
cudarc = { version = \"0.19\", default-features = false, features = [\"std\", \"driver\", \"nvrtc\", \"nccl\", \"f16\", \"fallback-dynamic-loading\", \"cuda-12040\"] }
symm-allreduce = { path = \"$repo\", default-features = false, features = [\"cuda-12040\"] }")
step b cargo check --quiet --manifest-path "$b/Cargo.toml"

# (c) symm-bench with another version, from the workspace (its own lock file, shared target).
step c cargo check --quiet --manifest-path "$repo/Cargo.toml" -p symm-bench --no-default-features \
    --features cuda-12040

# (d) a git dependency without nvcc, then with it; a path dependency before and after
# scripts/install-nvcc.sh.
unset SYMM_ALLREDUCE_NO_KERNELS
nvcc_here="$repo/.toolchain/nvcc/nvidia/cu13/bin/nvcc"
if [ -e /usr/local/cuda/bin/nvcc ]; then
    echo "--- dependents (d): skipped: /usr/local/cuda/bin/nvcc exists, so no build here lacks nvcc"
elif [ ! -x "$nvcc_here" ]; then
    echo "--- dependents (d): skipped: no $nvcc_here (run scripts/install-nvcc.sh first)"
else
    # PATH without any directory that holds an nvcc; no variable pointing at one.
    no_nvcc_path=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r d; do [ -n "$d" ] && [ ! -e "$d/nvcc" ] && printf '%s:' "$d"; done)
    no_nvcc=(env -u NVCC -u CUDA_HOME -u CUDA_PATH -u SYMM_ALLREDUCE_REQUIRE_KERNELS PATH="${no_nvcc_path%:}")
    src="$tmp/src"
    git clone --quiet --depth 1 "file://$repo" "$src"
    program='fn main() {
    if symm_allreduce::kernels_available() {
        println!("kernels: embedded");
    } else {
        println!("kernels: missing: {}", symm_allreduce::Error::KernelsUnavailable);
    }
}'
    dep_git="symm-allreduce = { git = \"file://$src\" }"
    g=$(make_project dep-git "$dep_git")
    printf '%s\n' "$program" > "$g/src/main.rs"
    expect() { # $1 = pattern, $2 = file: the pattern must be in the file
        grep -q -- "$1" "$2" || { echo "dependents (d): expected '$1' in:"; cat "$2"; exit 1; }
    }
    d_git() {
        # With require-kernels: a build error that names the fix.
        sed -i "s|^symm-allreduce = .*|symm-allreduce = { git = \"file://$src\", features = [\"require-kernels\"] }|" "$g/Cargo.toml"
        if "${no_nvcc[@]}" cargo build --quiet --manifest-path "$g/Cargo.toml" 2> "$tmp/d1.err"; then
            echo "dependents (d): require-kernels built without nvcc"; exit 1
        fi
        expect "could not be built and they are required" "$tmp/d1.err"
        expect "NVCC=/path/to/nvcc" "$tmp/d1.err"
        # Without it: builds; the program says what is missing and what to do.
        sed -i "s|^symm-allreduce = .*|$dep_git|" "$g/Cargo.toml"
        "${no_nvcc[@]}" cargo run --quiet --manifest-path "$g/Cargo.toml" > "$tmp/d2.out"
        expect "kernels: missing" "$tmp/d2.out"
        expect "git or registry dependency" "$tmp/d2.out"
        # nvcc named: a plain rebuild (no cargo clean) embeds the kernels.
        "${no_nvcc[@]}" NVCC="$nvcc_here" cargo run --quiet --manifest-path "$g/Cargo.toml" > "$tmp/d3.out"
        expect "kernels: embedded" "$tmp/d3.out"
    }
    step d-git d_git
    p=$(make_project dep-path "symm-allreduce = { path = \"$src\" }")
    printf '%s\n' "$program" > "$p/src/main.rs"
    d_path() {
        "${no_nvcc[@]}" cargo run --quiet --manifest-path "$p/Cargo.toml" > "$tmp/d4.out"
        expect "kernels: missing" "$tmp/d4.out"
        # What scripts/install-nvcc.sh leaves in the clone (here the copy .ci/run installed,
        # linked, so that nothing is downloaded twice; the script then finds it installed).
        ln -s "$repo/.toolchain" "$src/.toolchain"
        bash "$src/scripts/install-nvcc.sh"
        "${no_nvcc[@]}" cargo run --quiet --manifest-path "$p/Cargo.toml" > "$tmp/d5.out"
        expect "kernels: embedded" "$tmp/d5.out"
    }
    step d-path d_path
fi

# (e) the candle adapter in a candle engine's layer.
d="$tmp/dep-candle"
mkdir -p "$d/src"
cat > "$d/Cargo.toml" <<EOF
[package]
name = "dep-candle"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
candle-core = { version = "=0.11.1", features = ["cuda"] }
candle-nn = { version = "=0.11.1", features = ["cuda"] }
symm-allreduce-candle = { path = "$repo/symm-allreduce-candle" }

[workspace]
EOF
cat > "$d/src/main.rs" <<'EOF'
// A row-parallel linear layer as candle's llama_multiprocess example writes it, with the
// NCCL `AllReduce` CustomOp1 replaced by symm-allreduce-candle's.
use candle_core::{Result, Tensor};
use candle_nn::{Linear, Module};
use symm_allreduce_candle::{AllReduce, SymmComm};

struct TensorParallelRowLinear {
    linear: Linear,
    all_reduce: AllReduce,
}

impl TensorParallelRowLinear {
    fn new(linear: Linear, comm: &SymmComm) -> Self {
        Self { linear, all_reduce: AllReduce::new(comm) }
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.linear.forward(x)?;
        x.apply_op1_no_bwd(&self.all_reduce)
    }
}

// Engines keep layers in Send + Sync types (threads, Arc'd pipelines).
fn assert_send_sync<T: Send + Sync>() {}

fn main() -> Result<()> {
    assert_send_sync::<TensorParallelRowLinear>();
    let devices = [candle_core::Device::new_cuda_with_stream(0)?];
    let comms = SymmComm::local_group(&devices, symm_allreduce_candle::symm_allreduce::Config::default())?;
    let w = Tensor::ones((8, 8), candle_core::DType::F32, &devices[0])?;
    let layer = TensorParallelRowLinear::new(Linear::new(w, None), &comms[0]);
    let y = layer.forward(&Tensor::ones((1, 8), candle_core::DType::F32, &devices[0])?)?;
    println!("{y}");
    Ok(())
}
EOF
cp "$repo/Cargo.lock" "$d/Cargo.lock"
step e env CARGO_TARGET_DIR="$repo/target" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}" \
    cargo check --quiet --manifest-path "$d/Cargo.toml"

echo "dependents: every setup checks"
