//! The tuning table: `Auto`'s crossovers as measured on one machine (`symm-bench --tune`
//! writes it), read from a small versioned JSON file and checked before any rank uses it.
//!
//! ```json
//! {
//!   "format": "symm-allreduce tuning table",
//!   "version": 3,
//!   "measured": {
//!     "device": "NVIDIA H200", "driver": "580.95.05", "date": "2026-12-03T08:10:00Z",
//!     "crate_version": "0.1.0", "placement": "virtual", "note": "..."
//!   },
//!   "crossovers": [
//!     { "dtype": "bf16", "world": 8,
//!       "max_bytes": { "low_latency": 65536, "one_shot": 262144, "two_shot": 8388608 } },
//!     { "dtype": "bf16", "world": 4,
//!       "max_bytes": { "low_latency": 262144, "two_shot_ll": 524288, "one_shot": 1572864 } }
//!   ],
//!   "fused": [
//!     { "dtype": "bf16", "world": 8, "hidden": 8192, "max_tokens": { "one_shot": 16 } }
//!   ]
//! }
//! ```
//!
//! Each `max_bytes` value is the largest message (bytes per rank, inclusive) that `Auto` gives
//! that algorithm: low-latency up to `low_latency`, one-shot up to `one_shot`, two-shot above,
//! and NCCL above `two_shot` when it is given (where NCCL was measured; it needs a fallback).
//! The values must not decrease in that order; `low_latency: 0` turns the low-latency kernel
//! off, and equal values leave an algorithm no sizes. A (dtype, world) the table does not name
//! keeps the published starting points.
//!
//! `two_shot_ll` (optional; `--tune` writes it from version 3) opens a band between
//! `low_latency` and `one_shot` where the two-shot over the low-latency lines beats the
//! one-shot (measured: four ranks on one H100, bf16 and f16, 384–512 KiB,
//! docs/bench/h100-tune-v17): `Auto` takes that kernel above `low_latency` up to
//! `two_shot_ll` wherever a shard's halves fit its lines ([`crate::Config::low_latency_limit`]
//! and the world's published low-latency threshold), and the one-shot above it (and wherever
//! they do not fit). It must lie between `low_latency` and `one_shot`.
//!
//! `fused` holds the crossovers of the fused all-reduce + residual + RMSNorm call
//! ([`crate::Communicator::all_reduce_add_rmsnorm`]): above the fused low-latency kernel's
//! range, `Auto` takes the fused one-shot for calls of up to `max_tokens.one_shot` rows
//! (tokens, inclusive; 0: never) and the fused two-shot above. Entries are per (dtype, world,
//! hidden size); a call whose hidden size was not measured takes the entry of the nearest
//! measured one (by ratio; a tie goes to the larger), with its token limit unchanged (the
//! one-shot and two-shot run one block per row, so rows, not bytes, set the grid). A (dtype,
//! world) without fused entries keeps the published rule: the all-reduce's one-shot limit in
//! bytes. NCCL is not measured for the fused call: it takes NCCL (then the unfused epilogue)
//! only above `Config::nccl_above_bytes`, or the capacity.
//!
//! Version 1 (no `fused` section) still loads, as a table without fused entries; a file of
//! version 2 or 3 must have the section (`[]` when nothing was measured). Version 3 adds
//! `two_shot_ll`, which builds that read only version 2 refuse as an unknown algorithm.
//!
//! The table is resolved once, when it is built, into dense `[dtype][world]` arrays: a call
//! looks its thresholds up by index (the fused call scans its few hidden sizes), without
//! allocating.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::fnv1a;
use crate::dtype::DType;
use crate::error::{Error, Result, TuningProblem};
use crate::kernels::abi::MAX_RANKS;
use crate::kernels::norm_abi::MAX_HIDDEN;

/// The `format` string every table file carries.
pub const TUNING_FORMAT: &str = "symm-allreduce tuning table";

/// The format version this build writes (and the newest it reads).
pub const TUNING_VERSION: u64 = 3;

/// The oldest format version this build reads (version 1: no `fused` section).
pub const TUNING_OLDEST_VERSION: u64 = 1;

/// Environment variable: a tuning table file that setup loads on every rank whose
/// [`crate::Config::tuning`] is `None`.
pub const TUNING_ENV: &str = "SYMM_ALLREDUCE_TUNING";

/// This crate's version, as recorded in the tables it measures.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The algorithm names a table's `max_bytes` may hold, in routing order.
const ALGORITHMS: [&str; 4] = ["low_latency", "two_shot_ll", "one_shot", "two_shot"];

/// The algorithm names a fused entry's `max_tokens` may hold (two-shot takes the rest).
const FUSED_ALGORITHMS: [&str; 1] = ["one_shot"];

const REGENERATE: &str = "regenerate the table with `symm-bench --tune OUT.json` of this version";

