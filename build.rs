//! Compiles every `kernels/*.cu` (discovered, one translation unit) with nvcc into one fatbin
//! (sm_80 and sm_90 SASS plus compute_90 PTX by default; `SYMM_ALLREDUCE_ARCHS=80,90,...`
//! overrides the SASS targets) that the library embeds with `include_bytes!`. A source that
//! starts with `// symm: min-arch 90` is compiled only for targets of at least that
//! architecture. Also writes the compute_90 PTX and the `ptxas -v` report, which the tests
//! read to check memory-order scopes and spills. Flags in `CUDA_NVCC_FLAGS` that would break
//! bit-identical results (`--use_fast_math`, `--ftz=true`, ...) are a build error.
//!
//! Without nvcc the crate still builds: the three files are written empty, a cargo warning
//! says so, and every launch returns `Error::KernelsUnavailable` (the communicator also prints
//! one line to stderr at setup). The `require-kernels` cargo feature, or
//! `SYMM_ALLREDUCE_REQUIRE_KERNELS=1`, makes a missing or failing nvcc a build error:
//! applications should turn the feature on. `SYMM_ALLREDUCE_NO_KERNELS=1` builds that stub on
//! purpose, without looking for nvcc (for type-checking builds, e.g. `.ci/dependents.sh`);
//! asking for both is a build error.
//!
//! When the script runs again: on a change to the kernel sources, to any environment variable
//! that decides where nvcc is found (`PATH`, `NVCC`, `CUDA_HOME`, `CUDA_PATH`) or how it is
//! run, or to `.toolchain/` (where `scripts/install-nvcc.sh` installs nvcc). A stub build
//! also watches the nvcc paths it looked at that do not exist yet: cargo treats a watched
//! path that does not exist as changed, so a stub build re-runs its (cheap) search on every
//! build until nvcc appears, and then compiles the kernels without a `cargo clean`. A build
//! with kernels watches only the nvcc it used, so it is not redone needlessly.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "build/support.rs"]
mod support;

const KERNEL_DIR: &str = "kernels";
const NVTX_SHIM: &str = "kernels/nvtx_shim.c";
const LOCAL_NVCC: &str = ".toolchain/nvcc/nvidia/cu13/bin/nvcc";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(symm_kernels)");
    println!("cargo::rustc-check-cfg=cfg(symm_nvtx)");
    println!("cargo::rerun-if-changed={KERNEL_DIR}");
    println!("cargo::rerun-if-changed=build/support.rs");
    for v in [
        "PATH",
        "NVCC",
        "NVCC_CCBIN",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_NVCC_FLAGS",
        "DOCS_RS",
        "SYMM_ALLREDUCE_REQUIRE_KERNELS",
        "SYMM_ALLREDUCE_NO_KERNELS",
        "SYMM_ALLREDUCE_ARCHS",
        "CC",
    ] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The `require-kernels` feature, or the variable (CI, or a build you do not control).
    let require = env::var_os("CARGO_FEATURE_REQUIRE_KERNELS").is_some()
        || env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
    let skip = env::var("SYMM_ALLREDUCE_NO_KERNELS").is_ok_and(|v| v == "1");
    if require && skip {
        eprintln!(
            "error: SYMM_ALLREDUCE_REQUIRE_KERNELS=1 and SYMM_ALLREDUCE_NO_KERNELS=1 contradict each other"
        );
        std::process::exit(1);
    }
    // Settings that are wrong whether or not nvcc is present are errors, not a silent stub.
    let settings =
        support::reject_unsafe_flags(&env::var("CUDA_NVCC_FLAGS").unwrap_or_default()).and_then(|()| {
            env::var("SYMM_ALLREDUCE_ARCHS")
                .map_or(Ok(support::DEFAULT_ARCHS.to_vec()), |v| support::parse_archs(&v))
        });
    let archs = match settings {
        Ok(archs) => archs,
        Err(reason) => {
            eprintln!("error: {reason}");
            std::process::exit(1);
        }
    };

    let result = if env::var_os("DOCS_RS").is_some() {
        Err("building on docs.rs".to_string())
    } else if skip {
        Err("SYMM_ALLREDUCE_NO_KERNELS=1".to_string())
    } else {
        find_nvcc(&manifest)
            .ok_or_else(|| {
                "nvcc not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin, \
                 and .toolchain/nvcc from scripts/install-nvcc.sh)"
                    .to_string()
            })
            .and_then(|nvcc| compile(&nvcc, &manifest, &out, &archs))
    };
    match result {
        Ok(nvcc) => {
            // Rebuild when this nvcc is replaced (the variables above cover finding another).
            println!("cargo::rerun-if-changed={}", nvcc.display());
            println!("cargo::rustc-cfg=symm_kernels");
            println!("cargo::rustc-env=SYMM_ALLREDUCE_NVCC={}", nvcc.display());
            if let Err(reason) = build_nvtx(&nvcc, &manifest, &out) {
                println!("cargo::warning=symm-allreduce: NVTX ranges disabled ({reason})");
            }
        }
        Err(reason) => {
            if require {
                eprintln!(
                    "error: symm-allreduce: the CUDA kernels could not be built and they are required (the \
                     `require-kernels` feature or SYMM_ALLREDUCE_REQUIRE_KERNELS=1): {reason}. Install the CUDA \
                     toolkit (nvcc on PATH, or NVCC=/path/to/nvcc, or CUDA_HOME), or in a checkout of the crate \
                     run scripts/install-nvcc.sh; then build again."
                );
                std::process::exit(1);
            }
            println!(
                "cargo::warning=symm-allreduce: CUDA kernels not built ({reason}); every communicator will run \
                 without them (Error::KernelsUnavailable, or every call through NCCL). Put nvcc on PATH or set \
                 NVCC=/path/to/nvcc (or run scripts/install-nvcc.sh in a checkout) and build again; turn on the \
                 `require-kernels` feature to make this an error."
            );
            // Until nvcc appears: re-run the search on every build (cargo treats a watched
            // path that does not exist as changed), so installing it needs no `cargo clean`.
            println!(
                "cargo::rerun-if-changed={}",
                manifest.join(".toolchain").display()
            );
            println!("cargo::rerun-if-changed={}", manifest.join(LOCAL_NVCC).display());
            println!("cargo::rerun-if-changed=/usr/local/cuda/bin/nvcc");
            for f in ["kernels.fatbin", "kernels.ptx", "ptxas.txt"] {
                fs::write(out.join(f), b"").expect("OUT_DIR is writable");
            }
            println!("cargo::rustc-env=SYMM_ALLREDUCE_NVCC=");
        }
    }
}

