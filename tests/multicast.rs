//! Multicast (NVLS) on this project's machines, which must never create a multicast object:
//! the GPU test uses the real driver only for the device attribute query (through a probe whose
//! every other entry point refuses without calling the driver, so it cannot create an object
//! even on a machine that supports multicast), then checks what the communicator reports.
//! The CPU test keeps the multicast creation calls out of everything that runs on those
//! machines (tests, benches, examples, the benchmark).
//!
//! Run by [`common::harness`] (`harness = false`).

mod common;

use std::path::Path;
use std::sync::Arc;

use symm_allreduce::cudarc::driver::CudaContext;
use symm_allreduce::{Algorithm, Communicator, Config, DType, Error, Multicast};

/// The veto variable this process has set, if any (every command on the GPU machines exports
/// them), by the crate's own list.
fn veto_in_environment() -> Option<&'static str> {
    symm_allreduce::__MULTICAST_VETOES
        .iter()
        .find_map(|(name, values)| {
            let v = std::env::var(name).ok()?.trim().to_ascii_lowercase();
            values.contains(&v.as_str()).then_some(*name)
        })
}

fn the_device_reports_no_multicast_and_describe_says_why(ctx: Arc<CudaContext>) {
    // 1. The real attribute query (and nothing else can be reached from the probe).
    let (attribute, sentence) = symm_allreduce::__multicast_probe(ctx.ordinal(), 2).unwrap();
    assert!(
        !attribute,
        "device {} reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 1: this check expects the \
         project's single-GPU machine (attribute 0) and stops here without going further",
        ctx.ordinal()
    );
    assert!(
        sentence.starts_with("off (") && sentence.contains("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"),
        "{sentence}"
    );
    assert!(sentence.contains("multicast eligibility"), "{sentence}");

    // 2. Communicators asking for multicast. The attribute is 0 (checked above), so even
    // without the veto variables nothing past the attribute query can run.
    let expected = veto_in_environment().unwrap_or("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0");
    let contexts = vec![ctx.clone(), ctx.clone()];
    let auto = Config {
        capacity_bytes: 8 << 20,
        multicast: Multicast::Auto,
        reproducible: false,
        ..Config::default()
    };
    let comms = Communicator::local_group(&contexts, auto.clone()).unwrap();
    for c in &comms {
        assert!(!c.has_multicast());
        let why = c.multicast_unavailable().unwrap();
        assert!(why.contains(expected), "{why}");
        let report = c.describe();
        assert!(
            report.contains(&format!("multicast (NVLS): off ({why})")),
            "{report}"
        );
        // The symmetric call stays on the peer in-place kernel and says why.
        let p = c.symmetric_path((4 << 20) / 2, DType::BF16).unwrap();
        assert_eq!(p.algorithm, Algorithm::TwoShot, "{p}");
        assert!(
            p.reason.contains("multimem off") && p.reason.contains(expected),
            "{p}"
        );
        // The buffer path never names a multimem kernel (low-latency, one-shot and two-shot
        // ranges), and forcing one is refused with the reason, before anything is launched.
        let multimem = [
            Algorithm::Multimem,
            Algorithm::MultimemOneShot,
            Algorithm::MultimemLowLatency,
        ];
        for bytes in [1024usize, 64 << 10, 256 << 10, 1 << 20] {
            let p = c.path(bytes / 2, DType::BF16, Algorithm::Auto).unwrap();
            assert!(!multimem.contains(&p.algorithm), "{p}");
        }
        let stream = ctx.new_stream().unwrap();
        let input = stream.alloc_zeros::<half::bf16>(1000).unwrap();
        let mut output = stream.alloc_zeros::<half::bf16>(1000).unwrap();
        for a in [Algorithm::MultimemOneShot, Algorithm::MultimemLowLatency] {
            match c.path(1000, DType::BF16, a) {
                Err(Error::MulticastUnavailable { reason }) => assert!(reason.contains(expected), "{reason}"),
                other => panic!("{a} without multicast: {other:?}"),
            }
            match c.all_reduce_with(&input, &mut output, &stream, a) {
                Err(Error::MulticastUnavailable { reason }) => assert!(reason.contains(expected), "{reason}"),
                other => panic!("{a} without multicast: {other:?}"),
            }
        }
        c.check_usable().unwrap();
        println!("rank {}: {why}", c.rank());
    }
    // The collective close (every rank, over a bootstrap of the same ranks).
    let hub = symm_allreduce::LocalHub::new(comms.len(), std::time::Duration::from_secs(30));
    std::thread::scope(|s| {
        for (rank, c) in comms.into_iter().enumerate() {
            let hub = hub.rank(rank);
            s.spawn(move || c.close(&hub).unwrap());
        }
    });

    // 3. Required: a typed error naming the reason, on every rank.
    match Communicator::local_group(
        &contexts,
        Config {
            multicast: Multicast::Required,
            ..auto.clone()
        },
    ) {
        Err(Error::MulticastUnavailable { reason }) => assert!(reason.contains(expected), "{reason}"),
        other => panic!("Required without multicast: {other:?}"),
    }

    // 4. Off (the default): no multicast step at all, and describe says so.
    let comms = Communicator::local_group(&contexts, Config::default()).unwrap();
    for c in &comms {
        assert_eq!(c.multicast_unavailable(), Some("Config::multicast is Off"));
        assert!(c
            .describe()
            .contains("multicast (NVLS): off (Config::multicast is Off)"));
    }
}

/// The names of the calls that create or populate a multicast object, assembled so that this
/// file does not contain them either.
fn forbidden() -> Vec<String> {
    ["Create", "BindMem", "AddDevice"]
        .iter()
        .map(|s| format!("cuMulticast{s}"))
        .collect()
}

fn scan(dir: &Path, out: &mut Vec<String>, patterns: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            scan(&path, out, patterns);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            for p in patterns {
                if text.contains(p.as_str()) {
                    out.push(format!("{}: {p}", path.display()));
                }
            }
        }
    }
}

fn nothing_that_runs_on_the_gpu_machines_names_the_multicast_creation_calls() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let patterns = forbidden();
    let mut found = Vec::new();
    for dir in ["tests", "benches", "examples", "symm-bench", "bench"] {
        scan(&root.join(dir), &mut found, &patterns);
    }
    assert!(
        found.is_empty(),
        "multicast creation calls outside src/driver/: {found:?}"
    );
    // The scan is not vacuous: the real implementation does name them, in src/driver/ only.
    let mut in_src = Vec::new();
    scan(&root.join("src"), &mut in_src, &patterns);
    assert!(!in_src.is_empty());
    assert!(
        in_src.iter().all(|f| f.contains("src/driver/multicast.rs")),
        "{in_src:?}"
    );
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "multicast",
        vec![
            gpu_test!(the_device_reports_no_multicast_and_describe_says_why),
            cpu_test!(nothing_that_runs_on_the_gpu_machines_names_the_multicast_creation_calls),
        ],
    )
}