/// The messages of [`TuningProblem`] (defined beside the error type, which carries it),
/// here beside the table format they talk about.
impl std::fmt::Display for TuningProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TuningProblem::Io { detail } => write!(
                f,
                "cannot be read ({detail}); check the path (Config::with_tuning_file or ${TUNING_ENV})"
            ),
            TuningProblem::Malformed { detail } => write!(f, "is not a valid table ({detail}); {REGENERATE}"),
            TuningProblem::NotATable => write!(
                f,
                "is not a tuning table (no \"format\": \"{TUNING_FORMAT}\"); point {TUNING_ENV} at a file \
                 written by `symm-bench --tune`"
            ),
            TuningProblem::WrongVersion { found, supported } => write!(
                f,
                "has format version {found}, but this build reads versions {TUNING_OLDEST_VERSION} to \
                 {supported}; {REGENERATE}, or use a symm-allreduce that reads version {found}"
            ),
            TuningProblem::MissingField { field } => {
                write!(f, "lacks the required field `{field}`; add it or {REGENERATE}")
            }
            TuningProblem::UnknownAlgorithm { at, name } => write!(
                f,
                "names the unknown algorithm {name:?} at `{at}`: max_bytes takes low_latency, two_shot_ll, \
                 one_shot and two_shot (NCCL takes what lies above two_shot's max; Auto is what the table decides); \
                 remove or rename it"
            ),
            TuningProblem::UnknownDType { at, name } => {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                write!(
                    f,
                    "names the unknown dtype {name:?} at `{at}`: expected one of {}; remove the entry",
                    names.join(", ")
                )
            }
            TuningProblem::BadWorld { at, world } => write!(
                f,
                "has world {world} at `{at}`: world sizes are 1..={MAX_RANKS}; remove the entry"
            ),
            TuningProblem::NonMonotone { dtype, world, detail } => write!(
                f,
                "has thresholds for {dtype} at W={world} that decrease ({detail}): low_latency <= two_shot_ll \
                 <= one_shot <= two_shot must hold; fix the entry or {REGENERATE}"
            ),
            TuningProblem::Duplicate { dtype, world } => {
                write!(f, "has two entries for {dtype} at W={world}; keep one")
            }
            TuningProblem::UnknownFusedAlgorithm { at, name } => write!(
                f,
                "names the unknown fused algorithm {name:?} at `{at}`: max_tokens takes one_shot (the fused \
                 two-shot takes the tokens above it; the fused call has no low-latency kernel and NCCL is \
                 not tuned for it); remove or rename it"
            ),
            TuningProblem::BadHidden { at, dtype, hidden } => write!(
                f,
                "has hidden size {hidden} at `{at}`: the fused call takes {dtype} hidden sizes that are \
                 multiples of {} up to {MAX_HIDDEN}; fix the entry or {REGENERATE}",
                dtype.per_pack()
            ),
            TuningProblem::DuplicateFused { dtype, world, hidden } => {
                write!(
                    f,
                    "has two fused entries for {dtype} at W={world}, hidden {hidden}; keep one"
                )
            }
        }
    }
}

/// Where and when a table was measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// Device name (`NVIDIA H200`), one per distinct device, comma-separated.
    pub device: String,
    /// NVIDIA driver version (`580.95.05`), or what could be learnt of it.
    pub driver: String,
    /// When, as an RFC 3339 UTC time.
    pub date: String,
    /// The symm-allreduce version that measured it ([`VERSION`]).
    pub crate_version: String,
    /// `virtual` (all ranks on one GPU), `per_gpu`, ...
    pub placement: String,
    /// Free text: what the numbers mean, what was not measured.
    #[serde(default)]
    pub note: String,
}

/// The crossovers of one (dtype, world): the largest message, in bytes per rank (inclusive),
/// that `Auto` gives each algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Crossovers {
    /// Element type.
    pub dtype: DType,
    /// Number of ranks.
    pub world: usize,
    /// Low-latency up to this (0: never).
    pub low_latency_max_bytes: usize,
    /// The two-shot over the low-latency lines above `low_latency_max_bytes` up to this, where
    /// a shard fits them (between the low-latency and one-shot thresholds); `None`: no band.
    pub two_shot_ll_max_bytes: Option<usize>,
    /// One-shot up to this (at least `low_latency_max_bytes`).
    pub one_shot_max_bytes: usize,
    /// Two-shot up to this and NCCL above, where NCCL was measured (at least
    /// `one_shot_max_bytes`); `None`: two-shot up to the capacity.
    pub two_shot_max_bytes: Option<usize>,
}

/// The fused all-reduce + residual + RMSNorm call's crossover at one (dtype, world, hidden):
/// the fused one-shot for calls of up to `one_shot_max_tokens` rows, the fused two-shot above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusedCrossovers {
    /// Element type.
    pub dtype: DType,
    /// Number of ranks.
    pub world: usize,
    /// Row length (the weight's length) it was measured at.
    pub hidden: usize,
    /// One-shot up to this many tokens (rows, inclusive; 0: never).
    pub one_shot_max_tokens: usize,
}

/// A checked tuning table (see the module documentation for the file format). Built only
/// through [`TuningTable::new`] (and [`TuningTable::with_fused`]), [`TuningTable::from_json`]
/// or [`TuningTable::load`], so its thresholds always increase in routing order, every
/// (dtype, world) appears at most once, and every fused (dtype, world, hidden) at most once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuningTable {
    measured: Measured,
    /// Sorted by (dtype, world).
    entries: Vec<Crossovers>,
    /// `[dtype index][world - 1]`: the lookup a call makes.
    dense: [[Option<Crossovers>; MAX_RANKS]; DType::COUNT],
    /// Sorted by (dtype, world, hidden).
    fused: Vec<FusedCrossovers>,
    /// `[dtype index][world - 1]`: the range of `fused` holding that (dtype, world).
    fused_ranges: [[(usize, usize); MAX_RANKS]; DType::COUNT],
    /// The file it was loaded from.
    origin: Option<PathBuf>,
    digest: u64,
    /// The largest low-latency threshold (sizes the slots; read on the call path).
    max_low_latency: usize,
}