fn find_nvcc(manifest: &Path) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("NVCC") {
        candidates.push(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            candidates.push(PathBuf::from(root).join("bin/nvcc"));
        }
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates.push(manifest.join(LOCAL_NVCC));
    candidates.into_iter().find(|p| p.is_file())
}

/// Every `kernels/*.cu`, sorted, with the architecture it needs.
fn kernel_sources(dir: &Path) -> Result<Vec<(String, support::Arch)>, String> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|e| e == "cu") {
            let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let arch = support::min_arch(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            found.push((path.display().to_string(), arch));
        }
    }
    found.sort();
    if found.is_empty() {
        return Err(format!("no .cu file in {}", dir.display()));
    }
    Ok(found)
}

fn compile(nvcc: &Path, manifest: &Path, out: &Path, archs: &[support::Arch]) -> Result<PathBuf, String> {
    let kernels = manifest.join(KERNEL_DIR);
    let source = out.join("kernels_all.cu");
    fs::write(&source, support::unity_source(&kernel_sources(&kernels)?)).map_err(|e| e.to_string())?;
    let mut common: Vec<String> = vec![
        "-O3".into(),
        "-std=c++17".into(),
        "-lineinfo".into(),
        format!("-I{}", kernels.display()),
    ];
    if let Ok(ccbin) = env::var("NVCC_CCBIN") {
        common.push(format!("-ccbin={ccbin}"));
    }
    if let Ok(flags) = env::var("CUDA_NVCC_FLAGS") {
        common.extend(flags.split_whitespace().map(str::to_string));
    }

    let fatbin = out.join("kernels.fatbin");
    let mut cmd = Command::new(nvcc);
    cmd.args(&common).args(["-fatbin", "-Xptxas", "-v"]);
    for arch in archs {
        cmd.arg("-gencode")
            .arg(format!("arch=compute_{arch},code=sm_{arch}"));
    }
    cmd.args(["-gencode", "arch=compute_90,code=compute_90"])
        .arg("-o")
        .arg(&fatbin)
        .arg(&source);
    let report = run(cmd)?;
    fs::write(out.join("ptxas.txt"), report).map_err(|e| e.to_string())?;

    let mut cmd = Command::new(nvcc);
    cmd.args(&common)
        .args(["-ptx", "-arch=compute_90", "-o"])
        .arg(out.join("kernels.ptx"))
        .arg(&source);
    run(cmd)?;
    Ok(nvcc.to_path_buf())
}

/// Compiles the NVTX shim with the host C compiler against the NVTX3 headers of the CUDA
/// installation nvcc belongs to, and links it statically (NVTX3 needs only libdl).
fn build_nvtx(nvcc: &Path, manifest: &Path, out: &Path) -> Result<(), String> {
    let root = nvcc
        .parent()
        .and_then(Path::parent)
        .ok_or("nvcc has no installation root")?;
    let include = [root.join("include"), root.join("targets/x86_64-linux/include")]
        .into_iter()
        .find(|d| d.join("nvtx3/nvToolsExt.h").is_file())
        .ok_or_else(|| format!("no nvtx3/nvToolsExt.h under {}", root.display()))?;
    // The cc crate honours CC, AR, CFLAGS and cross targets, and emits the link directives
    // for the static library itself.
    cc::Build::new()
        .file(manifest.join(NVTX_SHIM))
        .include(&include)
        .opt_level(2)
        .pic(true)
        .out_dir(out)
        .try_compile("symm_nvtx")
        .map_err(|e| e.to_string())?;
    println!("cargo::rustc-link-lib=dylib=dl");
    println!("cargo::rustc-cfg=symm_nvtx");
    Ok(())
}

/// Runs nvcc; returns its stderr (the ptxas report) on success.
fn run(mut cmd: Command) -> Result<String, String> {
    let output = cmd.output().map_err(|e| format!("could not run {cmd:?}: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!("{cmd:?} failed ({}):\n{stderr}", output.status));
    }
    Ok(stderr)
}
