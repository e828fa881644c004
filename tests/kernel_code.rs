//! Reads the compiled kernels (no GPU needed): memory-order scopes in the PTX and the
//! `ptxas -v` resource report. CI builds with SYMM_ALLREDUCE_REQUIRE_KERNELS=1, so there
//! these checks always run; elsewhere they skip (printed) when nvcc was not available.

fn kernels_or_skip(test: &str) -> bool {
    if symm_allreduce::kernels_available() {
        return true;
    }
    let required = std::env::var("SYMM_ALLREDUCE_REQUIRE_KERNELS").is_ok_and(|v| v == "1")
        || std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1");
    assert!(!required, "{test}: the kernels were not compiled into this build");
    use std::io::Write;
    // Written past the harness's capture so the skip shows in every run.
    let _ = writeln!(
        std::io::stderr(),
        "SKIP {test}: kernels not compiled (no nvcc at build time)"
    );
    false
}

/// Instructions (without operands) of the PTX.
fn instructions() -> Vec<&'static str> {
    symm_allreduce::embedded_ptx()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//") && !l.starts_with('.') && !l.starts_with('{'))
        .filter_map(|l| l.split_whitespace().next())
        .map(|op| op.trim_start_matches('@'))
        .collect()
}

#[test]
fn cross_rank_flags_use_system_scope_release_acquire() {
    if !kernels_or_skip("cross_rank_flags_use_system_scope_release_acquire") {
        return;
    }
    let ops = instructions();
    // Barriers: 64-bit epochs released at system scope and polled with system-scope
    // acquire loads (no fence after the loop: a MEMBAR.SYS there cost 2.6 µs per barrier).
    assert!(
        ops.contains(&"st.release.sys.global.u64"),
        "no 64-bit release stores: the barrier lost its ordering"
    );
    assert!(
        ops.contains(&"ld.acquire.sys.global.u64"),
        "the barrier does not poll 64-bit epochs with acquire loads"
    );
    assert!(
        !ops.iter().any(|o| o.starts_with("fence.acq_rel")),
        "an acquire-release fence is back in a barrier (acquire polls order the same)"
    );
    assert!(
        !ops.iter()
            .any(|o| o.starts_with("ld.") && o.contains(".acquire") && o.contains(".u32")),
        "a 32-bit acquire: epochs are 64-bit"
    );
    // Low-latency lines: 16 bytes as two 64-bit words, each single-copy atomic.
    assert!(
        ops.contains(&"st.relaxed.sys.global.v2.u64"),
        "low-latency lines are not stored as u64 pairs"
    );
    assert!(
        ops.contains(&"ld.relaxed.sys.global.v2.u64"),
        "low-latency lines are not polled as u64 pairs"
    );
    // Every ordered or strong access is at system scope.
    for op in &ops {
        let strong = op.contains(".release") || op.contains(".acquire") || op.contains(".relaxed");
        if (op.starts_with("ld.") || op.starts_with("st.") || op.starts_with("fence.")) && strong {
            assert!(op.contains(".sys"), "cross-rank op without system scope: {op}");
        }
    }
    // Programmatic Dependent Launch in the sm_90 code. (The sm_80 SASS cannot hold it:
    // ptxas rejects griddepcontrol below sm_90, and the source guards it with __CUDA_ARCH__.)
    assert!(ops.iter().any(|o| o.starts_with("griddepcontrol.wait")));
    assert!(ops
        .iter()
        .any(|o| o.starts_with("griddepcontrol.launch_dependents")));
    // Nothing may use a narrower scope.
    for op in &ops {
        let narrow = op.contains(".gpu.") || op.contains(".cta.");
        assert!(!narrow, "narrow-scope memory op in the kernels: {op}");
    }
}

