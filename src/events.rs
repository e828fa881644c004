//! Setup decisions as [`tracing`] events, so that an engine's own logger sees what
//! `SYMM_ALLREDUCE_LOG` prints to stderr: whether the peer kernels are on (and why not), the
//! NCCL fallback, the multicast object (and the veto that kept it off), and the soft setup
//! step that failed. Every event has the target [`TARGET`] and a `decision` field naming what
//! was decided; `on` says which way, `reason` why not. The span [`setup_span`] wraps each
//! constructor's collective setup.
//!
//! Nothing here runs on the call path: a call that goes to NCCL is what
//! [`Communicator::path`](crate::Communicator::path) reports, decided by the same rules on
//! every call, and the calls stay free of logging (`tests/no_alloc.rs`). With no subscriber,
//! each event is one check of a cached callsite interest: no formatting, no allocation.

use tracing::{info, info_span, warn};

/// The target of every event and span of this crate.
pub const TARGET: &str = "symm_allreduce";

/// The span around one rank's collective setup (`constructor`: which constructor).
pub(crate) fn setup_span(constructor: &'static str, rank: usize, world: usize) -> tracing::span::EnteredSpan {
    info_span!(target: TARGET, "setup", constructor, rank, world).entered()
}

/// A soft setup step failed on some rank: the peer kernels are off on every rank.
pub(crate) fn soft_step_failed(step: &str, reason: &dyn std::fmt::Display) {
    warn!(target: TARGET, decision = "setup_step", step, on = false, %reason, "soft setup step failed: the peer kernels are off");
}

/// The peer kernels' verdict: `Ok(blocks)` (one-shot, two-shot blocks per rank) or why not.
pub(crate) fn peer_kernels(verdict: Result<(usize, usize), &str>, nccl_takes_every_call: bool) {
    match verdict {
        Ok((one_shot_blocks, two_shot_blocks)) => info!(
            target: TARGET,
            decision = "peer_kernels",
            on = true,
            one_shot_blocks,
            two_shot_blocks,
            "peer kernels on"
        ),
        Err(reason) => warn!(
            target: TARGET,
            decision = "peer_kernels",
            on = false,
            reason,
            nccl_takes_every_call,
            "peer kernels off"
        ),
    }
}

/// The multicast (NVLS) object: `Ok(bytes bound)` or why there is none; `blocked` when it was
/// decided before any driver call (a veto variable, whose `reason` then names it, or a
/// device without the multimem kernel).
pub(crate) fn multicast(verdict: Result<usize, &str>, blocked: bool) {
    match verdict {
        Ok(bytes) => info!(target: TARGET, decision = "multicast", on = true, bytes, "multicast on"),
        Err(reason) => info!(
            target: TARGET,
            decision = "multicast",
            on = false,
            blocked,
            reason,
            "multicast off"
        ),
    }
}

/// The NCCL fallback: `Ok(what)` or why there is none.
pub(crate) fn nccl_fallback(verdict: Result<&str, &str>) {
    match verdict {
        Ok(what) => info!(target: TARGET, decision = "nccl_fallback", on = true, what, "NCCL fallback on"),
        Err(reason) => {
            info!(target: TARGET, decision = "nccl_fallback", on = false, reason, "no NCCL fallback")
        }
    }
}

/// The NCCL windows over the symmetric memory: on, or why not (docs/nccl-windows.md).
pub(crate) fn nccl_windows(unavailable: Option<&str>) {
    match unavailable {
        None => info!(target: TARGET, decision = "nccl_windows", on = true, "NCCL windows on"),
        Some(reason) => {
            info!(target: TARGET, decision = "nccl_windows", on = false, reason, "no NCCL windows")
        }
    }
}

/// The whole setup report, built only when a subscriber takes debug events of this target.
pub(crate) fn report(describe: impl FnOnce() -> String) {
    if tracing::enabled!(target: TARGET, tracing::Level::DEBUG) {
        tracing::debug!(target: TARGET, report = %describe(), "setup report");
    }
}

#[cfg(test)]
#[path = "../tests/support/recorder.rs"]
pub(crate) mod recorder;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decision_reaches_a_subscriber_with_its_reason() {
        let (subscriber, seen) = recorder::subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let _span = setup_span("new", 1, 4);
            peer_kernels(Ok((24, 32)), false);
            peer_kernels(Err("no peer access between devices 0 and 1"), true);
            soft_step_failed("mapping", &"cuMemMap failed");
            nccl_fallback(Err("the communicator was created without NCCL"));
            nccl_fallback(Ok("NCCL 2.28.3 on the caller's stream"));
            multicast(Err("NCCL_NVLS_ENABLE=0 is set (a multicast veto)"), true);
            multicast(Ok(1 << 21), false);
        });
        let peer = seen.decisions("peer_kernels");
        assert_eq!(peer.len(), 2);
        assert_eq!(peer[0]["on"], "true");
        assert_eq!(peer[0]["one_shot_blocks"], "24");
        assert_eq!(peer[1]["on"], "false");
        assert_eq!(peer[1]["reason"], "no peer access between devices 0 and 1");
        assert_eq!(peer[1]["nccl_takes_every_call"], "true");
        assert_eq!(seen.decisions("setup_step")[0]["step"], "mapping");
        let nccl = seen.decisions("nccl_fallback");
        assert_eq!(
            (nccl[0]["on"].as_str(), nccl[1]["on"].as_str()),
            ("false", "true")
        );
        assert!(nccl[0]["reason"].contains("without NCCL"));
        let mc = seen.decisions("multicast");
        assert_eq!(
            (mc[0]["on"].as_str(), mc[0]["blocked"].as_str()),
            ("false", "true")
        );
        assert!(mc[0]["reason"].contains("a multicast veto"));
        assert_eq!(mc[1]["bytes"], "2097152");
        let events = seen.events.lock().unwrap();
        assert!(events.iter().all(|e| e["target"] == TARGET));
        let spans = seen.spans.lock().unwrap();
        assert_eq!(spans.len(), 1);
        assert_eq!(
            (spans[0]["name"].as_str(), spans[0]["constructor"].as_str()),
            ("setup", "new")
        );
    }

    #[test]
    fn the_report_is_built_only_when_debug_events_are_taken() {
        let built = std::cell::Cell::new(0);
        // No subscriber: the closure never runs.
        report(|| {
            built.set(built.get() + 1);
            String::new()
        });
        assert_eq!(built.get(), 0);
        let (subscriber, seen) = recorder::subscriber();
        tracing::subscriber::with_default(subscriber, || {
            report(|| {
                built.set(built.get() + 1);
                "peer kernels: on".to_string()
            })
        });
        assert_eq!(built.get(), 1);
        assert_eq!(seen.events.lock().unwrap()[0]["report"], "peer kernels: on");
    }
}
