//! Result rows, the bandwidth arithmetic, the nccl-tests-style tables and the CSV/JSON files.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use serde::Serialize;

use crate::args::Mode;

/// `--producer-chain` row: the producer → all-reduce chain on the communicators with PDL on.
pub const CHAIN_PDL: &str = "chain_pdl";
/// The same chain on the twin communicators with `Config::pdl = false`.
pub const CHAIN_NO_PDL: &str = "chain_no_pdl";
/// The producer kernel alone, in the same launch structure.
pub const PRODUCER_ONLY: &str = "producer_only";

/// One measured (dtype, mode, algo, size). Columns are documented in `main.rs` and README.
/// Built with the measured fields and `..Row::default()`, then [`Row::with_derived`] fills
/// the rest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Row {
    pub dtype: String,
    pub mode: Mode,
    pub algo: String,
    pub kernel: String,
    pub placement: String,
    pub world: usize,
    pub blocks: Option<u32>,
    pub size_bytes: usize,
    pub count: usize,
    pub time_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    pub samples: usize,
    pub empty_us: Option<f64>,
    pub over_empty_us: Option<f64>,
    pub host_us: f64,
    pub empty_host_us: Option<f64>,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    pub hbm_gbs: f64,
    pub vs_nccl: Option<f64>,
    /// The fused call's row length (`count` is tokens × hidden); empty for other rows.
    #[serde(default)]
    pub hidden: Option<usize>,
    /// `in` for the in-place calls (`symmetric`, `pool`, `multimem`: the result replaces the
    /// input in the symmetric buffer), `out` for the calls from an input to an output buffer.
    #[serde(default)]
    pub place: String,
    /// nccl-tests' #wrong: elements that differed from the exact sum when the row was checked
    /// (a row that fails is not timed, and is listed among the failures); empty with `-c 0`.
    #[serde(default)]
    pub wrong: Option<u64>,
}

/// CSV header, in `Row` field order.
pub const CSV_HEADER: &str = "dtype,mode,algo,kernel,placement,world,blocks,size_bytes,count,time_us,p10_us,\
p90_us,samples,empty_us,over_empty_us,host_us,empty_host_us,algbw_gbs,busbw_gbs,hbm_gbs,vs_nccl,hidden,place,wrong";

/// algbw = S / t, in GB/s (10^9 bytes per second), for `bytes` and `us` microseconds.
pub fn algbw_gbs(bytes: usize, us: f64) -> f64 {
    bytes as f64 / us / 1e3
}

/// busbw = algbw · 2(W-1)/W, as nccl-tests reports for all-reduce.
pub fn busbw_gbs(algbw: f64, world: usize) -> f64 {
    algbw * 2.0 * (world as f64 - 1.0) / world as f64
}

/// Distinct HBM bytes over time: every rank's input read once and output written once,
/// 2·W·S / t, in GB/s.
pub fn hbm_gbs(bytes: usize, world: usize, us: f64) -> f64 {
    2.0 * world as f64 * bytes as f64 / us / 1e3
}

impl Row {
    /// Fills the derived columns from the measured ones.
    pub fn with_derived(mut self) -> Row {
        self.algbw_gbs = algbw_gbs(self.size_bytes, self.time_us);
        self.busbw_gbs = busbw_gbs(self.algbw_gbs, self.world);
        self.hbm_gbs = hbm_gbs(self.size_bytes, self.world, self.time_us);
        self.over_empty_us = self.empty_us.map(|e| self.time_us - e);
        self.place = if self.kernel.starts_with("in_place") {
            "in"
        } else {
            "out"
        }
        .into();
        self
    }

    /// Whether this row times an all-gather, a reduce-scatter, the fused call or a producer
    /// chain row (not compared with the NCCL all-reduce rows).
    pub fn is_other_call(&self) -> bool {
        self.hidden.is_some()
            || matches!(
                self.algo.as_str(),
                "all_gather" | "reduce_scatter" | CHAIN_PDL | CHAIN_NO_PDL | PRODUCER_ONLY
            )
    }

