//! The setup decisions reach an application's `tracing` subscriber: the peer kernels (on,
//! with their block counts), the NCCL fallback (none, and why; or on), the multicast object
//! (off, and the veto that decided it: every GPU command here exports NCCL_NVLS_ENABLE=0),
//! and a `setup` span per rank. GPU only (a communicator needs a device); the events'
//! fields without a GPU are covered by the unit tests of src/events.rs and the fake-driver
//! multicast tests.

mod common;

mod support {
    pub mod recorder;
}

use std::sync::{Arc, OnceLock};

use support::recorder::{self, Recorded};
use symm_allreduce::cudarc::driver::CudaContext;
use symm_allreduce::{Algorithm, Communicator, Config, LocalHub, Multicast, TRACING_TARGET};

/// One global subscriber for the whole binary (the ranks are threads).
fn recorded() -> &'static Recorded {
    static SEEN: OnceLock<Recorded> = OnceLock::new();
    SEEN.get_or_init(|| {
        let (subscriber, seen) = recorder::subscriber();
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
        seen
    })
}

fn clear(seen: &Recorded) {
    seen.events.lock().unwrap().clear();
    seen.spans.lock().unwrap().clear();
}

fn a_local_group_reports_peer_kernels_no_fallback_and_the_multicast_veto(ctx: Arc<CudaContext>) {
    let seen = recorded();
    clear(seen);
    // The GPU machine's commands export it; set it here too so the veto is what decides.
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let world = 2;
    // Auto asks for multicast; the veto refuses it before any multicast driver call.
    let config = Config {
        multicast: Multicast::Auto,
        ..Config::default()
    };
    let comms = Communicator::local_group(&vec![ctx; world], config).expect("local_group");
    let peer = seen.decisions("peer_kernels");
    assert_eq!(peer.len(), world, "{peer:?}");
    for e in &peer {
        assert_eq!(e["on"], "true", "{e:?}");
        assert_eq!(e["target"], TRACING_TARGET);
        assert_ne!(e["one_shot_blocks"], "0", "{e:?}");
    }
    let nccl = seen.decisions("nccl_fallback");
    assert_eq!(nccl.len(), world, "{nccl:?}");
    for e in &nccl {
        assert_eq!(e["on"], "false", "{e:?}");
        assert!(e["reason"].contains("without NCCL"), "{e:?}");
    }
    let windows = seen.decisions("nccl_windows");
    assert_eq!(windows.len(), world, "{windows:?}");
    for e in &windows {
        assert_eq!(e["on"], "false", "{e:?}");
        assert!(e["reason"].contains("without NCCL"), "{e:?}");
    }
    let mc = seen.decisions("multicast");
    assert_eq!(mc.len(), world, "{mc:?}");
    for e in &mc {
        assert_eq!(
            (e["on"].as_str(), e["blocked"].as_str()),
            ("false", "true"),
            "{e:?}"
        );
        assert!(e["reason"].contains("NCCL_NVLS_ENABLE=0"), "{e:?}");
    }
    let spans = seen.spans.lock().unwrap().clone();
    let setup: Vec<_> = spans.iter().filter(|s| s["name"] == "setup").collect();
    assert_eq!(setup.len(), world, "{spans:?}");
    assert!(setup
        .iter()
        .all(|s| s["constructor"] == "new" && s["world"] == "2"));
    // What the events said is what the communicators report.
    for c in &comms {
        assert!(c.has_peer_kernels() && !c.has_nccl_fallback() && !c.has_multicast());
    }
}

fn an_nccl_fallback_is_reported_on(ctx: Arc<CudaContext>) {
    let seen = recorded();
    clear(seen);
    let hub = LocalHub::new(1, std::time::Duration::from_secs(60));
    let config = Config {
        algorithm: Algorithm::Nccl,
        ..Config::default()
    };
    let comm = Communicator::with_nccl_fallback(&hub.rank(0), ctx, config).expect("with_nccl_fallback");
    assert!(comm.has_nccl_fallback());
    let nccl = seen.decisions("nccl_fallback");
    assert_eq!(nccl.len(), 1, "{nccl:?}");
    assert_eq!(nccl[0]["on"], "true");
    assert!(nccl[0]["what"].contains("NCCL"), "{nccl:?}");
    let spans = seen.spans.lock().unwrap().clone();
    assert!(
        spans.iter().any(|s| s["constructor"] == "with_nccl_fallback"),
        "{spans:?}"
    );
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "tracing_setup",
        vec![
            gpu_test!(a_local_group_reports_peer_kernels_no_fallback_and_the_multicast_veto),
            gpu_nccl_test!(an_nccl_fallback_is_reported_on),
        ],
    )
}
