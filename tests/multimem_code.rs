//! The multimem (NVLS) kernels checked in the compiled code, on the CPU (they are never run on
//! this project's machines): the embedded compute_90 PTX, the `ptxas -v` report and the sm_90
//! SASS (tests/support/sass.rs).
//!
//! - 16-bit reductions accumulate in fp32 (`.acc::f32`), never the bf16-accumulating form;
//!   f32 uses `.add.v4.f32`; `multimem.red` is never used for data, only on the u64 signal
//!   counter, with release semantics at system scope; no multimem at `.gpu`/`.cta` scope;
//! - the multimem and the unicast instantiations of each body (in-place two-shot, one-shot,
//!   low-latency) call the collective policy in the same order (the `symm-policy` markers);
//! - the multimem low-latency kernel pushes with `multimem.st` (one 32-bit store per word,
//!   one 16-byte store per line) and reduces nothing in the switch
//!   (no `ld_reduce`, no `red`): its sums are the peer kernels' rank-order sums;
//! - the multimem barrier issues one `fence.proxy.alias` per barrier, in thread 0 after its
//!   acquire wait, and no other fence (the PTX and the sm_90 SASS);
//! - the sm_80 code has no multimem kernel (ptxas compiled none for sm_80).

fn kernels_or_skip(test: &str) -> bool {
    if symm_allreduce::kernels_available() {
        return true;
    }
    let required = std::env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
    assert!(!required, "{test}: the kernels were not compiled into this build");
    eprintln!("SKIP {test}: kernels not compiled (no nvcc at build time)");
    false
}

const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// (unicast kernel, its multimem instantiation) of each body, and the policy calls the body
/// makes.
const PAIRS: [(&str, &str, &[&str]); 3] = [
    (
        "in_place",
        "in_place_mm",
        &["barrier", "load_reduce", "broadcast_store", "load_reduce_element"],
    ),
    (
        "one_shot",
        "one_shot_mm",
        &["barrier_arrive", "load_reduce", "load_reduce_element"],
    ),
    (
        "one_shot_ll",
        "one_shot_ll_mm",
        &["broadcast_word", "broadcast_line"],
    ),
];

/// The multimem kernels that reduce in the switch (`multimem.ld_reduce`) and synchronise with
/// the multicast barrier.
const REDUCING: [&str; 2] = ["in_place_mm", "one_shot_mm"];

/// The PTX body of entry `name` (from its `.entry` line to the next `.entry`).
fn entry(name: &str) -> &'static str {
    let ptx = symm_allreduce::embedded_ptx();
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("entry {name} not in the PTX"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(ptx.len(), |e| start + 1 + e);
    &ptx[start..end]
}

/// Instructions (a leading predicate dropped) that start with `prefix`.
fn lines_with<'a>(body: &'a str, prefix: &str) -> Vec<&'a str> {
    body.lines()
        .map(str::trim)
        .map(|l| match l.strip_prefix('@') {
            Some(p) => p
                .split_once(char::is_whitespace)
                .map_or("", |(_, rest)| rest.trim_start()),
            None => l,
        })
        .filter(|l| l.starts_with(prefix))
        .collect()
}

/// The ordered `symm-policy` markers of one entry.
fn markers(body: &str) -> Vec<&str> {
    body.lines()
        .filter_map(|l| l.trim().strip_prefix("// symm-policy: "))
        .map(str::trim)
        .collect()
}

#[test]
fn sixteen_bit_reductions_accumulate_in_fp32_and_f32_uses_add_v4_f32() {
    if !kernels_or_skip("sixteen_bit_reductions_accumulate_in_fp32_and_f32_uses_add_v4_f32") {
        return;
    }
    for kernel in REDUCING {
        for (dtype, form) in [("f16", "f16x2"), ("bf16", "bf16x2"), ("f32", "f32")] {
            let body = entry(&format!("symm_{kernel}_{dtype}"));
            let reduces = lines_with(body, "multimem.ld_reduce");
            assert!(!reduces.is_empty(), "{kernel} {dtype}: no multimem.ld_reduce");
            for l in &reduces {
                assert!(l.contains(".relaxed.sys.global.add"), "{kernel} {dtype}: {l}");
                if dtype == "f32" {
                    assert!(
                        l.contains(".add.v4.f32") && !l.contains(".acc::"),
                        "{kernel} {dtype}: {l}"
                    );
                } else {
                    // The fp32-accumulating form; the bf16-accumulating one lacks `.acc::f32`.
                    assert!(
                        l.contains(&format!(".add.acc::f32.v4.{form}")),
                        "{kernel} {dtype}: {l}"
                    );
                }
            }
        }
    }
    // Nowhere in the PTX: a 16-bit ld_reduce without .acc::f32.
    for l in lines_with(symm_allreduce::embedded_ptx(), "multimem.ld_reduce") {
        if l.contains("f16x2") || l.contains("bf16x2") {
            assert!(l.contains(".acc::f32"), "bf16/f16-accumulating form: {l}");
        }
    }
}