    /// Whether this is the NCCL baseline.
    pub fn is_nccl(&self) -> bool {
        self.algo == "nccl"
    }

    /// The algorithm as shown in the tables.
    pub fn label(&self, group_world: usize) -> String {
        if (self.is_nccl() || self.algo == "nccl_symm") && self.world != group_world {
            format!("{} (world {}: one GPU)", self.algo, self.world)
        } else if self.algo != self.kernel {
            format!("{}→{}", self.algo, self.kernel)
        } else {
            self.algo.clone()
        }
    }

    /// The row as written to results.csv: every measured and derived float rounded to
    /// 4 decimals (the JSON keeps full precision).
    fn for_csv(&self) -> Row {
        let r4 = |x: f64| (x * 1e4).round() / 1e4;
        let o4 = |x: Option<f64>| x.map(r4);
        Row {
            time_us: r4(self.time_us),
            p10_us: r4(self.p10_us),
            p90_us: r4(self.p90_us),
            empty_us: o4(self.empty_us),
            over_empty_us: o4(self.over_empty_us),
            host_us: r4(self.host_us),
            empty_host_us: o4(self.empty_host_us),
            algbw_gbs: r4(self.algbw_gbs),
            busbw_gbs: r4(self.busbw_gbs),
            hbm_gbs: r4(self.hbm_gbs),
            vs_nccl: o4(self.vs_nccl),
            ..self.clone()
        }
    }
}

/// Sets `vs_nccl` = time / NCCL's time for every non-NCCL row whose (dtype, mode, size) has
/// an NCCL row.
pub fn fill_nccl_ratios(rows: &mut [Row]) {
    let nccl: Vec<(String, Mode, usize, f64)> = rows
        .iter()
        .filter(|r| r.is_nccl())
        .map(|r| (r.dtype.clone(), r.mode, r.size_bytes, r.time_us))
        .collect();
    for r in rows.iter_mut().filter(|r| !r.is_nccl() && !r.is_other_call()) {
        r.vs_nccl = nccl
            .iter()
            .find(|(d, m, s, _)| *d == r.dtype && *m == r.mode && *s == r.size_bytes)
            .map(|&(_, _, _, t)| r.time_us / t);
    }
}

/// Marks every row as checked (`#wrong` 0: the rows that are kept passed the check) when the
/// run verifies (`-c 1`); with `-c 0` the column stays empty.
pub fn fill_checked(rows: &mut [Row], check: bool) {
    for r in rows.iter_mut().filter(|r| r.wrong.is_none()) {
        r.wrong = check.then_some(0);
    }
}

/// nccl-tests' closing lines: the rows that failed their check, and the average bus bandwidth
/// of the all-reduce rows (over every size, mode, dtype and algorithm that ran, NCCL's
/// included, as nccl-tests averages over its rows), then the same per algorithm.
pub fn nccl_tests_summary(rows: &[Row], failed: usize) -> Vec<String> {
    let all_reduce: Vec<&Row> = rows.iter().filter(|r| !r.is_other_call()).collect();
    let avg = |rs: &[&Row]| rs.iter().map(|r| r.busbw_gbs).sum::<f64>() / rs.len().max(1) as f64;
    let mut out = vec![format!(
        "# Out of bounds values : {failed} {}",
        if failed == 0 { "OK" } else { "FAILED" }
    )];
    out.push(format!("# Avg bus bandwidth    : {:.3} ", avg(&all_reduce)));
    let mut algos: Vec<&str> = Vec::new();
    for r in &all_reduce {
        if !algos.contains(&r.algo.as_str()) {
            algos.push(&r.algo);
        }
    }
    if algos.len() > 1 {
        let each: Vec<String> = algos
            .iter()
            .map(|a| {
                let rs: Vec<&Row> = all_reduce.iter().copied().filter(|r| r.algo == *a).collect();
                format!("{a} {:.3}", avg(&rs))
            })
            .collect();
        out.push(format!("#   per algorithm (GB/s): {}", each.join(", ")));
    }
    out
}

