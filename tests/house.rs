//! The house rule on raw FFI, checked on the source tree (CPU only): C is called from three
//! rooms and nowhere else.

use std::path::{Path, PathBuf};

/// The only places that may call C: the driver tier, NCCL's `dlopen` table, and the launch.
const FFI_ROOMS: &[&str] = &["src/driver/", "src/nccl/library.rs", "src/kernels/launch.rs"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source tree") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Code of a line with `//` comments removed (string literals in this crate never hold `//`
/// followed by an FFI pattern).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// Whether `l` calls a function named `prefix` + an upper-case letter + more (`sys::cuMemMap(`),
/// as opposed to naming a type or a constant (`sys::CUdevice`, `sys::ncclComm_t`).
fn calls_symbol(l: &str, prefix: &str) -> bool {
    l.match_indices(prefix).any(|(i, _)| {
        let rest = &l[i + prefix.len()..];
        rest.chars().next().is_some_and(|c| c.is_ascii_uppercase())
            && rest
                .trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_')
                .starts_with('(')
    })
}

/// Whether a line calls into C: a driver function (`sys::cuXxx(`), cudarc's raw `result::`
/// API, a `dlopen`/`dlsym` (libloading), an NCCL symbol, or declares an `extern "C"` block.
fn calls_c(line: &str) -> Option<&'static str> {
    let l = code(line);
    let driver_call = calls_symbol(l, "sys::cu");
    if driver_call {
        return Some("a raw driver call (sys::cu…)");
    }
    if l.contains("result::launch_kernel") || l.contains("driver::result::") || l.contains("result::device::")
    {
        return Some("cudarc's raw result:: API");
    }
    if l.contains("libloading::Library::new") || l.contains(".get::<") || l.contains("dlsym") {
        return Some("dlopen/dlsym");
    }
    let nccl_call = calls_symbol(l, "sys::nccl");
    if nccl_call {
        return Some("an NCCL symbol call");
    }
    if l.contains("extern \"C\" {") {
        return Some("an extern \"C\" block");
    }
    None
}

#[test]
fn raw_ffi_lives_only_in_the_ffi_rooms() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut offences = Vec::new();
    let mut seen_in_rooms = 0;
    for f in &files {
        let rel = f.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
        let allowed = FFI_ROOMS.iter().any(|room| rel.starts_with(room));
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            if let Some(what) = calls_c(line) {
                if allowed {
                    seen_in_rooms += 1;
                } else {
                    offences.push(format!("{rel}:{}: {what}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        offences.is_empty(),
        "FFI outside {FFI_ROOMS:?}:\n{}",
        offences.join("\n")
    );
    // The check itself finds the calls where they belong (it is not vacuous).
    assert!(
        seen_in_rooms >= 20,
        "only {seen_in_rooms} FFI lines found in the FFI rooms"
    );
}

#[test]
fn the_detector_sees_each_kind_of_call() {
    for (line, expected) in [
        ("let c = unsafe { sys::cuMemCreate(&mut h, n, &p, 0) };", true),
        ("unsafe { result::launch_kernel(f, g, b, 0, s, p) }", true),
        ("let l = unsafe { libloading::Library::new(name) };", true),
        ("extern \"C\" {", true),
        (
            "sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
            false,
        ),
        ("// sys::cuMemCreate(&mut h) in a comment", false),
        ("let t: sys::ncclComm_t = std::ptr::null_mut();", false),
        ("code = sys::ncclAllReduce(a, b);", true),
    ] {
        assert_eq!(calls_c(line).is_some(), expected, "{line}");
    }
}

/// The crate paths a file names (`crate::config::x`, `use crate::{a, b::c}` gives `a`, `b`):
/// the first segment after `crate::`, from code lines only (comments stripped, so doc links
/// such as `[x](crate::y)` in `///` lines do not count).
fn crate_imports(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines().map(code) {
        for (i, _) in line.match_indices("crate::") {
            let rest = &line[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or("");
                found.extend(
                    inner
                        .split(',')
                        .map(|s| s.trim().split("::").next().unwrap_or("").to_string()),
                );
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                found.push(name);
            }
        }
    }
    found.retain(|s| !s.is_empty());
    found
}

/// Data flows one way: the shared rooms, the kernel ABI and the configuration import nothing
/// above them, so config, plan, the ABI and the error type form no circle (docs/design.md,
/// "What each room may import").
#[test]
fn the_lower_rooms_import_nothing_above_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // (file or folder, the crate modules it may name)
    let rules: &[(&str, &[&str])] = &[
        ("src/error.rs", &["dtype", "error"]),
        ("src/digest.rs", &[]),
        ("src/dtype.rs", &["dtype"]),
        ("src/kernels/abi.rs", &["error", "digest", "dtype", "kernels"]),
        ("src/kernels/norm_abi.rs", &[]),
        ("src/kernels/registry.rs", &["dtype", "kernels", "error"]),
        (
            "src/config.rs",
            &["config", "kernels", "wire", "dtype", "digest", "error"],
        ),
        (
            "src/config/",
            &["config", "kernels", "wire", "dtype", "digest", "error"],
        ),
    ];
    let mut offences = Vec::new();
    let mut named = 0;
    for (place, allowed) in rules {
        let mut files = Vec::new();
        let path = root.join(place);
        if path.is_dir() {
            rust_files(&path, &mut files);
        } else {
            files.push(path);
        }
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            for m in crate_imports(&text) {
                named += 1;
                if !allowed.contains(&m.as_str()) {
                    offences.push(format!(
                        "{} imports crate::{m}",
                        f.strip_prefix(root).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(
        offences.is_empty(),
        "imports that run back up:\n{}",
        offences.join("\n")
    );
    assert!(named >= 10, "only {named} crate paths found: the scan is broken");
}

#[test]
fn crate_imports_are_read_from_code() {
    let got = crate_imports(
        "use crate::{dtype::DType, error::Error};\nlet h = crate::digest::fnv1a(x);\n/// [`A`](crate::plan::A)\n",
    );
    assert_eq!(got, ["dtype", "error", "digest"]);
}
