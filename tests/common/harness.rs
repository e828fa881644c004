//! The test runner of the GPU test files: `libtest-mimic` trials (`harness = false` in
//! Cargo.toml), so that a GPU test that cannot run is reported as *ignored, with its
//! reason* instead of passing silently, and the run ends with one line saying how many GPU
//! tests ran and how many were skipped. Under `REQUIRE_GPU=1` a missing GPU (or NCCL, for
//! the tests that need it) is a failure instead.
//!
//! A test file lists its tests with the macros below, which take the name from the
//! function itself, so a test's name in the summary is always its own:
//!
//! ```ignore
//! fn main() -> std::process::ExitCode {
//!     common::harness::run("gpu_all_reduce", vec![gpu_test!(in_place_matches), cpu_test!(parses)])
//! }
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use symm_allreduce::cudarc::driver::CudaContext;

/// What a test needs before its body can run.
pub enum Test {
    /// Runs on any machine.
    Cpu(&'static str, fn()),
    /// Device 0 with the kernels loaded; the harness creates the context.
    Gpu(&'static str, fn(Arc<CudaContext>)),
    /// Like `Gpu`, but the context keeps cudarc's defaults: event tracking stays ON.
    GpuTracked(&'static str, fn(Arc<CudaContext>)),
    /// A GPU and the kernels, without a CUDA context in this process (the test starts rank
    /// processes that create their own).
    GpuProcesses(&'static str, fn()),
    /// A GPU, the kernels, and an NCCL that both loaders find.
    GpuAndNccl(&'static str, fn(Arc<CudaContext>)),
}

/// A test that runs on any machine.
#[macro_export]
macro_rules! cpu_test {
    ($f:ident) => {
        $crate::common::harness::Test::Cpu(stringify!($f), $f)
    };
}

/// A test that needs device 0 with the kernels; the function takes its context.
#[macro_export]
macro_rules! gpu_test {
    ($f:ident) => {
        $crate::common::harness::Test::Gpu(stringify!($f), $f)
    };
}

/// A test that needs device 0 with the kernels, on a context with cudarc's event tracking
/// left on (cudarc's default); the function takes its context.
#[macro_export]
macro_rules! gpu_tracked_test {
    ($f:ident) => {
        $crate::common::harness::Test::GpuTracked(stringify!($f), $f)
    };
}

/// A test that needs a GPU but starts rank processes instead of creating a context.
#[macro_export]
macro_rules! gpu_processes_test {
    ($f:ident) => {
        $crate::common::harness::Test::GpuProcesses(stringify!($f), $f)
    };
}

/// A test that needs device 0 with the kernels and NCCL; the function takes the context.
#[macro_export]
macro_rules! gpu_nccl_test {
    ($f:ident) => {
        $crate::common::harness::Test::GpuAndNccl(stringify!($f), $f)
    };
}

/// Whether `REQUIRE_GPU=1`: a GPU test that cannot run fails instead of being skipped.
pub fn gpu_required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Why GPU tests cannot run here (without creating a CUDA context), or `None` if they can.
pub fn gpu_missing() -> Option<String> {
    match symm_allreduce::device_count() {
        Ok(0) => Some("no CUDA device is visible".to_string()),
        Ok(_) if symm_allreduce::kernels_available() => None,
        Ok(_) => Some("the kernels were not compiled into this build (no nvcc)".to_string()),
        Err(e) => Some(e.to_string()),
    }
}

/// Device 0 with cudarc's event tracking off, or why there is none.
pub fn gpu_context() -> Result<Arc<CudaContext>, String> {
    if let Some(reason) = gpu_missing() {
        return Err(reason);
    }
    let ctx = symm_allreduce::context(0).map_err(|e| e.to_string())?;
    // SAFETY: tests pass raw pointers to kernels and capture graphs; cudarc's per-slice
    // events are not wanted (and are not capturable across streams).
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// Device 0 as cudarc makes it by default (event tracking on), or why there is none.
pub fn gpu_context_tracked() -> Result<Arc<CudaContext>, String> {
    if let Some(reason) = gpu_missing() {
        return Err(reason);
    }
    let ctx = symm_allreduce::context(0).map_err(|e| e.to_string())?;
    if !ctx.is_event_tracking() {
        return Err("cudarc made a context without event tracking".to_string());
    }
    Ok(ctx)
}

/// Why NCCL cannot be used here through both loaders (this crate's and cudarc's), or `None`.
pub fn nccl_missing() -> Option<String> {
    match symm_allreduce::nccl_library() {
        // SAFETY: only loads the library to see whether it is there.
        Ok(_) if unsafe { symm_allreduce::cudarc::nccl::sys::is_culib_present() } => None,
        Ok(info) => Some(format!(
            "NCCL is {} but cudarc cannot load it under its names",
            info.name
        )),
        Err(e) => Some(e.to_string()),
    }
}

/// Counts of the GPU tests that ran and the distinct reasons of those that could not.
#[derive(Default)]
struct Tally {
    ran: AtomicUsize,
    /// Tests that failed under REQUIRE_GPU=1 because they could not run.
    refused: AtomicUsize,
    reasons: Mutex<Vec<String>>,
}

impl Tally {
    /// A skip (ignored, with the reason) or, under REQUIRE_GPU=1, a failure.
    fn cannot_run(&self, reason: String) -> Result<Completion, Failed> {
        if gpu_required() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!("REQUIRE_GPU=1 but this test cannot run: {reason}").into());
        }
        let mut reasons = self.reasons.lock().unwrap_or_else(|p| p.into_inner());
        if !reasons.contains(&reason) {
            reasons.push(reason.clone());
        }
        Ok(Completion::ignored_with(reason))
    }

    fn ran(&self) -> Result<Completion, Failed> {
        self.ran.fetch_add(1, Ordering::Relaxed);
        Ok(Completion::Completed)
    }
}

/// GPU tests run one at a time, whatever `--test-threads` says. Every test builds groups of
/// virtual ranks that share device 0, and each group sizes its grids to fill the device: two
/// groups running at once can keep each other's blocks from becoming resident, and their
/// barriers then time out (README, "Ranks sharing a GPU"). CPU tests still run in parallel.
static ONE_GPU_TEST: Mutex<()> = Mutex::new(());

fn one_gpu_test_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    // A failed test poisons the lock; the next one runs all the same.
    ONE_GPU_TEST.lock().unwrap_or_else(|p| p.into_inner())
}

/// A GPU trial: `body` runs holding the one-GPU-test lock.
fn gpu_trial(
    name: &'static str,
    body: impl FnOnce() -> Result<Completion, Failed> + Send + 'static,
) -> (Trial, bool) {
    let trial = Trial::ignorable_test(name, move || {
        let _gpu = one_gpu_test_at_a_time();
        body()
    });
    (trial, true)
}

/// Runs `f` on the context, or reports why there is none.
fn with_context(
    t: &Tally,
    ctx: Result<Arc<CudaContext>, String>,
    f: fn(Arc<CudaContext>),
) -> Result<Completion, Failed> {
    match ctx {
        Ok(ctx) => {
            f(ctx);
            t.ran()
        }
        Err(reason) => t.cannot_run(reason),
    }
}

fn trial(test: Test, tally: &Arc<Tally>) -> (Trial, bool) {
    let t = tally.clone();
    match test {
        Test::Cpu(name, f) => (
            Trial::test(name, move || {
                f();
                Ok(())
            }),
            false,
        ),
        Test::Gpu(name, f) => gpu_trial(name, move || with_context(&t, gpu_context(), f)),
        Test::GpuTracked(name, f) => gpu_trial(name, move || with_context(&t, gpu_context_tracked(), f)),
        Test::GpuProcesses(name, f) => gpu_trial(name, move || match gpu_missing() {
            None => {
                f();
                t.ran()
            }
            Some(reason) => t.cannot_run(reason),
        }),
        Test::GpuAndNccl(name, f) => gpu_trial(name, move || {
            let ctx = gpu_context().and_then(|ctx| nccl_missing().map_or(Ok(ctx), Err));
            with_context(&t, ctx, f)
        }),
    }
}

/// Runs `tests` with the command line's filters and options, then prints how many GPU tests
/// of `file` ran and how many were skipped, and why.
pub fn run(file: &str, tests: Vec<Test>) -> ExitCode {
    let args = Arguments::from_args();
    let tally = Arc::new(Tally::default());
    let mut gpu_selected = 0usize;
    let trials: Vec<Trial> = tests
        .into_iter()
        .map(|t| {
            let (trial, gpu) = trial(t, &tally);
            if gpu && !args.is_filtered_out(&trial) && !args.is_ignored(&trial) {
                gpu_selected += 1;
            }
            trial
        })
        .collect();
    let list = args.list;
    let conclusion = libtest_mimic::run(&args, trials);
    if !list && gpu_selected > 0 {
        let ran = tally.ran.load(Ordering::Relaxed);
        let reasons = tally.reasons.lock().unwrap_or_else(|p| p.into_inner());
        let skipped = conclusion.num_ignored as usize;
        let refused = tally.refused.load(Ordering::Relaxed);
        if refused > 0 {
            println!("{file}: GPU tests: {ran} of {gpu_selected} ran, {refused} FAILED because REQUIRE_GPU=1 and they cannot run\n");
        } else if skipped == 0 {
            println!("{file}: GPU tests: {ran} of {gpu_selected} ran, 0 skipped\n");
        } else {
            println!(
                "{file}: GPU tests: {ran} of {gpu_selected} ran, {skipped} SKIPPED ({}); this was not a GPU run \
                 (REQUIRE_GPU=1 makes a missing GPU a failure)\n",
                reasons.join("; ")
            );
        }
    }
    conclusion.exit_code()
}