#[test]
fn multimem_stores_move_16_bytes_or_a_word_at_system_scope() {
    if !kernels_or_skip("multimem_stores_move_16_bytes_or_a_word_at_system_scope") {
        return;
    }
    // The in-place all-gather and the low-latency push store through the multicast address;
    // the one-shot only reads through it. (16-byte stores, 32-bit word stores: the
    // low-latency push has one per line, one in the word-per-thread path and two in the
    // two-words-per-thread path.)
    for (kernel, stores) in [
        ("in_place_mm", (1, 0)),
        ("one_shot_mm", (0, 0)),
        ("one_shot_ll_mm", (1, 3)),
    ] {
        for dtype in DTYPES {
            let body = entry(&format!("symm_{kernel}_{dtype}"));
            let found = lines_with(body, "multimem.st");
            // One form for every dtype: 16 bytes or a 32-bit word, whatever they hold.
            let lines = found
                .iter()
                .filter(|l| l.starts_with("multimem.st.relaxed.sys.global.v4.f32 "))
                .count();
            let words = found
                .iter()
                .filter(|l| l.starts_with("multimem.st.relaxed.sys.global.b32 "))
                .count();
            assert_eq!(lines + words, found.len(), "{kernel} {dtype}: {found:?}");
            assert_eq!((lines, words), stores, "{kernel} {dtype}: {found:?}");
        }
    }
}

#[test]
fn the_multimem_low_latency_kernel_pushes_with_multicast_and_sums_in_rank_order() {
    if !kernels_or_skip("the_multimem_low_latency_kernel_pushes_with_multicast_and_sums_in_rank_order") {
        return;
    }
    for dtype in DTYPES {
        let mm = entry(&format!("symm_one_shot_ll_mm_{dtype}"));
        let unicast = entry(&format!("symm_one_shot_ll_{dtype}"));
        // No reduction in the switch and no barrier: the readers poll their own lines and sum
        // in rank order as the unicast kernel does, so both give the peer kernels' bits.
        assert!(lines_with(mm, "multimem.ld_reduce").is_empty(), "{dtype}");
        assert!(lines_with(mm, "multimem.red").is_empty(), "{dtype}");
        // One multicast store per word (the word-per-thread path, every message the grid
        // covers; two in the two-words-per-thread path, up to twice that) and one per line
        // (longer messages), where the unicast kernel stores W - 1 times.
        assert_eq!(
            lines_with(mm, "multimem.st.relaxed.sys.global.b32").len(),
            3,
            "{dtype}: one multicast store per word"
        );
        assert_eq!(
            lines_with(mm, "multimem.st.relaxed.sys.global.v4.f32").len(),
            1,
            "{dtype}: one multicast store per line"
        );
        assert!(
            !lines_with(unicast, "st.relaxed.sys.global.u32").is_empty(),
            "{dtype}: the unicast word push"
        );
        // The push replaced the unicast stores; the polls and the re-arm are the same.
        for body in [mm, unicast] {
            assert!(
                !lines_with(body, "ld.relaxed.sys.global.v2.u64").is_empty(),
                "{dtype}: lines not polled"
            );
            assert!(
                !lines_with(body, "st.relaxed.sys.global.v2.u64").is_empty(),
                "{dtype}: lines not re-armed"
            );
            assert!(body.contains("%globaltimer"), "{dtype}: unbounded wait");
        }
        assert!(lines_with(unicast, "multimem.").is_empty(), "{dtype}");
    }
}