/// Each block reads and publishes only its own entry of the call state: no kernel counts its
/// blocks with a global atomic (a round trip, and before protocol v2.1 a `MEMBAR.ALL.GPU`,
/// at the end of every low-latency block). The sync floor's exchange publishes no data, so
/// its flags are relaxed stores; every barrier kernel releases its flags.
#[test]
fn no_grid_wide_counter_and_the_sync_floor_releases_nothing() {
    if !kernels_or_skip("no_grid_wide_counter_and_the_sync_floor_releases_nothing") {
        return;
    }
    let ops = instructions();
    assert!(
        !ops.iter()
            .any(|o| o.starts_with("atom.global") || o.starts_with("red.global")),
        "a global atomic in the kernels (the call state is per block)"
    );
    let text = |kernel: &str| {
        entries()
            .find(|(n, _)| *n == kernel)
            .map(|(_, t)| t)
            .expect("kernel in the PTX")
    };
    let releases = |kernel: &str| text(kernel).matches("st.release.sys").count();
    // The one-shot: the divergence check's announcement and its barrier's flag; the floor:
    // the announcement only.
    assert_eq!(
        releases("symm_sync_floor") + 1,
        releases("symm_one_shot_bf16"),
        "the sync floor's flags are release stores"
    );
    let floor = text("symm_sync_floor");
    assert!(floor.contains("st.relaxed.sys.global.u64") && floor.contains("ld.acquire.sys.global.u64"));
    for (name, _) in entries().filter(|(n, _)| {
        ["symm_one_shot_", "symm_two_shot_", "symm_in_place_"]
            .iter()
            .any(|p| n.starts_with(p))
            && !n.contains("_ll_")
            && !n.contains("_mm_")
    }) {
        assert!(releases(name) >= 2, "{name}: a barrier without a release store");
    }
}

/// Every kernel of the PTX as (entry name, its text up to the next entry).
fn entries() -> impl Iterator<Item = (&'static str, &'static str)> {
    symm_allreduce::embedded_ptx()
        .split(".entry ")
        .skip(1)
        .map(|entry| (entry.split('(').next().unwrap_or_default().trim(), entry))
}

/// Every kernel of the table (the unfused norm kernel included: it is launched with
/// Programmatic Dependent Launch like the others) and the sync floor waits for its predecessor
/// (`griddepcontrol.wait`, in `begin_call`) before it touches memory: the buffer-reuse
/// argument under Programmatic Dependent Launch rests on it. (The SASS test below checks the
/// order of every load and store against the wait.)
#[test]
fn every_call_kernel_waits_for_its_predecessor() {
    if !kernels_or_skip("every_call_kernel_waits_for_its_predecessor") {
        return;
    }
    let mut checked = 0;
    for (name, entry) in entries() {
        if ["symm_empty", "symm_spin", "symm_produce", "symm_consume"]
            .iter()
            .any(|helper| name.starts_with(helper))
        {
            continue;
        }
        assert!(
            entry.contains("griddepcontrol.wait"),
            "{name} does not wait for its predecessor"
        );
        checked += 1;
    }
    // 17 kernels of the registry × 3 dtypes, and the sync floor.
    let expected = 17 * 3 + 1;
    assert!(
        checked >= expected,
        "only {checked} call kernels in the PTX, {expected} expected"
    );
}

#[test]
fn every_kernel_is_present_and_peer_data_moves_in_16_byte_packs() {
    if !kernels_or_skip("every_kernel_is_present_and_peer_data_moves_in_16_byte_packs") {
        return;
    }
    let ptx = symm_allreduce::embedded_ptx();
    for algo in [
        "one_shot",
        "two_shot",
        "in_place",
        "one_shot_ll",
        "all_gather",
        "reduce_scatter",
        "all_gather_ll",
        "reduce_scatter_ll",
        "fused_one_shot",
        "fused_two_shot",
        "fused_ll",
        "in_place_mm",
        "one_shot_mm",
        "one_shot_ll_mm",
    ] {
        for dtype in ["f32", "f16", "bf16"] {
            let name = format!(".entry symm_{algo}_{dtype}(");
            assert!(ptx.contains(&name), "missing kernel {name}");
        }
    }
    assert!(ptx.contains(".entry symm_empty("));
    assert!(ptx.contains(".entry symm_produce("));
    let ops = instructions();
    assert!(
        ops.contains(&"ld.global.cg.v4.u32"),
        "peer loads are not 16-byte vectors"
    );
    assert!(
        ops.iter().any(|o| o.starts_with("st.global.v4")),
        "stores are not 16-byte vectors"
    );
    assert!(ops
        .iter()
        .any(|o| o.contains("globaltimer") || o.starts_with("mov.u64")));
    assert!(
        ptx.contains("%globaltimer"),
        "waits are not bounded by %globaltimer"
    );
}

