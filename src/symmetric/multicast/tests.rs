//! The pipeline over the fake driver: in one process (LocalHub threads) and across processes
//! (this test binary re-run as child ranks over a SocketStore, the object shared through
//! memfd descriptors passed with SCM_RIGHTS).

use std::time::Duration;

use super::*;
use crate::bootstrap::{LocalHub, SocketStore, StoreAddress};
use crate::driver::multicast::{FakeMulticast, Op};

const G: usize = 2 << 20;

fn request(mode: Multicast, rank: usize) -> Request {
    Request {
        mode,
        ordinal: rank,
        memory: 0x100 + rank as u64,
        memory_size: 8 * G,
        needed: 3 * G + 12345,
    }
}

/// Runs the pipeline on `world` threads; returns each rank's result (mappings closed
/// collectively when `close`, dropped otherwise).
fn group(
    fake: &FakeMulticast,
    world: usize,
    mode: Multicast,
    veto: Option<&str>,
    close: bool,
) -> Vec<std::result::Result<Option<String>, Error>> {
    let hub = LocalHub::new(world, Duration::from_secs(20));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let hub = hub.rank(rank);
                let driver: Arc<dyn MulticastDriver> = Arc::new(fake.for_rank(rank));
                s.spawn(move || {
                    let outcome = establish(&hub, driver, request(mode, rank), veto.map(str::to_string))?;
                    match outcome {
                        Outcome::On(m) => {
                            assert_eq!(m.size(), 4 * G, "needed rounded up to the granularity");
                            assert_eq!(m.granularity(), (G, 4 * G));
                            assert_ne!(m.address(), 0);
                            if close {
                                m.close(&hub)?;
                            }
                            Ok(None)
                        }
                        Outcome::Off(why) => Ok(Some(why)),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn assert_clean(fake: &FakeMulticast) {
    assert!(
        fake.violations().is_empty(),
        "rules broken: {:?}",
        fake.violations()
    );
    assert_eq!(fake.held(), (0, 0), "handles or mappings leaked");
}

#[test]
fn vetoes_are_read_from_the_environment_values() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    };
    assert_eq!(veto(env(&[])), None);
    assert_eq!(veto(env(&[("NCCL_NVLS_ENABLE", "1")])), None);
    assert!(veto(env(&[("NCCL_NVLS_ENABLE", "0")]))
        .unwrap()
        .contains("NCCL_NVLS_ENABLE=0"));
    assert!(veto(env(&[("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")])).is_some());
    assert!(veto(env(&[("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")])).is_none());
    assert!(veto(env(&[("NVSHMEM_DISABLE_NVLS", "true")])).is_some());
    assert!(veto(env(&[("SYMM_ALLREDUCE_MULTICAST", "off")]))
        .unwrap()
        .contains("SYMM_ALLREDUCE_MULTICAST"));
    assert!(veto(env(&[("SYMM_ALLREDUCE_MULTICAST", "1")])).is_none());
}

#[test]
fn the_full_lifecycle_in_a_local_group() {
    for world in 2..=8 {
        let fake = FakeMulticast::new(true, G, 4 * G);
        for r in group(&fake, world, Multicast::Auto, None, true) {
            assert_eq!(r.unwrap(), None, "world {world}");
        }
        assert_clean(&fake);
        let calls = fake.calls();
        let count = |op| calls.iter().filter(|(_, o)| *o == op).count();
        assert_eq!(count(Op::Create), 1);
        assert_eq!(count(Op::Import), world - 1);
        for op in [
            Op::AddDevice,
            Op::Bind,
            Op::Map,
            Op::Unmap,
            Op::Unbind,
            Op::Release,
        ] {
            assert_eq!(count(op), world, "{op:?}, world {world}");
        }
        // Every add precedes every bind (the vote between them).
        let last_add = calls.iter().rposition(|(_, o)| *o == Op::AddDevice).unwrap();
        let first_bind = calls.iter().position(|(_, o)| *o == Op::Bind).unwrap();
        assert!(last_add < first_bind);
    }
    // Dropping without the collective close tears down locally as well.
    let fake = FakeMulticast::new(true, G, 4 * G);
    for r in group(&fake, 3, Multicast::Required, None, false) {
        assert_eq!(r.unwrap(), None);
    }
    assert_clean(&fake);
}

#[test]
fn a_failure_at_any_step_on_any_rank_turns_multicast_off_everywhere() {
    let steps = [
        (Op::Supported, "multicast eligibility"),
        (Op::Granularity, "multicast granularity"),
        (Op::Create, "multicast create"),
        (Op::Export, "multicast create"),
        (Op::Import, "multicast import"),
        (Op::AddDevice, "multicast add device"),
        (Op::Bind, "multicast bind"),
        (Op::Map, "multicast map"),
    ];
    for world in [2, 3, 4] {
        for (op, step) in steps {
            for bad in 0..world {
                // Only rank 0 creates and exports; rank 0 never imports.
                let called = match op {
                    Op::Create | Op::Export => bad == 0,
                    Op::Import => bad != 0,
                    _ => true,
                };
                for mode in [Multicast::Auto, Multicast::Required] {
                    let fake = FakeMulticast::new(true, G, 4 * G);
                    fake.fail_at(op, bad);
                    let results = group(&fake, world, mode, None, true);
                    assert_clean(&fake);
                    let what = format!("{op:?} on rank {bad} of {world}, {mode:?}");
                    if !called {
                        assert!(
                            results.iter().all(|r| matches!(r, Ok(None))),
                            "{what}: {results:?}"
                        );
                        continue;
                    }
                    let reasons: Vec<String> = results
                        .into_iter()
                        .map(|r| match (mode, r) {
                            (Multicast::Auto, Ok(Some(why))) => why,
                            (Multicast::Required, Err(Error::MulticastUnavailable { reason })) => reason,
                            (_, other) => panic!("{what}: {other:?}"),
                        })
                        .collect();
                    for why in &reasons {
                        assert!(why.contains(step), "{what}: {why}");
                        assert!(why.contains(&format!("rank {bad}")), "{what}: {why}");
                        assert!(why.contains(op.call()), "{what}: {why}");
                    }
                    assert!(
                        reasons.iter().all(|r| r == &reasons[0]),
                        "{what}: ranks disagree: {reasons:?}"
                    );
                    // Nothing after the failed step was called anywhere.
                    let later = Op::ALL.iter().position(|o| *o == op).unwrap();
                    for (rank, o) in fake.calls() {
                        let at = Op::ALL.iter().position(|x| *x == o).unwrap();
                        assert!(
                            at <= later || matches!(o, Op::Unmap | Op::Unbind | Op::Release),
                            "{what}: rank {rank} called {o:?} after the failure"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_veto_or_attribute_zero_means_no_multicast_call() {
    for (name, _) in VETOES {
        let fake = FakeMulticast::new(true, G, G);
        let why = format!("{name}=x is set (a multicast veto)");
        for r in group(&fake, 4, Multicast::Required, Some(&why), true) {
            match r {
                Err(Error::MulticastUnavailable { reason }) => assert!(reason.contains(name), "{reason}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        assert!(fake.calls().is_empty(), "{name}: {:?}", fake.calls());
        let auto = group(&fake, 2, Multicast::Auto, Some(&why), true);
        assert!(
            auto.iter().all(|r| matches!(r, Ok(Some(w)) if w.contains(name))),
            "{auto:?}"
        );
        assert!(fake.calls().is_empty());
    }
    // Attribute 0: the query, then nothing (the fake records any other call as a violation).
    let fake = FakeMulticast::new(false, G, G);
    for r in group(&fake, 4, Multicast::Required, None, true) {
        match r {
            Err(Error::MulticastUnavailable { reason }) => {
                assert!(
                    reason.contains("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(fake.calls().iter().all(|(_, o)| *o == Op::Supported));
    assert_eq!(fake.calls().len(), 4);
    assert_clean(&fake);
    // Off: nothing at all; one rank: nothing either.
    let fake = FakeMulticast::new(true, G, G);
    assert!(matches!(&group(&fake, 2, Multicast::Off, None, true)[0], Ok(Some(w)) if w.contains("Off")));
    assert!(
        matches!(&group(&fake, 1, Multicast::Auto, None, true)[0], Ok(Some(w)) if w.contains("one rank"))
    );
    assert!(fake.calls().is_empty());
}

#[test]
fn a_size_that_does_not_fit_the_allocation_turns_multicast_off() {
    let fake = FakeMulticast::new(true, 16 * G, 16 * G);
    for r in group(&fake, 2, Multicast::Auto, None, true) {
        assert!(matches!(&r, Ok(Some(w)) if w.contains("granularity")), "{r:?}");
    }
    assert_clean(&fake);
    assert!(!fake.calls().iter().any(|(_, o)| *o == Op::Create));
}

// --- across processes -------------------------------------------------------------------

const CHILD_ENV: &str = "SYMM_MC_FAKE_CHILD";

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// One child rank: `rank,world,address,fail_op_index,fail_rank`.
fn child(spec: &str) -> std::result::Result<String, String> {
    let parts: Vec<&str> = spec.splitn(5, ',').collect();
    let [rank, world, address, fail_op, fail_rank] = parts[..] else {
        return Err(format!("bad spec {spec}"));
    };
    let (rank, world): (usize, usize) = (rank.parse().unwrap(), world.parse().unwrap());
    let fds_before = open_fds();
    let store = SocketStore::new(
        &StoreAddress::parse(address),
        rank,
        world,
        Duration::from_secs(30),
    )
    .map_err(|e| e.to_string())?;
    let fake = FakeMulticast::new(true, G, 4 * G);
    if let (Ok(op), Ok(bad)) = (fail_op.parse::<usize>(), fail_rank.parse::<usize>()) {
        if bad == rank {
            fake.fail_at(Op::ALL[op], rank);
        }
    }
    let driver: Arc<dyn MulticastDriver> = Arc::new(fake.for_rank(rank));
    let result =
        match establish(&store, driver, request(Multicast::Auto, rank), None).map_err(|e| e.to_string())? {
            Outcome::On(m) => {
                m.close(&store).map_err(|e| e.to_string())?;
                "on".to_string()
            }
            Outcome::Off(why) => format!("off: {why}"),
        };
    drop(store);
    if !fake.violations().is_empty() {
        return Err(format!("violations: {:?}", fake.violations()));
    }
    if fake.held() != (0, 0) {
        return Err(format!("leaked {:?}", fake.held()));
    }
    let fds_after = open_fds();
    if fds_after > fds_before {
        return Err(format!(
            "descriptors leaked: {fds_before} before, {fds_after} after"
        ));
    }
    Ok(result)
}

/// The child entry point: does nothing unless this binary was started as a child rank.
#[test]
fn multicast_fake_child_rank() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    match child(&spec) {
        Ok(r) => println!("MC-RESULT {r}"),
        Err(e) => println!("MC-ERROR {e}"),
    }
}

fn run_processes(world: usize, fail: Option<(Op, usize)>) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let address = StoreAddress::unique("symm-mc-fake").unwrap().to_string();
    let (op, bad) = fail.map_or(("-".to_string(), "-".to_string()), |(o, r)| {
        (
            Op::ALL.iter().position(|x| *x == o).unwrap().to_string(),
            r.to_string(),
        )
    });
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "symmetric::multicast::tests::multicast_fake_child_rank",
                    "--nocapture",
                ])
                .env(CHILD_ENV, format!("{rank},{world},{address},{op},{bad}"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = String::from_utf8_lossy(&c.wait_with_output().unwrap().stdout).into_owned();
            out.lines()
                .find_map(|l| {
                    l.strip_prefix("MC-RESULT ")
                        .or_else(|| l.strip_prefix("MC-ERROR ").map(|_| l))
                })
                .unwrap_or("no result")
                .to_string()
        })
        .collect()
}

#[test]
fn the_lifecycle_and_failures_across_processes() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    assert_eq!(run_processes(3, None), vec!["on"; 3]);
    for (op, bad) in [(Op::Import, 2), (Op::AddDevice, 1), (Op::Bind, 0), (Op::Map, 2)] {
        let results = run_processes(3, Some((op, bad)));
        for r in &results {
            assert!(
                r.starts_with("off: ") && r.contains(op.call()),
                "{op:?} on {bad}: {results:?}"
            );
        }
        assert!(results.iter().all(|r| r == &results[0]), "{results:?}");
    }
}

#[test]
fn the_counter_offsets_match_the_device_header() {
    let header =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/multimem.cuh")).unwrap();
    let value = |name: &str| -> usize {
        let line = header
            .lines()
            .find(|l| l.trim_start().starts_with("constexpr") && l.contains(&format!(" {name} = ")))
            .unwrap_or_else(|| panic!("{name} not in multimem.cuh"));
        line.split('=')
            .nth(1)
            .unwrap()
            .trim()
            .trim_end_matches(';')
            .parse()
            .unwrap()
    };
    assert_eq!(value("MC_SIGNAL_OFFSET"), MC_SIGNAL_OFFSET);
    assert_eq!(value("MC_SIGNAL_STRIDE"), MC_SIGNAL_STRIDE);
    assert_eq!(value("MC_EXPECTED_OFFSET"), MC_EXPECTED_OFFSET);
    assert_eq!(value("MC_PHASES"), MC_PHASES);
}

#[test]
fn a_veto_reaches_a_tracing_subscriber_and_no_driver_call_is_made() {
    let (subscriber, seen) = crate::events::recorder::subscriber();
    let fake = FakeMulticast::new(true, G, 4 * G);
    let hub = LocalHub::new(1, Duration::from_secs(20));
    let veto = "TEST_ONLY_VETO=1 is set (a multicast veto)".to_string();
    let outcome = tracing::subscriber::with_default(subscriber, || {
        establish(
            &hub.rank(0),
            Arc::new(fake.for_rank(0)),
            request(Multicast::Auto, 0),
            Some(veto),
        )
    })
    .unwrap();
    assert!(matches!(outcome, Outcome::Off(ref why) if why.contains("TEST_ONLY_VETO")));
    let mc = seen.decisions("multicast");
    assert_eq!(mc.len(), 1, "{mc:?}");
    assert_eq!(mc[0]["on"], "false");
    assert_eq!(mc[0]["blocked"], "true");
    assert!(mc[0]["reason"].contains("TEST_ONLY_VETO=1"));
    assert!(fake.calls().is_empty(), "a veto makes no driver call");
}