#[test]
fn multimem_red_only_signals_the_u64_counter_with_release_at_system_scope() {
    if !kernels_or_skip("multimem_red_only_signals_the_u64_counter_with_release_at_system_scope") {
        return;
    }
    let ptx = symm_allreduce::embedded_ptx();
    let reds = lines_with(ptx, "multimem.red");
    // Per dtype: two barriers in the in-place body (start and end), one in the one-shot.
    assert!(reds.len() >= 3 * DTYPES.len(), "{reds:?}");
    for l in &reds {
        assert!(l.starts_with("multimem.red.release.sys.global.add.u64 "), "{l}");
        assert!(
            !l.contains("16x2") && !l.contains("f32"),
            "multimem.red on data: {l}"
        );
    }
    for l in lines_with(ptx, "multimem.") {
        assert!(
            !l.contains(".gpu") && !l.contains(".cta"),
            "multimem below system scope: {l}"
        );
        assert!(l.contains(".sys."), "multimem without system scope: {l}");
    }
    // The counter wait: an acquire load at system scope (the alias fence: the test below).
    for kernel in REDUCING {
        for dtype in DTYPES {
            let body = entry(&format!("symm_{kernel}_{dtype}"));
            assert!(
                !lines_with(body, "multimem.red.release.sys.global.add.u64").is_empty(),
                "{kernel} {dtype}"
            );
            assert!(
                !lines_with(body, "ld.acquire.sys.global.u64").is_empty(),
                "{kernel} {dtype}"
            );
            assert!(body.contains("%globaltimer"), "{kernel} {dtype}: unbounded wait");
        }
    }
}

#[test]
fn unicast_and_multimem_instantiations_call_the_policy_in_the_same_order() {
    if !kernels_or_skip("unicast_and_multimem_instantiations_call_the_policy_in_the_same_order") {
        return;
    }
    for (unicast_kernel, multimem_kernel, calls) in PAIRS {
        for dtype in DTYPES {
            let unicast = markers(entry(&format!("symm_{unicast_kernel}_{dtype}")));
            let multimem = markers(entry(&format!("symm_{multimem_kernel}_{dtype}")));
            for m in calls {
                assert!(
                    unicast.contains(m),
                    "{unicast_kernel} {dtype}: {m} not in {unicast:?}"
                );
            }
            assert_eq!(
                unicast, multimem,
                "{unicast_kernel} {dtype}: the two policies run different bodies"
            );
            // The unicast instantiation has no multimem at all.
            assert!(lines_with(entry(&format!("symm_{unicast_kernel}_{dtype}")), "multimem.").is_empty());
        }
    }
}

#[test]
fn the_sm80_code_has_no_multimem_kernel() {
    if !kernels_or_skip("the_sm80_code_has_no_multimem_kernel") {
        return;
    }
    // ptxas reports every entry it compiles per target; the multimem source is compiled only
    // for sm_90 and newer (`// symm: min-arch 90`), so no multimem instruction reaches sm_80
    // SASS. (The fatbin's sm_80 cubin is not disassembled here: the pinned toolchain has no
    // cuobjdump; the report is what ptxas produced for it.)
    let report = symm_allreduce::ptxas_report();
    let compiled: Vec<&str> = report
        .lines()
        .filter_map(|l| l.split("Compiling entry function '").nth(1))
        .collect();
    let archs_of = |name: &str| -> Vec<&str> {
        compiled
            .iter()
            .filter(|l| l.starts_with(&format!("{name}'")))
            .filter_map(|l| l.split("for '").nth(1))
            .map(|a| a.trim_end_matches('\''))
            .collect()
    };
    for (unicast_kernel, multimem_kernel, _) in PAIRS {
        for dtype in DTYPES {
            let mm = archs_of(&format!("symm_{multimem_kernel}_{dtype}"));
            assert!(
                mm.contains(&"sm_90"),
                "{multimem_kernel} {dtype}: not compiled for sm_90: {mm:?}"
            );
            assert!(
                !mm.contains(&"sm_80"),
                "{multimem_kernel} {dtype}: compiled for sm_80: {mm:?}"
            );
            let uni = archs_of(&format!("symm_{unicast_kernel}_{dtype}"));
            assert!(
                uni.contains(&"sm_80") && uni.contains(&"sm_90"),
                "{unicast_kernel} {dtype}: {uni:?}"
            );
        }
    }
    // And the multimem source guards every instruction itself.
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/multimem.cuh")).unwrap();
    assert!(src.contains("__CUDA_ARCH__ >= 900"));
    let cu = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/multimem.cu")).unwrap();
    assert!(cu.lines().take(20).any(|l| l.trim() == "// symm: min-arch 90"));
}

#[test]
fn the_multimem_kernels_spill_nothing() {
    if !kernels_or_skip("the_multimem_kernels_spill_nothing") {
        return;
    }
    let report = symm_allreduce::ptxas_report();
    let mut seen = 0;
    let lines: Vec<&str> = report.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        let Some(name) = l.split("Compiling entry function '").nth(1) else {
            continue;
        };
        if PAIRS.iter().any(|(_, mm, _)| {
            DTYPES
                .iter()
                .any(|d| name.starts_with(&format!("symm_{mm}_{d}'")))
        }) {
            seen += 1;
            let props = lines[i + 1..]
                .iter()
                .take(3)
                .find(|p| p.contains("stack frame"))
                .unwrap();
            assert!(
                props.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                "{l}: {props}"
            );
        }
    }
    assert_eq!(seen, PAIRS.len() * DTYPES.len(), "{seen}");
}