#[test]
fn ptxas_reports_no_spills_and_no_stack_frame() {
    if !kernels_or_skip("ptxas_reports_no_spills_and_no_stack_frame") {
        return;
    }
    let report = symm_allreduce::ptxas_report();
    let mut functions = 0;
    let mut current = "";
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest;
            functions += 1;
        }
        if line.contains("bytes stack frame") {
            assert!(
                line.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
                    && !line
                        .trim_start()
                        .starts_with(|c: char| c.is_ascii_digit() && c != '0'),
                "{current}: {line}"
            );
        }
    }
    // Every entry point of the PTX (the registry × dtypes, checked by the lib's registry
    // test) × 2 SASS targets.
    let entries = symm_allreduce::embedded_ptx()
        .lines()
        .filter(|l| l.trim_start().starts_with(".visible .entry "))
        .count();
    // 17 kernels × 3 dtypes, the empty kernel, the sync floor, the spin, the producer and the
    // PDL consumer.
    assert_eq!(entries, 17 * 3 + 5, "entry points in the PTX");
    // The multimem kernels (`symm_<kernel>_mm_<dtype>`, min-arch 90) have sm_90 SASS only.
    let sm90_only = symm_allreduce::embedded_ptx()
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry symm_"))
        .filter(|l| l.contains("_mm_"))
        .count();
    assert_eq!(sm90_only, 3 * 3, "multimem entry points");
    assert_eq!(
        functions,
        2 * entries - sm90_only,
        "unexpected ptxas report:\n{report}"
    );
}

#[test]
fn no_driver_or_device_is_a_typed_error_not_a_panic() {
    match symm_allreduce::context(0) {
        Ok(ctx) => {
            // A GPU is present: invalid groups are still typed errors.
            let none = symm_allreduce::Communicator::local_group(&[], Default::default());
            assert!(matches!(
                none,
                Err(symm_allreduce::Error::InvalidWorldSize { world: 0, .. })
            ));
            let nine = symm_allreduce::Communicator::local_group(&vec![ctx; 9], Default::default());
            assert!(matches!(
                nine,
                Err(symm_allreduce::Error::InvalidWorldSize { world: 9, .. })
            ));
        }
        Err(e) => {
            assert!(
                matches!(
                    e,
                    symm_allreduce::Error::DriverUnavailable { .. } | symm_allreduce::Error::NoDevice
                ),
                "{e:?}"
            );
            // And every entry point says the same, without panicking.
            assert!(symm_allreduce::device_count().is_err());
        }
    }
    let far = symm_allreduce::context(1000);
    assert!(far.is_err());
}

#[path = "../build/support.rs"]
mod build_support;

#[test]
fn build_settings_are_parsed_and_unsafe_flags_refused() {
    use build_support::{min_arch, parse_archs, reject_unsafe_flags, unity_source};
    assert_eq!(parse_archs("80,90").unwrap(), build_support::DEFAULT_ARCHS);
    assert_eq!(parse_archs("sm_90 80 90").unwrap(), vec![80, 90]);
    assert_eq!(parse_archs("compute_100").unwrap(), vec![100]);
    for bad in ["", "70", "ninety", "80,x"] {
        assert!(parse_archs(bad).is_err(), "{bad:?}");
    }
    assert!(reject_unsafe_flags("-lineinfo --extra-device-vectorization").is_ok());
    for bad in [
        "--use_fast_math",
        "-use_fast_math",
        "-O3 --ftz=true",
        "--prec-div=false",
        "-prec-sqrt=false",
    ] {
        let e = reject_unsafe_flags(bad).unwrap_err();
        assert!(e.contains("bit-identity"), "{e}");
    }
    assert_eq!(min_arch("// a kernel\n").unwrap(), 80);
    assert_eq!(min_arch("// multimem\n// symm: min-arch 90\n").unwrap(), 90);
    assert!(min_arch("// symm: min-arch x\n").is_err());
    let unity = unity_source(&[("a.cu".into(), 80), ("b.cu".into(), 90)]);
    assert!(unity.contains("#include \"a.cu\"\n"));
    assert!(unity.contains("__CUDA_ARCH__ >= 900\n#include \"b.cu\"\n#endif"));
}