/// The whole CSV file: the header (the `Row` field names, [`CSV_HEADER`]) and one record per
/// row, written by the `csv` crate (quoting, if a field ever needs it, included).
pub fn csv(rows: &[Row]) -> io::Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    if rows.is_empty() {
        w.write_record(CSV_HEADER.split(','))?;
    }
    for r in rows {
        w.serialize(r.for_csv())?;
    }
    let bytes = w.into_inner().map_err(|e| io::Error::other(e.to_string()))?;
    String::from_utf8(bytes).map_err(io::Error::other)
}

/// `75.0` -> `about 1 min 15 s`, `12.3` -> `about 12 s`.
pub fn format_duration(secs: f64) -> String {
    let s = secs.round().max(1.0) as u64;
    if s < 60 {
        format!("about {s} s")
    } else if s < 3600 {
        format!("about {} min {} s", s / 60, s % 60)
    } else {
        format!("about {} h {} min", s / 3600, (s % 3600) / 60)
    }
}

/// Run-wide facts stored beside the rows in results.json.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Meta {
    pub tool: String,
    pub devices: Vec<String>,
    pub placement: String,
    pub world: usize,
    pub capacity_bytes: usize,
    /// The rough duration model's estimate for the whole run, seconds.
    pub estimated_duration_s: Option<f64>,
    pub nccl: String,
    /// cuMemcpyDtoDAsync of 1 GiB, (read + write bytes) / median time, GB/s.
    pub d2d_copy_gbs: Option<f64>,
    /// Median replay of one graph per rank holding one empty kernel (W ranks, fork/join).
    pub empty_graph_floor_us: Option<f64>,
    /// The grid of that empty kernel: blocks per rank.
    pub empty_graph_floor_blocks: Option<u32>,
    pub gate_timeouts: usize,
    /// `--launcher processes`: whether an MPS daemon served the ranks.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mps: String,
    pub notes: Vec<String>,
    pub failures: Vec<String>,
}

#[derive(Serialize)]
struct Results<'a> {
    meta: &'a Meta,
    rows: &'a [Row],
}

/// Writes results.csv and results.json into `dir`.
pub fn write_files(dir: &Path, meta: &Meta, rows: &[Row]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("results.csv"), csv(rows)?)?;
    let json = serde_json::to_string_pretty(&Results { meta, rows }).map_err(io::Error::other)?;
    std::fs::write(dir.join("results.json"), json + "\n")
}

/// The nccl-tests-style table of one dtype and mode (rows in the order given).
pub fn table(rows: &[&Row], dtype: &str, mode: Mode, group_world: usize, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#\n# dtype {dtype}, mode {} — {title}", mode.name());
    let _ = writeln!(
        s,
        "# {:>10} {:>10}  {:<24} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>6}",
        "size",
        "count",
        "algo",
        "place",
        "time_us",
        "p10_us",
        "p90_us",
        "empty_us",
        "-empty",
        "host_us",
        "algbw",
        "busbw",
        "hbm_GB/s",
        "vs_nccl",
        "#wrong"
    );
    let opt = |v: Option<f64>, prec: usize| v.map_or_else(|| "-".to_string(), |x| format!("{x:.prec$}"));
    for r in rows {
        let _ = writeln!(
            s,
            "  {:>10} {:>10}  {:<24} {:>5} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>8} {:>6}",
            r.size_bytes,
            r.count,
            r.label(group_world),
            r.place,
            r.time_us,
            r.p10_us,
            r.p90_us,
            opt(r.empty_us, 2),
            opt(r.over_empty_us, 2),
            r.host_us,
            r.algbw_gbs,
            r.busbw_gbs,
            r.hbm_gbs,
            opt(r.vs_nccl, 2),
            r.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string()),
        );
    }
    s
}

