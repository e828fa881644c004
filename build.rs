//! Compiles `kernels/*.cu` with nvcc into one fatbin (sm_80 and sm_90 SASS plus compute_90
//! PTX) that the library embeds with `include_bytes!`. Also writes the compute_90 PTX and
//! the `ptxas -v` report, which the tests read to check memory-order scopes and spills.
//!
//! Without nvcc the crate still builds: the three files are written empty, a cargo warning
//! says so, and every launch returns `Error::KernelsUnavailable`. Set
//! `SYMM_ALLREDUCE_REQUIRE_KERNELS=1` to make a missing or failing nvcc a build error (CI).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: &[&str] = &[
    "kernels/all_reduce.cu",
    "kernels/primitives.cuh",
    "kernels/signals.cuh",
];
const MAIN_SOURCE: &str = "kernels/all_reduce.cu";
const NVTX_SHIM: &str = "kernels/nvtx_shim.c";
const LOCAL_NVCC: &str = ".toolchain/nvcc/nvidia/cu13/bin/nvcc";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(symm_kernels)");
    println!("cargo::rustc-check-cfg=cfg(symm_nvtx)");
    println!("cargo:rerun-if-changed={NVTX_SHIM}");
    for s in SOURCES {
        println!("cargo:rerun-if-changed={s}");
    }
    for v in [
        "NVCC",
        "NVCC_CCBIN",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_NVCC_FLAGS",
        "DOCS_RS",
        "SYMM_ALLREDUCE_REQUIRE_KERNELS",
        "CC",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    if manifest.join(".toolchain/nvcc").is_dir() {
        println!("cargo:rerun-if-changed={}", manifest.join(LOCAL_NVCC).display());
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let require = env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").is_ok_and(|v| v == "1");

    let result = if env::var_os("DOCS_RS").is_some() {
        Err("building on docs.rs".to_string())
    } else {
        find_nvcc(&manifest)
            .ok_or_else(|| {
                "nvcc not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin, \
                 and .toolchain/nvcc from scripts/install-nvcc.sh)"
                    .to_string()
            })
            .and_then(|nvcc| compile(&nvcc, &manifest, &out))
    };
    match result {
        Ok(nvcc) => {
            println!("cargo:rustc-cfg=symm_kernels");
            println!("cargo:rustc-env=SYMM_ALLREDUCE_NVCC={}", nvcc.display());
            if let Err(reason) = build_nvtx(&nvcc, &manifest, &out) {
                println!("cargo:warning=symm-allreduce: NVTX ranges disabled ({reason})");
            }
        }
        Err(reason) => {
            if require {
                eprintln!("error: SYMM_ALLREDUCE_REQUIRE_KERNELS=1 but the CUDA kernels could not be built: {reason}");
                std::process::exit(1);
            }
            println!(
                "cargo:warning=symm-allreduce: CUDA kernels not built ({reason}); every launch will return \
                 Error::KernelsUnavailable. Run scripts/install-nvcc.sh or set NVCC=/path/to/nvcc."
            );
            for f in ["kernels.fatbin", "kernels.ptx", "ptxas.txt"] {
                fs::write(out.join(f), b"").expect("OUT_DIR is writable");
            }
            println!("cargo:rustc-env=SYMM_ALLREDUCE_NVCC=");
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

fn compile(nvcc: &Path, manifest: &Path, out: &Path) -> Result<PathBuf, String> {
    let source = manifest.join(MAIN_SOURCE);
    let mut common: Vec<String> = vec!["-O3".into(), "-std=c++17".into(), "-lineinfo".into()];
    if let Ok(ccbin) = env::var("NVCC_CCBIN") {
        common.push(format!("-ccbin={ccbin}"));
    }
    if let Ok(flags) = env::var("CUDA_NVCC_FLAGS") {
        common.extend(flags.split_whitespace().map(str::to_string));
    }

    let fatbin = out.join("kernels.fatbin");
    let mut cmd = Command::new(nvcc);
    cmd.args(&common)
        .args(["-fatbin", "-Xptxas", "-v"])
        .args(["-gencode", "arch=compute_80,code=sm_80"])
        .args(["-gencode", "arch=compute_90,code=sm_90"])
        .args(["-gencode", "arch=compute_90,code=compute_90"])
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
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-cfg=symm_nvtx");
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