/// A call that `begin_call` refuses (the group is poisoned, or the divergence check failed)
/// has epoch 0, and parity 0 is a buffer a slow peer may still be reading for the previous
/// call: so every kernel returns before it touches its output or the workspace. Checked in
/// the sources (no nvcc needed): every `begin_call` result goes into `epoch`, and the next
/// statement is that return (nothing after it checks the epoch again).
#[test]
fn every_kernel_returns_at_once_on_a_refused_call() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut sites = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "cuh" && e != "cu") {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = source.lines().map(str::trim).collect();
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with("//") || !line.contains("begin_call(a") {
                continue;
            }
            // The epoch is taken into a variable, never passed on (a barrier would run on 0).
            assert!(
                line.starts_with("const uint64_t epoch = ")
                    && (line.ends_with("begin_call(a);") || line.ends_with("begin_call(a, prefetch);")),
                "{}:{}: `{line}`: take the epoch with `const uint64_t epoch = begin_call(a);` \
                 (or `begin_call(a, prefetch);`)",
                path.display(),
                i + 1
            );
            let next = lines[i + 1..]
                .iter()
                .find(|l| !l.is_empty() && !l.starts_with("//"));
            // The one exception: a block of a thread-block cluster returns through the
            // stand-down, which keeps the cluster's barriers and touches no global memory
            // (kernels/fused_norm.cuh: blocks of one cluster may decide differently).
            assert!(
                matches!(
                    next.copied(),
                    Some(
                        "if (epoch == 0) return;"
                            | "if (epoch == 0) return fused_ll_stand_down(failures, cluster);"
                    )
                ),
                "{}:{}: a kernel goes on after begin_call refused the call: {next:?}",
                path.display(),
                i + 1
            );
            sites += 1;
        }
        // What `begin_call` runs before the block's vote (`prefetch`) only loads: a refused
        // call writes nothing.
        if let Err(problem) = prefetches_only_load(&lines) {
            panic!("{}: {problem}", path.display());
        }
    }
    // one-shot, two-shot, in-place, low-latency, reduce-scatter (both), all-gather (both),
    // pool two-shot, the three fused kernels and the sync floor.
    assert!(sites >= 13, "only {sites} kernels call begin_call");
}

/// Checks every `const auto prefetch = [&] { ... };` lambda of a kernel source (trimmed
/// lines): every assignment's target is a register (a name or a field of one), and no line
/// calls a store, a push, an atomic or an error/poison writer.
fn prefetches_only_load(lines: &[&str]) -> Result<(), String> {
    const STORES: [&str; 7] = [
        "st_rel",
        "st_line",
        "store",
        "broadcast",
        "atomic",
        "note_error",
        "poison",
    ];
    let mut in_prefetch = false;
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("const auto prefetch = [&] {") {
            in_prefetch = true;
        } else if in_prefetch && *line == "};" {
            in_prefetch = false;
        } else if in_prefetch {
            let parts: Vec<&str> = line.split(" = ").collect();
            let assigns_memory = parts[..parts.len() - 1].iter().any(|lhs| {
                let target = lhs.rsplit([' ', '(', '{']).next().unwrap_or("");
                target.is_empty()
                    || !target
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            });
            if assigns_memory || STORES.iter().any(|s| line.contains(s)) {
                return Err(format!(
                    "line {}: `{line}`: a prefetch stores (only loads into registers belong there)",
                    i + 1
                ));
            }
        }
    }
    if in_prefetch {
        return Err("a prefetch lambda without its `};`".into());
    }
    Ok(())
}

/// The prefetch check refuses what it must (a store through a pointer, an indexed store, a
/// push) and passes register loads.
#[test]
fn the_prefetch_check_refuses_stores() {
    let ok = [
        "const auto prefetch = [&] {",
        "if (loop.first < packs) first = load_pack(in, loop.first, in_aligned);",
        "own_first.x = load_word(in, n, loop.first, is_aligned(in, 4));",
        "};",
    ];
    assert_eq!(prefetches_only_load(&ok), Ok(()));
    for bad in [
        "mine[loop.first] = first;",
        "*out = x;",
        "if (w0 != ~0u) out[w0] = in0;",
        "coll.broadcast_word(buffer, i, own);",
        "store_pack(out, i, v, true);",
        "st_relaxed_sys_u32(p, 1);",
    ] {
        let lines = ["const auto prefetch = [&] {", bad, "};"];
        assert!(prefetches_only_load(&lines).is_err(), "not refused: {bad}");
    }
    assert!(prefetches_only_load(&["const auto prefetch = [&] {", "x = y;"]).is_err());
}