/// The file's shape (every field optional so that a missing one is reported by name).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    format: Option<String>,
    version: Option<u64>,
    measured: Option<FileMeasured>,
    crossovers: Option<Vec<FileEntry>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fused: Option<Vec<FileFused>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMeasured {
    device: Option<String>,
    driver: Option<String>,
    date: Option<String>,
    crate_version: Option<String>,
    placement: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    note: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    dtype: Option<String>,
    world: Option<u64>,
    max_bytes: Option<BTreeMap<String, Option<u64>>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFused {
    dtype: Option<String>,
    world: Option<u64>,
    hidden: Option<u64>,
    max_tokens: Option<BTreeMap<String, Option<u64>>>,
}

fn missing(field: String) -> TuningProblem {
    TuningProblem::MissingField { field }
}

/// The dtype and world of the entry at `at` (both required).
fn dtype_and_world(
    dtype: Option<String>,
    world: Option<u64>,
    at: &str,
) -> std::result::Result<(DType, usize), TuningProblem> {
    let name = dtype.ok_or_else(|| missing(format!("{at}.dtype")))?;
    let dtype = name.parse::<DType>().map_err(|_| TuningProblem::UnknownDType {
        at: format!("{at}.dtype"),
        name: name.clone(),
    })?;
    let world = world.ok_or_else(|| missing(format!("{at}.world")))?;
    if world == 0 || world > MAX_RANKS as u64 {
        return Err(TuningProblem::BadWorld {
            at: format!("{at}.world"),
            world,
        });
    }
    Ok((dtype, world as usize))
}

fn bytes_value(v: u64, at: &str) -> std::result::Result<usize, TuningProblem> {
    usize::try_from(v).map_err(|_| TuningProblem::Malformed {
        detail: format!("`{at}` = {v} does not fit this machine's usize"),
    })
}

impl FileEntry {
    fn check(self, i: usize) -> std::result::Result<Crossovers, TuningProblem> {
        let at = format!("crossovers[{i}]");
        let (dtype, world) = dtype_and_world(self.dtype, self.world, &at)?;
        let max = self.max_bytes.ok_or_else(|| missing(format!("{at}.max_bytes")))?;
        if let Some(name) = max.keys().find(|k| !ALGORITHMS.contains(&k.as_str())) {
            return Err(TuningProblem::UnknownAlgorithm {
                at: format!("{at}.max_bytes.{name}"),
                name: name.clone(),
            });
        }
        let required = |name: &str| {
            let path = format!("{at}.max_bytes.{name}");
            match max.get(name).copied().flatten() {
                Some(v) => bytes_value(v, &path),
                None => Err(missing(path)),
            }
        };
        let optional = |name: &str| match max.get(name).copied().flatten() {
            Some(v) => bytes_value(v, &format!("{at}.max_bytes.{name}")).map(Some),
            None => Ok(None),
        };
        Ok(Crossovers {
            dtype,
            world,
            low_latency_max_bytes: required("low_latency")?,
            two_shot_ll_max_bytes: optional("two_shot_ll")?,
            one_shot_max_bytes: required("one_shot")?,
            two_shot_max_bytes: optional("two_shot")?,
        })
    }
}

impl Crossovers {
    fn check(&self) -> std::result::Result<(), TuningProblem> {
        let bad = |detail: String| TuningProblem::NonMonotone {
            dtype: self.dtype,
            world: self.world,
            detail,
        };
        if !(1..=MAX_RANKS).contains(&self.world) {
            return Err(TuningProblem::BadWorld {
                at: format!("{} entry", self.dtype),
                world: self.world as u64,
            });
        }
        if self.low_latency_max_bytes > self.one_shot_max_bytes {
            return Err(bad(format!(
                "low_latency {} > one_shot {}",
                self.low_latency_max_bytes, self.one_shot_max_bytes
            )));
        }
        if let Some(band) = self.two_shot_ll_max_bytes {
            if !(self.low_latency_max_bytes..=self.one_shot_max_bytes).contains(&band) {
                return Err(bad(format!(
                    "two_shot_ll {band} is not between low_latency {} and one_shot {}",
                    self.low_latency_max_bytes, self.one_shot_max_bytes
                )));
            }
        }
        if let Some(two) = self.two_shot_max_bytes {
            if self.one_shot_max_bytes > two {
                return Err(bad(format!(
                    "one_shot {} > two_shot {two}",
                    self.one_shot_max_bytes
                )));
            }
        }
        Ok(())
    }

    fn to_file(self) -> FileEntry {
        let mut max = BTreeMap::new();
        max.insert("low_latency".to_string(), Some(self.low_latency_max_bytes as u64));
        max.insert("one_shot".to_string(), Some(self.one_shot_max_bytes as u64));
        if let Some(band) = self.two_shot_ll_max_bytes {
            max.insert("two_shot_ll".to_string(), Some(band as u64));
        }
        if let Some(two) = self.two_shot_max_bytes {
            max.insert("two_shot".to_string(), Some(two as u64));
        }
        FileEntry {
            dtype: Some(self.dtype.name().to_string()),
            world: Some(self.world as u64),
            max_bytes: Some(max),
        }
    }
}

impl FileFused {
    fn check(self, i: usize) -> std::result::Result<FusedCrossovers, TuningProblem> {
        let at = format!("fused[{i}]");
        let (dtype, world) = dtype_and_world(self.dtype, self.world, &at)?;
        let hidden = self.hidden.ok_or_else(|| missing(format!("{at}.hidden")))?;
        let max = self
            .max_tokens
            .ok_or_else(|| missing(format!("{at}.max_tokens")))?;
        if let Some(name) = max.keys().find(|k| !FUSED_ALGORITHMS.contains(&k.as_str())) {
            return Err(TuningProblem::UnknownFusedAlgorithm {
                at: format!("{at}.max_tokens.{name}"),
                name: name.clone(),
            });
        }
        let path = format!("{at}.max_tokens.one_shot");
        let one_shot = match max.get("one_shot").copied().flatten() {
            Some(v) => bytes_value(v, &path)?,
            None => return Err(missing(path)),
        };
        let entry = FusedCrossovers {
            dtype,
            world,
            hidden: usize::try_from(hidden).map_err(|_| TuningProblem::BadHidden {
                at: format!("{at}.hidden"),
                dtype,
                hidden,
            })?,
            one_shot_max_tokens: one_shot,
        };
        entry.check(&format!("{at}.hidden"))?;
        Ok(entry)
    }
}

impl FusedCrossovers {
    /// `at` names the hidden size in a refusal.
    fn check(&self, at: &str) -> std::result::Result<(), TuningProblem> {
        if !(1..=MAX_RANKS).contains(&self.world) {
            return Err(TuningProblem::BadWorld {
                at: format!("{} fused entry", self.dtype),
                world: self.world as u64,
            });
        }
        let per_pack = self.dtype.per_pack();
        if self.hidden == 0 || self.hidden > MAX_HIDDEN || self.hidden % per_pack != 0 {
            return Err(TuningProblem::BadHidden {
                at: at.to_string(),
                dtype: self.dtype,
                hidden: self.hidden as u64,
            });
        }
        Ok(())
    }

    fn to_file(self) -> FileFused {
        let mut max = BTreeMap::new();
        max.insert("one_shot".to_string(), Some(self.one_shot_max_tokens as u64));
        FileFused {
            dtype: Some(self.dtype.name().to_string()),
            world: Some(self.world as u64),
            hidden: Some(self.hidden as u64),
            max_tokens: Some(max),
        }
    }

    /// How far `hidden` is from this entry's hidden size, as a ratio `(larger, smaller)`.
    fn distance(&self, hidden: usize) -> (usize, usize) {
        (self.hidden.max(hidden), self.hidden.min(hidden).max(1))
    }
}

fn in_memory(problem: TuningProblem) -> Error {
    Error::InvalidTuning {
        table: "(built in memory)".into(),
        problem,
    }
}

impl TuningTable {
    /// A table from measurements: checks every entry (world in 1..=8, thresholds that do not
    /// decrease, one entry per (dtype, world)); the entries are kept sorted by (dtype, world).
    /// No fused entries (add them with [`TuningTable::with_fused`]).
    pub fn new(measured: Measured, entries: Vec<Crossovers>) -> Result<TuningTable> {
        Self::build(measured, entries, Vec::new(), None).map_err(in_memory)
    }

    /// This table with `fused` as its fused section (replacing any): checks every entry (world
    /// in 1..=8, a hidden size the fused call takes, one entry per (dtype, world, hidden)).
    pub fn with_fused(self, fused: Vec<FusedCrossovers>) -> Result<TuningTable> {
        Self::build(self.measured, self.entries, fused, self.origin).map_err(in_memory)
    }

    fn build(
        measured: Measured,
        mut entries: Vec<Crossovers>,
        mut fused: Vec<FusedCrossovers>,
        origin: Option<PathBuf>,
    ) -> std::result::Result<TuningTable, TuningProblem> {
        let mut dense = [[None; MAX_RANKS]; DType::COUNT];
        for e in &entries {
            e.check()?;
            let slot = &mut dense[e.dtype.index()][e.world - 1];
            if slot.is_some() {
                return Err(TuningProblem::Duplicate {
                    dtype: e.dtype,
                    world: e.world,
                });
            }
            *slot = Some(*e);
        }
        entries.sort_by_key(|e| (e.dtype.index(), e.world));
        for f in &fused {
            f.check("fused entry")?;
        }
        fused.sort_by_key(|f| (f.dtype.index(), f.world, f.hidden));
        if let Some(w) = fused
            .windows(2)
            .find(|w| (w[0].dtype, w[0].world, w[0].hidden) == (w[1].dtype, w[1].world, w[1].hidden))
        {
            return Err(TuningProblem::DuplicateFused {
                dtype: w[0].dtype,
                world: w[0].world,
                hidden: w[0].hidden,
            });
        }
        let mut fused_ranges = [[(0, 0); MAX_RANKS]; DType::COUNT];
        let mut start = 0;
        for group in fused.chunk_by(|a, b| (a.dtype, a.world) == (b.dtype, b.world)) {
            fused_ranges[group[0].dtype.index()][group[0].world - 1] = (start, start + group.len());
            start += group.len();
        }
        let max_low_latency = entries.iter().map(|e| e.low_latency_max_bytes).max().unwrap_or(0);
        let mut table = TuningTable {
            measured,
            entries,
            dense,
            fused,
            fused_ranges,
            origin,
            digest: 0,
            max_low_latency,
        };
        // 0 stands for "no table" in the setup fingerprint.
        table.digest = fnv1a(table.to_json().bytes()).max(1);
        Ok(table)
    }

    /// Parses and checks a table (see the module documentation for the format).
    pub fn from_json(text: &str) -> Result<TuningTable> {
        Self::parse(text, None).map_err(|p| Error::InvalidTuning {
            table: "(given as text)".into(),
            problem: p,
        })
    }

    /// Reads, parses and checks a table file; [`TuningTable::origin`] remembers the path.
    pub fn load(path: impl AsRef<Path>) -> Result<TuningTable> {
        let path = path.as_ref();
        let wrap = |p| Error::InvalidTuning {
            table: path.display().to_string(),
            problem: p,
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            wrap(TuningProblem::Io {
                detail: e.to_string(),
            })
        })?;
        Self::parse(&text, Some(path.to_path_buf())).map_err(wrap)
    }

    fn parse(text: &str, origin: Option<PathBuf>) -> std::result::Result<TuningTable, TuningProblem> {
        let malformed = |e: serde_json::Error| TuningProblem::Malformed {
            detail: e.to_string(),
        };
        // The format and version first, so that another version's layout is reported as
        // such rather than as unknown fields.
        let value: serde_json::Value = serde_json::from_str(text).map_err(malformed)?;
        if value.get("format").and_then(|f| f.as_str()) != Some(TUNING_FORMAT) {
            return Err(TuningProblem::NotATable);
        }
        let version = match value.get("version") {
            None | Some(serde_json::Value::Null) => return Err(missing("version".into())),
            Some(v) => match v.as_u64() {
                Some(found @ TUNING_OLDEST_VERSION..=TUNING_VERSION) => found,
                Some(found) => {
                    return Err(TuningProblem::WrongVersion {
                        found,
                        supported: TUNING_VERSION,
                    })
                }
                None => {
                    return Err(TuningProblem::Malformed {
                        detail: format!("`version` is {v}, not a whole number"),
                    })
                }
            },
        };
        let file: File = serde_json::from_value(value).map_err(malformed)?;
        let m = file.measured.ok_or_else(|| missing("measured".into()))?;
        let field = |v: Option<String>, name: &str| v.ok_or_else(|| missing(format!("measured.{name}")));
        let measured = Measured {
            device: field(m.device, "device")?,
            driver: field(m.driver, "driver")?,
            date: field(m.date, "date")?,
            crate_version: field(m.crate_version, "crate_version")?,
            placement: field(m.placement, "placement")?,
            note: m.note,
        };
        let entries = file
            .crossovers
            .ok_or_else(|| missing("crossovers".into()))?
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.check(i))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let fused = match (version, file.fused) {
            (1, None) => Vec::new(),
            (1, Some(_)) => {
                return Err(TuningProblem::Malformed {
                    detail: "version 1 has no `fused` section: set \"version\": 2".into(),
                })
            }
            (_, None) => return Err(missing("fused".into())),
            (_, Some(fused)) => fused
                .into_iter()
                .enumerate()
                .map(|(i, f)| f.check(i))
                .collect::<std::result::Result<Vec<_>, _>>()?,
        };
        Self::build(measured, entries, fused, origin)
    }

    /// The table as JSON (what [`TuningTable::from_json`] reads back; entries sorted).
    pub fn to_json(&self) -> String {
        let m = &self.measured;
        let file = File {
            format: Some(TUNING_FORMAT.to_string()),
            version: Some(TUNING_VERSION),
            measured: Some(FileMeasured {
                device: Some(m.device.clone()),
                driver: Some(m.driver.clone()),
                date: Some(m.date.clone()),
                crate_version: Some(m.crate_version.clone()),
                placement: Some(m.placement.clone()),
                note: m.note.clone(),
            }),
            crossovers: Some(self.entries.iter().map(|e| e.to_file()).collect()),
            fused: Some(self.fused.iter().map(|f| f.to_file()).collect()),
        };
        // Serialising plain strings, integers and maps with string keys cannot fail.
        serde_json::to_string_pretty(&file).unwrap_or_default() + "\n"
    }

    /// The crossovers of one (dtype, world), if the table has them (an index, no search).
    pub fn get(&self, dtype: DType, world: usize) -> Option<Crossovers> {
        world
            .checked_sub(1)
            .and_then(|w| self.dense[dtype.index()].get(w).copied().flatten())
    }

    /// Every entry, sorted by (dtype, world).
    pub fn entries(&self) -> &[Crossovers] {
        &self.entries
    }

    /// Every fused entry, sorted by (dtype, world, hidden).
    pub fn fused_entries(&self) -> &[FusedCrossovers] {
        &self.fused
    }

    /// The fused entries of one (dtype, world), sorted by hidden size (an index, no search).
    pub fn fused_for(&self, dtype: DType, world: usize) -> &[FusedCrossovers] {
        let (start, end) = world
            .checked_sub(1)
            .and_then(|w| self.fused_ranges[dtype.index()].get(w).copied())
            .unwrap_or((0, 0));
        &self.fused[start..end]
    }

    /// The fused entry `Auto` follows for a call of rows of `hidden` elements: the one of the
    /// nearest measured hidden size (by ratio; a tie goes to the larger), if the table has any
    /// for (dtype, world). Allocation-free.
    pub fn fused(&self, dtype: DType, world: usize, hidden: usize) -> Option<FusedCrossovers> {
        // (a, b) is nearer than (c, d) when a/b < c/d; sorted ascending, `<=` lets the
        // larger of two equally near sizes win.
        self.fused_for(dtype, world).iter().copied().reduce(|best, f| {
            let (a, b) = f.distance(hidden);
            let (c, d) = best.distance(hidden);
            if a as u128 * d as u128 <= c as u128 * b as u128 {
                f
            } else {
                best
            }
        })
    }

    /// Where and when it was measured.
    pub fn measured(&self) -> &Measured {
        &self.measured
    }

    /// The file it was loaded from (`None`: built in memory or parsed from text).
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }

    /// A digest of the table's content (its canonical JSON; not the file's path or
    /// whitespace). Setup compares it across ranks.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The largest low-latency threshold of any entry (the slots must hold it).
    pub fn max_low_latency_bytes(&self) -> usize {
        self.max_low_latency
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn measured() -> Measured {
        Measured {
            device: "Test GPU".into(),
            driver: "1.2.3".into(),
            date: "2026-12-03T08:00:00Z".into(),
            crate_version: VERSION.into(),
            placement: "virtual".into(),
            note: String::new(),
        }
    }

    const GOOD: &str = r#"{
      "format": "symm-allreduce tuning table",
      "version": 2,
      "measured": {"device": "NVIDIA H200", "driver": "580.95.05", "date": "2026-12-03T08:00:00Z",
                   "crate_version": "0.1.0", "placement": "virtual"},
      "crossovers": [
        {"dtype": "bf16", "world": 8, "max_bytes": {"low_latency": 65536, "one_shot": 1048576}},
        {"dtype": "f32", "world": 2, "max_bytes": {"low_latency": 0, "one_shot": 4096, "two_shot": 8388608}}
      ],
      "fused": [
        {"dtype": "bf16", "world": 8, "hidden": 8192, "max_tokens": {"one_shot": 16}},
        {"dtype": "bf16", "world": 8, "hidden": 4096, "max_tokens": {"one_shot": 48}},
        {"dtype": "f32", "world": 2, "hidden": 7168, "max_tokens": {"one_shot": 0}}
      ]
    }"#;

    /// [`GOOD`] in format version 1: no fused section.
    fn good_v1() -> String {
        let mut v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
        v["version"] = 1.into();
        v.as_object_mut().unwrap().remove("fused");
        v.to_string()
    }

    fn problem(text: &str) -> TuningProblem {
        match TuningTable::from_json(text) {
            Err(Error::InvalidTuning { problem, .. }) => problem,
            other => panic!("expected InvalidTuning, got {other:?}"),
        }
    }

    #[test]
    fn a_good_table_parses_and_indexes() {
        let t = TuningTable::from_json(GOOD).unwrap();
        assert_eq!(t.entries().len(), 2);
        let e = t.get(DType::BF16, 8).unwrap();
        assert_eq!(
            (
                e.low_latency_max_bytes,
                e.one_shot_max_bytes,
                e.two_shot_max_bytes
            ),
            (65536, 1 << 20, None)
        );
        let f = t.get(DType::F32, 2).unwrap();
        assert_eq!(f.two_shot_max_bytes, Some(8 << 20));
        assert_eq!(t.get(DType::F16, 8), None);
        assert_eq!(t.get(DType::BF16, 4), None);
        assert_eq!(t.get(DType::BF16, 0), None);
        assert_eq!(t.get(DType::BF16, 99), None);
        assert_eq!(t.measured().device, "NVIDIA H200");
        assert_eq!(t.max_low_latency_bytes(), 65536);
        assert_eq!(t.origin(), None);
        // The fused section, sorted by (dtype, world, hidden) (f32 comes first in DType::ALL).
        let hidden: Vec<usize> = t.fused_entries().iter().map(|f| f.hidden).collect();
        assert_eq!(hidden, [7168, 4096, 8192]);
        assert_eq!(t.fused_for(DType::BF16, 8).len(), 2);
        assert_eq!(t.fused_for(DType::F32, 2)[0].one_shot_max_tokens, 0);
        assert!(t.fused_for(DType::F16, 8).is_empty());
        assert!(t.fused_for(DType::BF16, 0).is_empty());
        assert!(t.fused_for(DType::BF16, 99).is_empty());
    }

    #[test]
    fn the_fused_entry_of_the_nearest_measured_hidden_size_applies() {
        let t = TuningTable::from_json(GOOD).unwrap();
        let tokens = |hidden| {
            t.fused(DType::BF16, 8, hidden)
                .map(|f| (f.hidden, f.one_shot_max_tokens))
        };
        assert_eq!(tokens(8192), Some((8192, 16)));
        assert_eq!(tokens(4096), Some((4096, 48)));
        // 5120: 5120/4096 = 1.25 < 8192/5120 = 1.6; 6144: 1.5 > 1.33.
        assert_eq!(tokens(5120), Some((4096, 48)));
        assert_eq!(tokens(6144), Some((8192, 16)));
        // Beyond the measured sizes: the nearest end.
        assert_eq!(tokens(16384), Some((8192, 16)));
        assert_eq!(tokens(1024), Some((4096, 48)));
        // Equally near (16 is twice 8 and half 32): the larger wins.
        let tie = TuningTable::new(measured(), vec![])
            .unwrap()
            .with_fused(
                [8usize, 32]
                    .map(|hidden| FusedCrossovers {
                        dtype: DType::BF16,
                        world: 2,
                        hidden,
                        one_shot_max_tokens: hidden,
                    })
                    .to_vec(),
            )
            .unwrap();
        assert_eq!(tie.fused(DType::BF16, 2, 16).unwrap().hidden, 32);
        assert_eq!(tie.fused(DType::BF16, 2, 15).unwrap().hidden, 8);
        // Nothing measured for (dtype, world): none; absurd hidden sizes do not overflow.
        assert_eq!(t.fused(DType::F16, 8, 8192), None);
        assert_eq!(t.fused(DType::BF16, 8, usize::MAX).unwrap().hidden, 8192);
        assert_eq!(t.fused(DType::BF16, 8, 0).unwrap().hidden, 4096);
    }

    #[test]
    fn version_1_tables_load_without_fused_entries() {
        let t = TuningTable::from_json(&good_v1()).unwrap();
        assert!(t.fused_entries().is_empty());
        assert_eq!(t.entries(), TuningTable::from_json(GOOD).unwrap().entries());
        // Written back in the current version, with an empty fused section.
        let back: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        assert_eq!(back["version"], TUNING_VERSION);
        assert_eq!(back["fused"], serde_json::json!([]));
        assert_eq!(TuningTable::from_json(&t.to_json()).unwrap(), t);
        // Version 1 with a fused section, version 2 without one: refused.
        let mut v1_fused: serde_json::Value = serde_json::from_str(GOOD).unwrap();
        v1_fused["version"] = 1.into();
        assert!(matches!(
            problem(&v1_fused.to_string()),
            TuningProblem::Malformed { detail } if detail.contains("\"version\": 2")
        ));
        let mut v2_bare: serde_json::Value = serde_json::from_str(&good_v1()).unwrap();
        v2_bare["version"] = 2.into();
        assert_eq!(
            problem(&v2_bare.to_string()),
            TuningProblem::MissingField {
                field: "fused".into()
            }
        );
    }

    #[test]
    fn bad_fused_entries_are_refused_with_typed_errors() {
        for name in ["low_latency", "two_shot", "nccl", "auto", "oneshot"] {
            let text = GOOD.replace("\"one_shot\": 48", &format!("\"one_shot\": 48, \"{name}\": 5"));
            assert_eq!(
                problem(&text),
                TuningProblem::UnknownFusedAlgorithm {
                    at: format!("fused[1].max_tokens.{name}"),
                    name: name.into()
                }
            );
        }
        let e = TuningTable::from_json(&GOOD.replace("{\"one_shot\": 16}", "{\"two_shot\": 16}"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"two_shot\"") && e.contains("max_tokens takes one_shot"),
            "{e}"
        );
        // Hidden sizes the fused call does not take: 0, above 16384, not a whole number of
        // 16-byte packs (bf16: 8 elements); f32 packs hold 4, so 7164 is one there.
        for (from, to) in [
            ("8192", "0"),
            ("8192", "16392"),
            ("8192", "8196"),
            ("7168", "7166"),
        ] {
            let text = GOOD.replace(&format!("\"hidden\": {from}"), &format!("\"hidden\": {to}"));
            assert!(
                matches!(problem(&text), TuningProblem::BadHidden { hidden, .. } if hidden.to_string() == to),
                "{to}"
            );
        }
        TuningTable::from_json(&GOOD.replace("\"hidden\": 7168", "\"hidden\": 7164")).unwrap();
        let e = TuningTable::from_json(&GOOD.replace("\"hidden\": 8192", "\"hidden\": 8196")).unwrap_err();
        assert!(e.to_string().contains("multiples of 8 up to 16384"), "{e}");
        // Ranges that are not token counts, fields that are missing, and duplicates.
        for bad in ["-1", "1.5", "\"16\"", "[1, 16]"] {
            assert!(
                matches!(
                    problem(&GOOD.replace("\"one_shot\": 16}", &format!("\"one_shot\": {bad}}}"))),
                    TuningProblem::Malformed { .. }
                ),
                "{bad}"
            );
        }
        let cases = [
            ("\"one_shot\": 16", "fused[0].max_tokens.one_shot"),
            ("\"hidden\": 4096, ", "fused[1].hidden"),
            ("\"max_tokens\": {\"one_shot\": 0}", "fused[2].max_tokens"),
        ];
        for (cut, field) in cases {
            assert!(GOOD.contains(cut), "{cut}");
            let text = GOOD.replacen(cut, "", 1).replace(", }", "}");
            assert_eq!(
                problem(&text),
                TuningProblem::MissingField { field: field.into() },
                "{cut}"
            );
        }
        assert!(matches!(
            problem(&GOOD.replace("\"hidden\": 4096", "\"hidden\": 8192")),
            TuningProblem::DuplicateFused {
                dtype: DType::BF16,
                world: 8,
                hidden: 8192
            }
        ));
        assert!(matches!(
            problem(&GOOD.replace("\"world\": 2, \"hidden\"", "\"world\": 9, \"hidden\"")),
            TuningProblem::BadWorld { at, world: 9 } if at == "fused[2].world"
        ));
        // The in-memory constructor checks the same.
        let ok = FusedCrossovers {
            dtype: DType::F16,
            world: 4,
            hidden: 4096,
            one_shot_max_tokens: 8,
        };
        let base = TuningTable::new(measured(), vec![]).unwrap();
        for (bad, what) in [
            (vec![ok, ok], "duplicate"),
            (vec![FusedCrossovers { hidden: 100, ..ok }], "hidden"),
            (vec![FusedCrossovers { world: 0, ..ok }], "world"),
        ] {
            assert!(
                matches!(base.clone().with_fused(bad), Err(Error::InvalidTuning { .. })),
                "{what}"
            );
        }
        let t = base.with_fused(vec![ok]).unwrap();
        assert_eq!(t.fused(DType::F16, 4, 1), Some(ok));
        assert_eq!(TuningTable::from_json(&t.to_json()).unwrap(), t);
    }

    #[test]
    fn json_round_trips_and_the_digest_ignores_layout_and_order() {
        let t = TuningTable::from_json(GOOD).unwrap();
        let back = TuningTable::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.digest(), t.digest());
        // Entries in the other order, other whitespace: the same table.
        let v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
        let mut swapped = v.clone();
        swapped["crossovers"].as_array_mut().unwrap().reverse();
        let again = TuningTable::from_json(&serde_json::to_string(&swapped).unwrap()).unwrap();
        assert_eq!(again.digest(), t.digest());
        // Any change of a threshold or of the provenance changes the digest.
        let mut moved = v.clone();
        moved["crossovers"][0]["max_bytes"]["one_shot"] = 1048577.into();
        assert_ne!(
            TuningTable::from_json(&moved.to_string()).unwrap().digest(),
            t.digest()
        );
        let mut fused = v.clone();
        fused["fused"][0]["max_tokens"]["one_shot"] = 17.into();
        assert_ne!(
            TuningTable::from_json(&fused.to_string()).unwrap().digest(),
            t.digest()
        );
        let mut elsewhere = v;
        elsewhere["measured"]["device"] = "NVIDIA B200".into();
        assert_ne!(
            TuningTable::from_json(&elsewhere.to_string()).unwrap().digest(),
            t.digest()
        );
        // Built in memory: the same writer, the same reader.
        let built = TuningTable::new(measured(), t.entries().to_vec())
            .unwrap()
            .with_fused(t.fused_entries().to_vec())
            .unwrap();
        assert_eq!(TuningTable::from_json(&built.to_json()).unwrap(), built);
    }

    #[test]
    fn loading_remembers_the_path_and_reports_io_errors() {
        let dir = std::env::temp_dir().join(format!("symm-tuning-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        std::fs::write(&path, GOOD).unwrap();
        let t = TuningTable::load(&path).unwrap();
        assert_eq!(t.origin(), Some(path.as_path()));
        assert_eq!(t.digest(), TuningTable::from_json(GOOD).unwrap().digest());
        let e = TuningTable::load(dir.join("absent.json")).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidTuning { problem: TuningProblem::Io { .. }, table } if table.ends_with("absent.json")),
            "{e}"
        );
        assert!(e.to_string().contains(TUNING_ENV), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_wrong_version_is_refused_before_its_fields_are_read() {
        for found in [0, 4] {
            let other = GOOD
                .replace("\"version\": 2", &format!("\"version\": {found}"))
                .replace("\"crossovers\"", "\"other\"");
            assert_eq!(
                problem(&other),
                TuningProblem::WrongVersion { found, supported: 3 }
            );
            let e = TuningTable::from_json(&other).unwrap_err().to_string();
            assert!(e.contains("symm-bench --tune"), "{e}");
            assert!(e.contains("reads versions 1 to 3"), "{e}");
        }
        assert_eq!(
            problem(&GOOD.replace("\"version\": 2,", "")),
            TuningProblem::MissingField {
                field: "version".into()
            }
        );
        assert!(matches!(
            problem(&GOOD.replace("\"version\": 2", "\"version\": \"2\"")),
            TuningProblem::Malformed { .. }
        ));
        assert_eq!(
            problem(&GOOD.replace("tuning table", "something else")),
            TuningProblem::NotATable
        );
        assert_eq!(problem("[1, 2]"), TuningProblem::NotATable);
        assert!(matches!(problem("{ not json"), TuningProblem::Malformed { .. }));
    }

    #[test]
    fn unknown_algorithms_dtypes_and_worlds_are_named() {
        for name in ["nccl", "auto", "ring", "ll"] {
            let text = GOOD.replace(
                "\"one_shot\": 4096",
                &format!("\"one_shot\": 4096, \"{name}\": 5"),
            );
            assert_eq!(
                problem(&text),
                TuningProblem::UnknownAlgorithm {
                    at: format!("crossovers[1].max_bytes.{name}"),
                    name: name.into()
                }
            );
        }
        let e = TuningTable::from_json(&GOOD.replace("\"two_shot\"", "\"three_shot\"")).unwrap_err();
        assert!(e.to_string().contains("\"three_shot\""), "{e}");
        assert!(
            e.to_string()
                .contains("low_latency, two_shot_ll, one_shot and two_shot"),
            "{e}"
        );
        assert!(matches!(
            problem(&GOOD.replace("\"bf16\"", "\"f64\"")),
            TuningProblem::UnknownDType { name, .. } if name == "f64"
        ));
        for w in ["0", "9"] {
            assert!(matches!(
                problem(&GOOD.replace("\"world\": 8", &format!("\"world\": {w}"))),
                TuningProblem::BadWorld { .. }
            ));
        }
    }

    #[test]
    fn decreasing_thresholds_are_refused() {
        let ll_above = GOOD.replace("\"low_latency\": 65536", "\"low_latency\": 2097152");
        assert!(matches!(
            problem(&ll_above),
            TuningProblem::NonMonotone { dtype: DType::BF16, world: 8, detail } if detail.contains("low_latency 2097152 > one_shot 1048576")
        ));
        let two_below = GOOD.replace("\"two_shot\": 8388608", "\"two_shot\": 1024");
        assert!(matches!(
            problem(&two_below),
            TuningProblem::NonMonotone {
                dtype: DType::F32,
                world: 2,
                ..
            }
        ));
        // Equal thresholds are allowed: the algorithm between gets no sizes.
        TuningTable::from_json(&GOOD.replace("\"two_shot\": 8388608", "\"two_shot\": 4096")).unwrap();
        // The two-shot band over the low-latency lines lies between low_latency and one_shot.
        let band = |v: usize| {
            GOOD.replace(
                "\"low_latency\": 65536, \"one_shot\": 1048576",
                &format!("\"low_latency\": 65536, \"two_shot_ll\": {v}, \"one_shot\": 1048576"),
            )
        };
        for v in [65536, 524288, 1048576] {
            let t = TuningTable::from_json(&band(v)).unwrap();
            assert_eq!(t.get(DType::BF16, 8).unwrap().two_shot_ll_max_bytes, Some(v));
            // Written back with it.
            assert_eq!(TuningTable::from_json(&t.to_json()).unwrap(), t);
        }
        assert_eq!(
            TuningTable::from_json(GOOD)
                .unwrap()
                .get(DType::BF16, 8)
                .unwrap()
                .two_shot_ll_max_bytes,
            None
        );
        for v in [65535, 1048577] {
            let p = problem(&band(v));
            assert!(
                matches!(&p, TuningProblem::NonMonotone { dtype: DType::BF16, world: 8, detail }
                    if detail.contains("two_shot_ll")),
                "{p:?}"
            );
        }
        // The in-memory constructor checks the same.
        let bad = Crossovers {
            dtype: DType::F16,
            world: 4,
            low_latency_max_bytes: 10,
            two_shot_ll_max_bytes: None,
            one_shot_max_bytes: 5,
            two_shot_max_bytes: None,
        };
        assert!(matches!(
            TuningTable::new(measured(), vec![bad]),
            Err(Error::InvalidTuning {
                problem: TuningProblem::NonMonotone { .. },
                ..
            })
        ));
        let ok = Crossovers {
            one_shot_max_bytes: 10,
            ..bad
        };
        assert!(matches!(
            TuningTable::new(measured(), vec![ok, ok]),
            Err(Error::InvalidTuning {
                problem: TuningProblem::Duplicate {
                    dtype: DType::F16,
                    world: 4
                },
                ..
            })
        ));
        assert!(matches!(
            TuningTable::new(measured(), vec![Crossovers { world: 0, ..ok }]),
            Err(Error::InvalidTuning {
                problem: TuningProblem::BadWorld { .. },
                ..
            })
        ));
    }

    #[test]
    fn missing_fields_are_named_by_path() {
        let cases = [
            ("\"low_latency\": 65536, ", "crossovers[0].max_bytes.low_latency"),
            (", \"one_shot\": 4096", "crossovers[1].max_bytes.one_shot"),
            ("\"dtype\": \"bf16\", ", "crossovers[0].dtype"),
            ("\"world\": 2, ", "crossovers[1].world"),
            ("\"driver\": \"580.95.05\", ", "measured.driver"),
        ];
        for (cut, field) in cases {
            assert!(GOOD.contains(cut), "{cut}");
            assert_eq!(
                problem(&GOOD.replacen(cut, "", 1)),
                TuningProblem::MissingField { field: field.into() },
                "{cut}"
            );
        }
        // A null one_shot is as missing as an absent one; a null two_shot means "no NCCL".
        assert_eq!(
            problem(&GOOD.replace("\"one_shot\": 4096", "\"one_shot\": null")),
            TuningProblem::MissingField {
                field: "crossovers[1].max_bytes.one_shot".into()
            }
        );
        let t = TuningTable::from_json(&GOOD.replace("\"two_shot\": 8388608", "\"two_shot\": null")).unwrap();
        assert_eq!(t.get(DType::F32, 2).unwrap().two_shot_max_bytes, None);
        let v: serde_json::Value = serde_json::from_str(GOOD).unwrap();
        for top in ["measured", "crossovers", "fused"] {
            let mut cut = v.clone();
            cut.as_object_mut().unwrap().remove(top);
            assert_eq!(
                problem(&cut.to_string()),
                TuningProblem::MissingField { field: top.into() }
            );
        }
        // A field the format does not have is refused, not ignored.
        assert!(matches!(
            problem(&GOOD.replace("\"world\": 8,", "\"world\": 8, \"wrold\": 8,")),
            TuningProblem::Malformed { detail } if detail.contains("wrold")
        ));
        assert!(matches!(
            problem(&GOOD.replace("\"one_shot\": 4096", "\"one_shot\": -1")),
            TuningProblem::Malformed { .. }
        ));
    }

    #[test]
    fn the_fused_problems_display_in_human_form() {
        for problem in [
            TuningProblem::UnknownFusedAlgorithm {
                at: "fused[0].max_tokens.two_shot".into(),
                name: "two_shot".into(),
            },
            TuningProblem::BadHidden {
                at: "fused[1].hidden".into(),
                dtype: DType::F32,
                hidden: 7166,
            },
            TuningProblem::DuplicateFused {
                dtype: DType::BF16,
                world: 8,
                hidden: 8192,
            },
            TuningProblem::WrongVersion {
                found: 3,
                supported: TUNING_VERSION,
            },
        ] {
            let text = Error::InvalidTuning {
                table: "t.json".into(),
                problem,
            }
            .to_string();
            assert!(!text.contains('{') && !text.contains('}'), "{text}");
            assert!(!text.contains("   "), "{text}");
        }
    }
}
