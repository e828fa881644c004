//! The sm_90 SASS of the embedded fatbin, disassembled by cuobjdump (with nvdisasm beside it)
//! from `.toolchain/cuobjdump` (installed by `scripts/install-nvcc.sh`) or the path in
//! `SYMM_ALLREDUCE_CUOBJDUMP`. Without the tool the SASS checks skip with a printed reason;
//! with `SYMM_ALLREDUCE_REQUIRE_KERNELS=1` (CI, which installs it) they fail instead.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// One kernel's SASS: its name and its instructions in address order (`(address, text)`,
/// the text without the trailing `;` and encoding).
pub struct Function {
    pub name: String,
    pub instructions: Vec<(u64, String)>,
}

impl Function {
    /// The opcode of instruction `i` (its predicate dropped), e.g. `LDG.E.64.STRONG.SYS`.
    pub fn opcode(&self, i: usize) -> &str {
        let text = self.instructions[i].1.as_str();
        let text = match text.strip_prefix('@') {
            Some(rest) => rest.split_once(' ').map_or("", |(_, r)| r.trim_start()),
            None => text,
        };
        text.split_whitespace().next().unwrap_or_default()
    }

    /// Indices of the instructions whose opcode starts with `prefix`.
    pub fn find(&self, prefix: &str) -> Vec<usize> {
        (0..self.instructions.len())
            .filter(|&i| self.opcode(i).starts_with(prefix))
            .collect()
    }
}

fn cuobjdump() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SYMM_ALLREDUCE_CUOBJDUMP") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.toolchain/cuobjdump/nvidia/cu13/bin/cuobjdump"
    ));
    p.exists().then_some(p)
}

/// Parses `cuobjdump -sass` output.
fn parse(text: &str) -> Vec<Function> {
    let mut out: Vec<Function> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            out.push(Function {
                name: name.trim().to_string(),
                instructions: Vec::new(),
            });
            continue;
        }
        // `        /*0070*/                   ACQBULK ;   /* 0x000000000000782e */`
        let t = line.trim_start();
        let Some(rest) = t.strip_prefix("/*") else {
            continue;
        };
        let Some((addr, body)) = rest.split_once("*/") else {
            continue;
        };
        let Ok(addr) = u64::from_str_radix(addr, 16) else {
            continue;
        };
        let body = body.split("/*").next().unwrap_or_default().trim();
        let body = body.trim_end_matches(';').trim();
        if body.is_empty() {
            continue;
        }
        if let Some(f) = out.last_mut() {
            f.instructions.push((addr, body.to_string()));
        }
    }
    out
}

/// The sm_90 SASS of every kernel, or `None` (printed) when cuobjdump is not installed.
pub fn sm90_or_skip(test: &str) -> Option<&'static [Function]> {
    static SASS: OnceLock<Option<Vec<Function>>> = OnceLock::new();
    let sass = SASS.get_or_init(|| {
        let tool = cuobjdump()?;
        let dir = std::env::temp_dir().join(format!("symm-sass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let fatbin = dir.join("kernels.fatbin");
        std::fs::write(&fatbin, symm_allreduce::embedded_fatbin()).expect("write the fatbin");
        let bin = tool.parent().expect("cuobjdump's directory").to_path_buf();
        let out = Command::new(&tool)
            .args(["-sass", "-arch", "sm_90"])
            .arg(&fatbin)
            .env("NVDISASM_PATH", &bin)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", tool.display()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "cuobjdump failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(parse(&String::from_utf8_lossy(&out.stdout)))
    });
    if sass.is_none() {
        let required = std::env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "{test}: no cuobjdump (run scripts/install-nvcc.sh, or set SYMM_ALLREDUCE_CUOBJDUMP)"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIP {test}: no cuobjdump for the SASS (scripts/install-nvcc.sh installs it)"
        );
    }
    sass.as_deref()
}