/// The one-GPU target proxies of the performance guide, where the rows exist.
pub fn summary(rows: &[Row], d2d_copy_gbs: Option<f64>) -> Vec<String> {
    let find = |algo: &str, mode: Mode, size: usize| {
        rows.iter()
            .find(|r| r.dtype == "bf16" && r.algo == algo && r.mode == mode && r.size_bytes == size)
    };
    let mut out = vec!["#\n# target proxies (bf16)".to_string()];
    if let Some(r) = find("one_shot", Mode::GraphIsolated, 8 << 10) {
        if let (Some(e), Some(d)) = (r.empty_us, r.over_empty_us) {
            out.push(format!(
                "#   small message, 8K one_shot graph_isolated: {:.2} µs = empty {e:.2} + {d:.2} µs \
                 (target: empty + 2.0 µs)",
                r.time_us
            ));
        }
    }
    if let Some(r) = find("low_latency", Mode::GraphIsolated, 8 << 10) {
        if let (Some(e), Some(d)) = (r.empty_us, r.over_empty_us) {
            out.push(format!(
                "#   small message, 8K low_latency graph_isolated: {:.2} µs = empty {e:.2} + {d:.2} µs \
                 (target for the barrier-free path: empty + 1.0 µs)",
                r.time_us
            ));
        }
    }
    if let Some(r) = find("one_shot", Mode::Eager, 8 << 10) {
        if let Some(e) = r.empty_host_us {
            out.push(format!(
                "#   host cost of one eager call, 8K one_shot: {:.2} µs vs {e:.2} µs for the empty launch \
                 (+{:.2}; target: at most +1.5 µs)",
                r.host_us,
                r.host_us - e
            ));
        }
    }
    let chain = [Mode::GraphAmortised, Mode::GraphIsolated, Mode::Eager]
        .into_iter()
        .find_map(|m| Some((find(CHAIN_PDL, m, 8 << 10)?, find(CHAIN_NO_PDL, m, 8 << 10)?)));
    if let Some((on, off)) = chain {
        let alone = find(PRODUCER_ONLY, on.mode, 8 << 10).map_or_else(String::new, |p| {
            format!("; the producer alone {:.2} µs", p.time_us)
        });
        out.push(format!(
            "#   producer→all-reduce, PDL on vs off: {:.2} vs {:.2} µs (8K {}, auto→{}{alone})",
            on.time_us,
            off.time_us,
            on.mode.name(),
            on.kernel
        ));
    }
    for algo in ["two_shot", "symmetric", "pool", "one_shot"] {
        let r =
            find(algo, Mode::GraphAmortised, 64 << 20).or_else(|| find(algo, Mode::GraphIsolated, 64 << 20));
        if let Some(r) = r {
            let vs_copy =
                d2d_copy_gbs.map_or_else(String::new, |c| format!(" = {:.2} × D2D copy", r.hbm_gbs / c));
            let target = match algo {
                "two_shot" => " (target: ≥ 0.7 × copy; includes the fused copy-in)",
                "symmetric" => " (zero-copy two-shot; target: ≥ 0.7 × copy)",
                "pool" => " (zero-copy from a pool buffer, no copy-in; target: ≥ 0.85 × copy)",
                _ => " (reported, not targeted)",
            };
            out.push(format!(
                "#   64M {algo} {}: {:.1} µs, hbm {:.1} GB/s{vs_copy}{target}",
                r.mode.name(),
                r.time_us,
                r.hbm_gbs
            ));
        }
    }
    if out.len() == 1 {
        out.clear();
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn row(algo: &str, mode: Mode, size: usize, time_us: f64) -> Row {
        Row {
            dtype: "bf16".into(),
            mode,
            algo: algo.into(),
            kernel: if algo == "auto" {
                "one_shot".into()
            } else {
                algo.into()
            },
            placement: "virtual".into(),
            world: if algo == "nccl" { 1 } else { 8 },
            blocks: (algo != "nccl").then_some(2),
            size_bytes: size,
            count: size / 2,
            time_us,
            p10_us: time_us * 0.9,
            p90_us: time_us * 1.1,
            samples: 200,
            empty_us: (algo != "nccl").then_some(3.0),
            host_us: 2.5,
            empty_host_us: None,
            ..Row::default()
        }
        .with_derived()
    }

    #[test]
    fn bandwidth_arithmetic() {
        // 1 MB in 10 us = 100 GB/s.
        assert!((algbw_gbs(1_000_000, 10.0) - 100.0).abs() < 1e-9);
        assert!((busbw_gbs(100.0, 8) - 175.0).abs() < 1e-9);
        assert_eq!(busbw_gbs(100.0, 1), 0.0);
        assert!((busbw_gbs(100.0, 2) - 100.0).abs() < 1e-9);
        assert!((hbm_gbs(1_000_000, 8, 10.0) - 1600.0).abs() < 1e-9);
        let r = row("one_shot", Mode::GraphIsolated, 1_000_000, 10.0);
        assert!((r.algbw_gbs - 100.0).abs() < 1e-9);
        assert!((r.busbw_gbs - 175.0).abs() < 1e-9);
        assert!((r.hbm_gbs - 1600.0).abs() < 1e-9);
        assert_eq!(r.over_empty_us, Some(7.0));
    }

    #[test]
    fn wrong_place_and_the_nccl_tests_summary() {
        let mut rows = vec![
            row("two_shot", Mode::GraphAmortised, 1 << 20, 10.0),
            row("symmetric", Mode::GraphAmortised, 1 << 20, 5.0),
            row("nccl", Mode::GraphAmortised, 1 << 20, 20.0),
        ];
        rows[1].kernel = "in_place".into();
        rows[1] = rows[1].clone().with_derived();
        assert_eq!((rows[0].place.as_str(), rows[1].place.as_str()), ("out", "in"));
        fill_checked(&mut rows, false);
        assert!(rows.iter().all(|r| r.wrong.is_none()));
        let t = table(
            &rows.iter().collect::<Vec<_>>(),
            "bf16",
            Mode::GraphAmortised,
            8,
            "t",
        );
        assert!(t.contains("#wrong") && t.contains("N/A"), "{t}");
        fill_checked(&mut rows, true);
        assert!(rows.iter().all(|r| r.wrong == Some(0)));
        let s = nccl_tests_summary(&rows, 0);
        assert_eq!(s[0], "# Out of bounds values : 0 OK");
        // The mean of the three rows' busbw.
        let mean = rows.iter().map(|r| r.busbw_gbs).sum::<f64>() / 3.0;
        assert_eq!(s[1], format!("# Avg bus bandwidth    : {mean:.3} "));
        assert!(s[2].contains("two_shot") && s[2].contains("nccl"), "{}", s[2]);
        assert!(nccl_tests_summary(&rows, 2)[0].ends_with("2 FAILED"));
    }

    #[test]
    fn csv_rows_match_the_header() {
        let r = row("auto", Mode::GraphAmortised, 8192, 6.25);
        let n = row("nccl", Mode::Eager, 8192, 20.0);
        let file = csv(&[r.clone(), n]).unwrap();
        let lines: Vec<&str> = file.lines().collect();
        assert_eq!(lines.len(), 3);
        // The header is exactly the documented column list, in order.
        assert_eq!(lines[0], CSV_HEADER);
        assert_eq!(
            lines[1],
            "bf16,graph_amortised,auto,one_shot,virtual,8,2,8192,4096,6.25,5.625,6.875,200,3.0,\
             3.25,2.5,,1.3107,2.2938,20.9715,,,out,"
        );
        let fused = Row {
            algo: "fused_one_shot".into(),
            hidden: Some(4096),
            ..r.clone()
        };
        assert!(csv(&[fused]).unwrap().trim_end().ends_with(",4096,out,"));
        assert!(lines[2].contains(",nccl,nccl,virtual,1,,8192,"), "{}", lines[2]);
        for l in &lines {
            assert_eq!(l.split(',').count(), CSV_HEADER.split(',').count(), "{l}");
        }
        // Read back by the same crate: the values survive (to 4 decimals).
        let mut rd = ::csv::Reader::from_reader(file.as_bytes());
        let back: Vec<Row> = rd.deserialize().collect::<Result<_, _>>().unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].mode, Mode::GraphAmortised);
        assert_eq!(back[0].time_us, 6.25);
        assert_eq!(back[0].vs_nccl, None);
        assert_eq!(back[1].blocks, None);
        // No rows: still the header.
        assert_eq!(csv(&[]).unwrap(), format!("{CSV_HEADER}\n"));
    }

    #[test]
    fn nccl_ratio_matches_dtype_mode_and_size() {
        let mut rows = vec![
            row("one_shot", Mode::Eager, 8192, 5.0),
            row("one_shot", Mode::GraphIsolated, 8192, 4.0),
            row("two_shot", Mode::Eager, 16384, 5.0),
            row("nccl", Mode::Eager, 8192, 20.0),
        ];
        fill_nccl_ratios(&mut rows);
        assert_eq!(rows[0].vs_nccl, Some(0.25));
        assert_eq!(rows[1].vs_nccl, None);
        assert_eq!(rows[2].vs_nccl, None);
        assert_eq!(rows[3].vs_nccl, None);
    }

    #[test]
    fn labels_and_tables() {
        let a = row("auto", Mode::Eager, 8192, 5.0);
        let n = row("nccl", Mode::Eager, 8192, 20.0);
        assert_eq!(a.label(8), "auto→one_shot");
        assert_eq!(n.label(8), "nccl (world 1: one GPU)");
        assert_eq!(n.label(1), "nccl");
        let t = table(&[&a, &n], "bf16", Mode::Eager, 8, "W=8 virtual ranks");
        assert!(t.contains("mode eager"));
        assert!(t.contains("auto→one_shot"));
        assert_eq!(t.lines().count(), 5);
    }

    #[test]
    fn summary_names_the_proxies() {
        assert!(summary(&[], Some(4000.0)).is_empty());
        let rows = vec![
            row("one_shot", Mode::GraphIsolated, 8192, 5.0),
            row("two_shot", Mode::GraphAmortised, 64 << 20, 500.0),
        ];
        let s = summary(&rows, Some(4000.0)).join("\n");
        assert!(s.contains("empty 3.00 + 2.00 µs"), "{s}");
        // 2·8·64 MiB / 500 µs = 2147.5 GB/s, 0.54 of 4000.
        assert!(s.contains("hbm 2147.5 GB/s = 0.54 × D2D copy"), "{s}");
    }

    #[test]
    fn producer_chain_rows_are_labelled_summarised_and_not_compared_with_nccl() {
        let kernel = |r: Row, k: &str| Row {
            kernel: k.into(),
            ..r
        };
        let mut rows = vec![
            kernel(row(CHAIN_PDL, Mode::GraphAmortised, 8192, 7.5), "low_latency"),
            kernel(row(CHAIN_NO_PDL, Mode::GraphAmortised, 8192, 8.25), "low_latency"),
            row(PRODUCER_ONLY, Mode::GraphAmortised, 8192, 3.0),
            row("nccl", Mode::GraphAmortised, 8192, 20.0),
        ];
        fill_nccl_ratios(&mut rows);
        assert!(rows.iter().all(|r| r.vs_nccl.is_none()));
        assert_eq!(rows[0].label(8), "chain_pdl→low_latency");
        assert_eq!(rows[1].label(8), "chain_no_pdl→low_latency");
        assert_eq!(rows[2].label(8), "producer_only");
        let s = summary(&rows, None).join("\n");
        assert!(
            s.contains(
                "#   producer→all-reduce, PDL on vs off: 7.50 vs 8.25 µs (8K graph_amortised, \
                 auto→low_latency; the producer alone 3.00 µs)"
            ),
            "{s}"
        );
        // Only where both halves exist.
        assert!(summary(&rows[..1], None).is_empty());
        // Another size, no line.
        let other: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                size_bytes: 32768,
                ..r.clone()
            })
            .collect();
        assert!(summary(&other, None).is_empty());
    }

    #[test]
    fn files_are_written() {
        let dir = std::env::temp_dir().join(format!("symm-bench-report-{}", std::process::id()));
        let rows = vec![row("one_shot", Mode::Eager, 8192, 5.0)];
        write_files(&dir, &Meta::default(), &rows).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
        assert_eq!(json["rows"][0]["mode"], "eager");
        assert_eq!(json["rows"][0]["size_bytes"], 8192);
        assert!(json["meta"]["d2d_copy_gbs"].is_null());
        let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
        assert_eq!(csv.lines().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
