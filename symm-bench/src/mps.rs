//! NVIDIA MPS (Multi-Process Service) for `--launcher processes` with several rank processes
//! on one GPU: whether a daemon serves this run, and `--mps`, a private daemon for the run.
//!
//! With MPS the rank processes share the GPU's SMs at once, so a run with more ranks than
//! GPUs is a timing of that sharing; without it the GPU time-slices the processes (about 2 ms
//! per barrier) and the run only checks the path. The private daemon lives in a fresh
//! temporary directory (`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`), which the
//! launcher hands to its rank processes, and is stopped with `quit` when the run ends
//! (docs/multiprocess.md).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where MPS clients look for the daemon.
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Where the daemon writes its logs.
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// The pipe directory when `CUDA_MPS_PIPE_DIRECTORY` is unset.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
const CONTROL: &str = "nvidia-cuda-mps-control";

/// The pipe directory a CUDA client of this environment uses.
pub fn pipe_dir(env: impl Fn(&str) -> Option<String>) -> PathBuf {
    env(PIPE_ENV)
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR), PathBuf::from)
}

/// One line for the header: whether an MPS control daemon answers in `dir` (its `control`
/// pipe exists). A daemon owned by another user, or one that refuses clients, is not seen.
pub fn describe(dir: &Path) -> String {
    if dir.join("control").exists() {
        format!("MPS: on (control daemon at {})", dir.display())
    } else {
        format!("MPS: off (no control daemon at {})", dir.display())
    }
}

/// Whether the MPS control pipe exists in `dir`.
pub fn is_on(dir: &Path) -> bool {
    dir.join("control").exists()
}

/// A private MPS control daemon, stopped on drop.
pub struct Daemon {
    root: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts `nvidia-cuda-mps-control -d` with pipe and log directories in a fresh
    /// temporary directory and waits (at most 10 s) for its control pipe.
    pub fn start() -> Result<Daemon, String> {
        let root = std::env::temp_dir().join(format!("symm-bench-mps.{}", std::process::id()));
        let (pipe, log) = (root.join("pipe"), root.join("log"));
        for d in [&pipe, &log] {
            std::fs::create_dir_all(d).map_err(|e| format!("--mps: cannot create {}: {e}", d.display()))?;
        }
        let daemon = Daemon { root, pipe, log };
        let status = daemon
            .control()
            .arg("-d")
            .status()
            .map_err(|e| format!("--mps: cannot run {CONTROL} ({e}); it comes with the NVIDIA driver"))?;
        if !status.success() {
            return Err(format!(
                "--mps: {CONTROL} -d failed ({status}); see {}",
                daemon.log.display()
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !is_on(&daemon.pipe) {
            if Instant::now() > deadline {
                return Err(format!(
                    "--mps: the daemon did not open {} within 10 s; see {}",
                    daemon.pipe.join("control").display(),
                    daemon.log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(daemon)
    }

    /// The environment the rank processes need to reach this daemon.
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [(PIPE_ENV, &self.pipe), (LOG_ENV, &self.log)]
    }

    fn control(&self) -> Command {
        let mut c = Command::new(CONTROL);
        c.env(PIPE_ENV, &self.pipe).env(LOG_ENV, &self.log);
        c
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let quit = self
            .control()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .and_then(|mut c| {
                if let Some(mut stdin) = c.stdin.take() {
                    stdin.write_all(b"quit\n")?;
                }
                c.wait()
            });
        match quit {
            Ok(s) if s.success() => {
                // The server exits shortly after `quit`; its pipe goes with it.
                let deadline = Instant::now() + Duration::from_secs(10);
                while is_on(&self.pipe) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = std::fs::remove_dir_all(&self.root);
            }
            other => eprintln!(
                "symm-bench: could not stop the private MPS daemon ({other:?}); stop it with \
                 `echo quit | {PIPE_ENV}={} {CONTROL}`",
                self.pipe.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipe_directory_follows_the_environment() {
        assert_eq!(pipe_dir(|_| None), PathBuf::from(DEFAULT_PIPE_DIR));
        assert_eq!(pipe_dir(|_| Some(String::new())), PathBuf::from(DEFAULT_PIPE_DIR));
        assert_eq!(
            pipe_dir(|k| (k == PIPE_ENV).then(|| "/x/p".into())),
            PathBuf::from("/x/p")
        );
    }

    #[test]
    fn a_control_pipe_means_on() {
        let dir = std::env::temp_dir().join(format!("symm-bench-mps-test.{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!is_on(&dir));
        assert!(describe(&dir).starts_with("MPS: off"));
        std::fs::write(dir.join("control"), b"").unwrap();
        assert!(is_on(&dir));
        assert!(describe(&dir).starts_with("MPS: on"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