#[path = "support/sass.rs"]
mod sass;

/// Barriers per multimem kernel (`multimem.red` sites): the in-place body has a start and an
/// end barrier, the one-shot one, the low-latency kernel none.
const BARRIERS: [(&str, usize); 3] = [("in_place_mm", 2), ("one_shot_mm", 1), ("one_shot_ll_mm", 0)];

/// One alias proxy fence per barrier, where the memory model needs it (multimem.cuh,
/// `barrier_impl`, says why): in the thread that waited, after its acquire poll saw every
/// arrival and before the block's closing barrier, with nothing between it and that barrier
/// but the `__syncthreads_or`; no fence of any other kind in these kernels. In the PTX, and in
/// the sm_90 SASS, where `fence.proxy.alias` is the only source of `MEMBAR.SC.GPU` (it compiles
/// to `MEMBAR.SC.GPU` or `MEMBAR.SC.SYS` behind a driver-set flag, then `CCTL.IVALL`).
#[test]
fn the_multimem_barrier_fences_the_aliases_once_in_one_thread() {
    let test = "the_multimem_barrier_fences_the_aliases_once_in_one_thread";
    if !kernels_or_skip(test) {
        return;
    }
    for (kernel, barriers) in BARRIERS {
        for dtype in DTYPES {
            let body = entry(&format!("symm_{kernel}_{dtype}"));
            assert_eq!(
                lines_with(body, "multimem.red").len(),
                barriers,
                "{kernel} {dtype}: barriers"
            );
            assert_eq!(
                lines_with(body, "fence.proxy.alias").len(),
                barriers,
                "{kernel} {dtype}: one alias fence per barrier"
            );
            // No other fence instruction. (`membar.sys` appears: the `__threadfence_system` of
            // the divergence check, the call-state publication and the error path, which are
            // the unicast kernels' too.)
            for other in ["fence.sc", "fence.acq_rel", "fence.release", "fence.acquire"] {
                assert!(lines_with(body, other).is_empty(), "{kernel} {dtype}: {other}");
            }
            // Where each fence is: after the arrival and the acquire poll since the last
            // `bar.sync` (the barrier's opening __syncthreads, which every thread passes before
            // thread 0 alone arrives), and followed by the closing `bar.red` with no memory
            // access in between.
            let ins: Vec<&str> = lines_with(body, "");
            for (i, _) in ins
                .iter()
                .enumerate()
                .filter(|(_, l)| l.starts_with("fence.proxy.alias"))
            {
                let opened = ins[..i]
                    .iter()
                    .rposition(|l| l.starts_with("bar.sync") || l.starts_with("barrier.sync"))
                    .unwrap_or_else(|| panic!("{kernel} {dtype}: no barrier before the fence"));
                let since = &ins[opened..i];
                assert!(
                    since.iter().any(|l| l.starts_with("multimem.red.release.sys")),
                    "{kernel} {dtype}: a fence outside the arriving thread's part"
                );
                assert!(
                    since.iter().any(|l| l.starts_with("ld.acquire.sys")),
                    "{kernel} {dtype}: a fence before the wait"
                );
                let closes = ins[i + 1..]
                    .iter()
                    .position(|l| l.starts_with("bar.red") || l.starts_with("barrier.red"))
                    .unwrap_or_else(|| panic!("{kernel} {dtype}: no closing barrier after the fence"));
                for l in &ins[i + 1..i + 1 + closes] {
                    assert!(
                        !(l.starts_with("ld.") || l.starts_with("st.") || l.starts_with("multimem.")),
                        "{kernel} {dtype}: {l} between the fence and the closing barrier"
                    );
                }
            }
        }
    }
    let Some(sass) = sass::sm90_or_skip(test) else {
        return;
    };
    let mut seen = 0;
    for f in sass {
        let membars = |kind: &str| f.find("MEMBAR").iter().filter(|&&i| f.opcode(i) == kind).count();
        let alias_fences = membars("MEMBAR.SC.GPU");
        match BARRIERS
            .iter()
            .find(|(k, _)| DTYPES.iter().any(|d| f.name == format!("symm_{k}_{d}")))
        {
            Some((_, barriers)) => {
                seen += 1;
                assert_eq!(alias_fences, *barriers, "{}: alias fences in the SASS", f.name);
            }
            // No other kernel has a GPU-scope fence at all.
            None => assert_eq!(alias_fences, 0, "{}", f.name),
        }
    }
    assert_eq!(seen, BARRIERS.len() * DTYPES.len());
}