/// A low-latency reader issues every peer's poll load before it looks at any of them: in
/// every reader kernel some poll load is followed by the other seven (one per possible peer)
/// before its own registers are first used — for the 16-byte lines (a u64 pair per load) and,
/// in the unicast all-reduce and the fused kernel, for the word-per-thread path (one u32 per
/// load). When each load was
/// checked before the next was issued, a poll cost W − 1 round trips in a row
/// (docs/design.md, "One round trip per poll").
#[test]
fn low_latency_polls_load_every_peer_before_checking_any() {
    if !kernels_or_skip("low_latency_polls_load_every_peer_before_checking_any") {
        return;
    }
    const LINE_POLL: &str = "ld.relaxed.sys.global.v2.u64";
    const WORD_POLL: &str = "ld.relaxed.sys.global.u32";
    let mut checked = 0;
    for (name, entry) in entries() {
        let readers = [
            "symm_one_shot_ll_",
            "symm_reduce_scatter_ll_",
            "symm_all_gather_ll_",
            "symm_fused_ll_",
        ];
        if !readers.iter().any(|r| name.starts_with(r)) {
            continue;
        }
        let lines: Vec<&str> = entry.lines().map(str::trim).collect();
        // The destination registers of the load on line i: `ld... {%rdA, %rdB}, [addr];` or
        // `ld... %rA, [addr];`.
        let dests = |i: usize| -> Vec<String> {
            let operands = lines[i].split_once(char::is_whitespace).map_or("", |(_, o)| o);
            let regs = match operands.split_once('{') {
                Some((_, rest)) => rest.split('}').next().unwrap_or_default(),
                None => operands.split(',').next().unwrap_or_default(),
            };
            regs.split(',').map(|r| r.trim().to_string()).collect()
        };
        let uses = |line: &str, reg: &str| {
            line.split(|c: char| !(c.is_alphanumeric() || c == '%' || c == '_'))
                .any(|token| token == reg)
        };
        let batched = |poll: &str| {
            let polls: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].starts_with(poll)).collect();
            polls.windows(8).any(|w| {
                let regs = dests(w[0]);
                lines[w[0] + 1..w[7]]
                    .iter()
                    .all(|l| !regs.iter().any(|r| uses(l, r)))
            })
        };
        // The multicast push stores whole lines: only the unicast all-reduce has words
        // beside its lines; the fused kernel has only words.
        let polls = if name.starts_with("symm_fused_ll_") {
            vec![WORD_POLL]
        } else if name.starts_with("symm_one_shot_ll_") && !name.starts_with("symm_one_shot_ll_mm_") {
            vec![LINE_POLL, WORD_POLL]
        } else {
            vec![LINE_POLL]
        };
        for poll in polls {
            assert!(
                batched(poll),
                "{name}: no `{poll}` poll issues all eight peers' loads before checking them"
            );
        }
        checked += 1;
    }
    // The four reader kernels (all-reduce, reduce-scatter, fused: 3 dtypes each; the
    // all-gather is byte-typed, one body per dtype column too).
    assert!(checked >= 12, "only {checked} low-latency readers in the PTX");
}

#[path = "support/sass.rs"]
mod sass;

/// Global-memory instructions of sm_90 SASS (loads, stores, atomics, reductions, cache
/// control): what a kernel must not issue before its `griddepcontrol.wait` (`ACQBULK`).
/// Shared memory (`LDS`, `STS`), constants and kernel parameters (`LDC`, `ULDC`) are not its
/// predecessor's.
fn touches_global_memory(opcode: &str) -> bool {
    let op = opcode.split('.').next().unwrap_or_default();
    matches!(
        op,
        "LD" | "LDG"
            | "ST"
            | "STG"
            | "ATOM"
            | "ATOMG"
            | "RED"
            | "REDG"
            | "LDGSTS"
            | "CCTL"
            | "UBLKCP"
            | "UTMALDG"
    ) || op.starts_with("MULTIMEM")
}

/// Programmatic Dependent Launch is safe for a kernel only if nothing it reads or writes of
/// memory its predecessor may touch comes before its `griddepcontrol.wait`. Read in the sm_90
/// SASS, where the wait is `ACQBULK`: in every kernel the launch attributes give PDL (every
/// kernel of the table, the fused and unfused norm kernels, the one-shot all-gather included,
/// and the empty, sync-floor and spin helpers; not the producer, launched as an ordinary kernel,
/// nor the test consumer, which skips the wait on purpose), the straight-line code before the
/// first `ACQBULK` has no global load, store, atomic or cache operation and no branch past it.
/// So on every path the wait comes first.
#[test]
fn pdl_launched_kernels_touch_no_global_memory_before_griddepcontrol_wait() {
    let test = "pdl_launched_kernels_touch_no_global_memory_before_griddepcontrol_wait";
    if !kernels_or_skip(test) {
        return;
    }
    let Some(sass) = sass::sm90_or_skip(test) else {
        return;
    };
    let mut checked = 0;
    for f in sass {
        if f.name == "symm_produce" || f.name == "symm_consume" {
            continue;
        }
        let waits = f.find("ACQBULK");
        let Some(&first) = waits.first() else {
            panic!("{}: no griddepcontrol.wait (ACQBULK) in the sm_90 SASS", f.name);
        };
        let wait_at = f.instructions[first].0;
        for i in 0..first {
            let op = f.opcode(i);
            assert!(
                !touches_global_memory(op),
                "{}: {} at {:#x} before the PDL wait at {wait_at:#x}",
                f.name,
                f.instructions[i].1,
                f.instructions[i].0
            );
            if op.starts_with("BRA") || op.starts_with("JMP") || op.starts_with("BRX") {
                let target = f.instructions[i]
                    .1
                    .split_whitespace()
                    .last()
                    .and_then(|t| u64::from_str_radix(t.trim_start_matches("0x"), 16).ok())
                    .unwrap_or_else(|| {
                        panic!("{}: branch without a target: {}", f.name, f.instructions[i].1)
                    });
                assert!(
                    target <= wait_at,
                    "{}: {} jumps past the PDL wait at {wait_at:#x}",
                    f.name,
                    f.instructions[i].1
                );
            }
        }
        checked += 1;
    }
    // The sm_90 code of every entry point but the producer and the consumer: 17 kernels × 3
    // dtypes, the empty kernel, the sync floor and the spin.
    assert_eq!(checked, 17 * 3 + 3, "kernels checked in the sm_90 SASS");
}

/// Every kernel that meets its peers lets the next kernel launch before it exits: besides the
/// trigger of `begin_call` (`FLAG_PDL_EARLY`, for ranks with a device of their own) it has one
/// after its first wait on the peers (`pdl_trigger`), which is where ranks that share a device
/// trigger. In the sm_90 SASS `griddepcontrol.launch_dependents` is `PREEXIT`: at least two
/// in every such kernel. A kernel with only `begin_call`'s would leave the next launch to its
/// exit wherever ranks share a device.
#[test]
fn every_collective_kernel_triggers_after_its_first_wait() {
    let test = "every_collective_kernel_triggers_after_its_first_wait";
    if !kernels_or_skip(test) {
        return;
    }
    let Some(sass) = sass::sm90_or_skip(test) else {
        return;
    };
    let helpers = ["symm_produce", "symm_consume", "symm_empty", "symm_spin"];
    let mut checked = 0;
    for f in sass {
        // The epilogue of the unfused pair meets no peer.
        if helpers.contains(&f.name.as_str()) || f.name.starts_with("symm_rmsnorm_") {
            continue;
        }
        let triggers = f.find("PREEXIT").len();
        assert!(
            triggers >= 2,
            "{}: {triggers} griddepcontrol.launch_dependents (PREEXIT) in the sm_90 SASS; a \
             collective kernel needs begin_call's and one after its first wait on the peers",
            f.name
        );
        checked += 1;
    }
    // 16 collective kernels × 3 dtypes and the sync floor.
    assert_eq!(
        checked,
        16 * 3 + 1,
        "collective kernels checked in the sm_90 SASS"
    );
}
