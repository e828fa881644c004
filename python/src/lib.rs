//! `symm_allreduce._native`: the Rust half of the `symm_allreduce` Python package.
//!
//! The pure-Python layer (`pysrc/symm_allreduce`) turns tensors into plain descriptors
//! (address, element count, dtype name, device, contiguity) and the current CUDA stream into
//! an integer; this module validates every one of them (the device of the memory is asked of
//! the driver, not trusted; so is the stream's, the first time a communicator sees its handle)
//! and calls the crate's public API. The all-reduce of plain torch tensors has a hot path
//! (`Communicator.all_reduce_ptr`): the Python layer checks them through torch's own accessors
//! and passes integers (address, length, dtype and algorithm codes); nothing is allocated or
//! asked of the driver per call beyond the crate's own call. No libtorch is linked. Every
//! crate [`Error`] becomes an exception of `symm_allreduce.errors`, with the crate's own
//! message (`errors::raise`).

mod dlpack;
mod errors;
mod tensor;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use symm_allreduce::cudarc::driver::{CudaContext, CudaStream};
use symm_allreduce::{Algorithm, Bootstrap, Communicator, Config, DType, Error, Multicast};

use errors::{invalid_call, raise};
use tensor::{Kind, Raw, TensorArg};

/// Runs `$body` with `$T` bound to the Rust element type of `$kind`: `sum` takes the three
/// dtypes the reductions add (the byte types are refused with [`Kind::not_summable`]), `gather`
/// also the two byte types the gathers move. The float arms are written once, here.
macro_rules! with_type {
    (@arms $kind:expr, $T:ident => $body:expr; $($bytes:tt)*) => {
        match $kind {
            Kind::F32 => {
                type $T = f32;
                $body
            }
            Kind::F16 => {
                type $T = half::f16;
                $body
            }
            Kind::BF16 => {
                type $T = half::bf16;
                $body
            }
            $($bytes)*
        }
    };
    (sum $kind:expr, $T:ident => $body:expr) => {
        with_type!(@arms $kind, $T => $body; other @ (Kind::U8 | Kind::I8) => Err(other.not_summable()),)
    };
    (gather $kind:expr, $T:ident => $body:expr) => {
        with_type!(@arms $kind, $T => $body;
            Kind::U8 => {
                type $T = u8;
                $body
            }
            Kind::I8 => {
                type $T = i8;
                $body
            }
        )
    };
}

/// The names of every `Config` field, as keyword arguments.
const CONFIG_KEYS: [&str; 19] = [
    "capacity_bytes",
    "algorithm",
    "one_shot_max_bytes",
    "max_blocks_per_rank",
    "shared_sm_percent",
    "low_latency_max_bytes",
    "timeout",
    "nccl_above_bytes",
    "peer_kernels",
    "pdl",
    "pdl_at_exit",
    "early_trigger",
    "remote_sync_domain",
    "check_divergence",
    "tuning",
    "multicast",
    "reproducible",
    "pool_bytes",
    "nccl_windows",
];

/// Fails to compile when `Config` gains a field: add it to [`CONFIG_KEYS`], [`parse_config`]
/// and [`config_dict`], then here.
const _: fn(Config) = |c| {
    let Config {
        capacity_bytes: _,
        algorithm: _,
        one_shot_max_bytes: _,
        max_blocks_per_rank: _,
        shared_sm_percent: _,
        low_latency_max_bytes: _,
        timeout: _,
        nccl_above_bytes: _,
        peer_kernels: _,
        pdl: _,
        pdl_at_exit: _,
        early_trigger: _,
        remote_sync_domain: _,
        check_divergence: _,
        tuning: _,
        multicast: _,
        reproducible: _,
        pool_bytes: _,
        nccl_windows: _,
    } = c;
};

fn parse_algorithm(name: &str) -> PyResult<Algorithm> {
    name.parse::<Algorithm>().map_err(invalid_call)
}

/// The algorithm of a hot-path code: an index into [`Algorithm::ALL`] (`all_reduce_ptr` takes
/// the index, `algorithm_code` maps a name to it; the Python layer maps each name once).
fn algorithm_of_code(code: u8) -> PyResult<Algorithm> {
    Algorithm::ALL.get(usize::from(code)).copied().ok_or_else(|| {
        invalid_call(format!(
            "unknown algorithm code {code}: expected 0 to {} (symm_allreduce._native.algorithm_code)",
            Algorithm::ALL.len() - 1
        ))
    })
}

/// The hot-path code of an algorithm name (aliases too), or the crate's "unknown algorithm".
#[pyfunction]
fn algorithm_code(name: &str) -> PyResult<u8> {
    let algorithm = parse_algorithm(name)?;
    // Every variant is in Algorithm::ALL (the crate's test checks it), at an index below 8.
    Ok(Algorithm::ALL
        .iter()
        .position(|a| *a == algorithm)
        .unwrap_or_default() as u8)
}

/// The hot-path code of a dtype name (as `element_size` takes it), or `InvalidCallError`.
#[pyfunction]
fn dtype_code(name: &str) -> PyResult<u8> {
    Ok(Kind::parse(name)?.code())
}

/// What `all_reduce_ptr` checks before it touches the communicator: the codes, and no null
/// address under a non-empty buffer. Returns the dtype and the algorithm.
fn decode_ptr_call(
    (input, input_len): (u64, usize),
    (output, output_len): (u64, usize),
    dtype: u8,
    algorithm: u8,
) -> PyResult<(Kind, Algorithm)> {
    let algorithm = algorithm_of_code(algorithm)?;
    let kind = Kind::from_code(dtype)?;
    for (what, ptr, len) in [("input", input, input_len), ("output", output, output_len)] {
        if ptr == 0 && len != 0 {
            return Err(invalid_call(format!(
                "{what} is a null address of {len} elements"
            )));
        }
    }
    Ok((kind, algorithm))
}

/// `all_reduce_ptr`'s checks of its arguments (no device needed): for the host tests and
/// `python -m symm_allreduce.bench --host-only`.
#[pyfunction]
fn check_ptr_call(
    input: u64,
    input_len: usize,
    output: u64,
    output_len: usize,
    dtype: u8,
    algorithm: u8,
) -> PyResult<()> {
    decode_ptr_call((input, input_len), (output, output_len), dtype, algorithm)?;
    Ok(())
}

/// One eager round of `all_reduce_ptr` calls timed from Rust, for `python -m
/// symm_allreduce.bench`'s `rust_host_us`: rank i's communicator sums `inputs[i]` into
/// `outputs[i]` (`len` elements each) on `streams[i]`, and the seconds spent in the loop come
/// back, measured as symm-bench measures its rounds (one clock read before the first call and
/// one after the last). The calls are `all_reduce_ptr`'s own ([`PyCommunicator::reduce_ptr`]);
/// only Python's call of each one is left out, so the bench can set the Python layer against
/// the crate's call in the same process.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn time_ptr_round(
    comms: Vec<PyRef<'_, PyCommunicator>>,
    inputs: Vec<u64>,
    outputs: Vec<u64>,
    len: usize,
    dtype: u8,
    streams: Vec<usize>,
    algorithm: u8,
) -> PyResult<f64> {
    if inputs.len() != comms.len() || outputs.len() != comms.len() || streams.len() != comms.len() {
        return Err(invalid_call(format!(
            "time_ptr_round: {} communicators, {} inputs, {} outputs and {} streams (one of each per rank)",
            comms.len(),
            inputs.len(),
            outputs.len(),
            streams.len()
        )));
    }
    let t = std::time::Instant::now();
    for (((c, &i), &o), &s) in comms.iter().zip(&inputs).zip(&outputs).zip(&streams) {
        c.reduce_ptr((i, len), (o, len), dtype, s, algorithm)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

fn parse_multicast(name: &str) -> PyResult<Multicast> {
    match name {
        "off" => Ok(Multicast::Off),
        "auto" => Ok(Multicast::Auto),
        "required" => Ok(Multicast::Required),
        _ => Err(invalid_call(format!(
            "unknown multicast setting {name:?}: expected off, auto or required"
        ))),
    }
}

/// A `Config` from keyword arguments (`None` values keep the default; `timeout` in seconds;
/// `tuning` a file path), validated by the crate.
fn parse_config(options: Option<&Bound<'_, PyDict>>) -> PyResult<Config> {
    let mut c = Config::default();
    let Some(options) = options else {
        c.validate().map_err(raise)?;
        return Ok(c);
    };
    for (key, value) in options.iter() {
        let key: String = key.extract()?;
        if value.is_none()
            && !matches!(
                key.as_str(),
                "one_shot_max_bytes" | "low_latency_max_bytes" | "nccl_above_bytes"
            )
        {
            continue;
        }
        let bad = |e: PyErr| invalid_call(format!("config keyword {key}: {e}"));
        match key.as_str() {
            "capacity_bytes" => c.capacity_bytes = value.extract().map_err(bad)?,
            "algorithm" => c.algorithm = parse_algorithm(&value.extract::<String>().map_err(bad)?)?,
            "one_shot_max_bytes" => c.one_shot_max_bytes = value.extract().map_err(bad)?,
            "max_blocks_per_rank" => c.max_blocks_per_rank = value.extract().map_err(bad)?,
            "shared_sm_percent" => c.shared_sm_percent = value.extract().map_err(bad)?,
            "low_latency_max_bytes" => c.low_latency_max_bytes = value.extract().map_err(bad)?,
            "timeout" => {
                let seconds: f64 = value.extract().map_err(bad)?;
                c.timeout = Duration::try_from_secs_f64(seconds).map_err(|e| {
                    invalid_call(format!(
                        "config keyword timeout: {seconds} s is not a duration ({e})"
                    ))
                })?;
            }
            "nccl_above_bytes" => c.nccl_above_bytes = value.extract().map_err(bad)?,
            "peer_kernels" => c.peer_kernels = value.extract().map_err(bad)?,
            "pdl" => c.pdl = value.extract().map_err(bad)?,
            "pdl_at_exit" => c.pdl_at_exit = value.extract().map_err(bad)?,
            "early_trigger" => c.early_trigger = value.extract().map_err(bad)?,
            "remote_sync_domain" => c.remote_sync_domain = value.extract().map_err(bad)?,
            "check_divergence" => c.check_divergence = value.extract().map_err(bad)?,
            "tuning" => {
                let path: std::path::PathBuf = value.extract().map_err(bad)?;
                c = c.with_tuning_file(path).map_err(raise)?;
            }
            "multicast" => c.multicast = parse_multicast(&value.extract::<String>().map_err(bad)?)?,
            "reproducible" => c.reproducible = value.extract().map_err(bad)?,
            "pool_bytes" => c.pool_bytes = value.extract().map_err(bad)?,
            "nccl_windows" => c.nccl_windows = value.extract().map_err(bad)?,
            _ => {
                return Err(invalid_call(format!(
                    "unknown config keyword {key:?}: expected one of {}",
                    CONFIG_KEYS.join(", ")
                )))
            }
        }
    }
    c.validate().map_err(raise)?;
    Ok(c)
}

/// The fields of a `Config` as a dict (the tuning table by its origin).
fn config_dict<'py>(py: Python<'py>, c: &Config) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("capacity_bytes", c.capacity_bytes)?;
    d.set_item("algorithm", c.algorithm.name())?;
    d.set_item("one_shot_max_bytes", c.one_shot_max_bytes)?;
    d.set_item("max_blocks_per_rank", c.max_blocks_per_rank)?;
    d.set_item("shared_sm_percent", c.shared_sm_percent)?;
    d.set_item("low_latency_max_bytes", c.low_latency_max_bytes)?;
    d.set_item("timeout", c.timeout.as_secs_f64())?;
    d.set_item("nccl_above_bytes", c.nccl_above_bytes)?;
    d.set_item("peer_kernels", c.peer_kernels)?;
    d.set_item("pdl", c.pdl)?;
    d.set_item("pdl_at_exit", c.pdl_at_exit)?;
    d.set_item("early_trigger", c.early_trigger)?;
    d.set_item("remote_sync_domain", c.remote_sync_domain)?;
    d.set_item("check_divergence", c.check_divergence)?;
    let tuning = c.tuning.as_ref().map(|t| {
        t.origin()
            .map_or_else(|| "given in memory".to_string(), |p| p.display().to_string())
    });
    d.set_item("tuning", tuning)?;
    d.set_item("multicast", c.multicast.name())?;
    d.set_item("reproducible", c.reproducible)?;
    d.set_item("pool_bytes", c.pool_bytes)?;
    d.set_item("nccl_windows", c.nccl_windows)?;
    Ok(d)
}

/// Validates keyword arguments as a `Config` and returns every field (defaults filled in).
#[pyfunction]
#[pyo3(signature = (**options))]
fn validate_config<'py>(
    py: Python<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    config_dict(py, &parse_config(options)?)
}

/// Whether the CUDA kernels were compiled into this build.
#[pyfunction]
fn kernels_available() -> bool {
    symm_allreduce::kernels_available()
}

/// Number of visible CUDA devices (raises `UnavailableError` without a driver).
#[pyfunction]
fn device_count() -> PyResult<usize> {
    symm_allreduce::device_count().map_err(raise)
}

/// A bootstrap whose byte exchange is a Python callable (`gather(bytes) -> list[bytes]`,
/// one entry per rank): `symm_allreduce` passes one that all-gathers through a
/// `torch.distributed` CPU group. Descriptors travel over the crate's default exchange
/// (per-rank abstract Unix sockets whose names and tokens go through `gather`).
struct PyBootstrap {
    rank: usize,
    world: usize,
    gather: Py<PyAny>,
    timeout: Duration,
}

impl Bootstrap for PyBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, bytes: &[u8]) -> symm_allreduce::Result<Vec<Vec<u8>>> {
        Python::attach(|py| {
            let failed = |e: PyErr| Error::Bootstrap {
                reason: format!("the group's all-gather (a Python callable) failed: {e}"),
            };
            let out = self
                .gather
                .call1(py, (PyBytes::new(py, bytes),))
                .map_err(failed)?;
            let parts: Vec<Bound<'_, PyBytes>> = out.extract(py).map_err(failed)?;
            if parts.len() != self.world {
                return Err(Error::Bootstrap {
                    reason: format!(
                        "the group's all-gather returned {} entries, the world is {}",
                        parts.len(),
                        self.world
                    ),
                });
            }
            Ok(parts.iter().map(|p| p.as_bytes().to_vec()).collect())
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Streams whose wrappers a communicator keeps (the most recent ones; torch's current stream
/// is per thread, so a few threads each keep theirs without a new wrapper or a driver call per
/// call).
const STREAM_CACHE: usize = 8;

/// One rank of a group: the crate's `Communicator` plus its device context. Usable from any
/// Python thread: the crate's communicator is `Send + Sync` and orders its own calls; the
/// locks here guard only the handle and the stream cache and are never held across a call, a
/// wait or a return into Python, so no thread that holds the GIL waits on a thread that needs
/// it. The blocking calls (setup, `synchronize`, `close`, dropping the last reference) release
/// the GIL, so a stuck peer stalls only the thread that waits on it, for at most the timeout.
#[pyclass(frozen, module = "symm_allreduce._native", name = "Communicator")]
struct PyCommunicator {
    /// `None` once closed. A call works on its own clone of the `Arc`, so `close` (which
    /// needs the communicator back by value) waits for calls in flight on other threads.
    comm: Mutex<Option<Arc<Communicator>>>,
    ctx: Arc<CudaContext>,
    /// The bootstrap of a process group, for the collective close.
    bootstrap: Option<PyBootstrap>,
    /// The last streams seen, checked to be streams of `ctx`, and their wrappers, most recent
    /// first: a call on the stream of the previous call compares one integer (no driver call,
    /// no allocation).
    streams: Mutex<Vec<(usize, Arc<CudaStream>)>>,
}

/// A lock whose holder panicked is still consistent here (every critical section is a plain
/// read or assignment of the guarded value).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn closed_error() -> PyErr {
    invalid_call("this communicator was closed: create a new one")
}

impl PyCommunicator {
    fn new(comm: Communicator, bootstrap: Option<PyBootstrap>) -> PyResult<PyCommunicator> {
        let ctx = symm_allreduce::context(comm.device()).map_err(raise)?;
        Ok(PyCommunicator {
            comm: Mutex::new(Some(Arc::new(comm))),
            ctx,
            bootstrap,
            streams: Mutex::new(Vec::with_capacity(STREAM_CACHE)),
        })
    }

    /// The communicator, for one call (its own reference: no lock is held during the call).
    fn comm(&self) -> PyResult<Arc<Communicator>> {
        lock(&self.comm).clone().ok_or_else(closed_error)
    }

    /// The caller's stream, checked to belong to this rank's device when its handle is not
    /// one of the last [`STREAM_CACHE`] this communicator checked. A handle seen before is
    /// taken as the same stream: torch's streams (its pool's, and the default ones) live as
    /// long as the process, and a stream handed in as current must outlive its calls anyway;
    /// only a stream destroyed and its handle value reused by a stream of another device
    /// would get past the check (the driver then refuses the launch on a stream of another
    /// context, "invalid resource handle", and the call raises rather than running there).
    fn stream(&self, handle: usize) -> PyResult<Arc<CudaStream>> {
        {
            let mut streams = lock(&self.streams);
            if let Some(i) = streams.iter().position(|(h, _)| *h == handle) {
                // Most recent first: one rotation within the fixed capacity (no allocation).
                streams[..=i].rotate_right(1);
                return Ok(streams[0].1.clone());
            }
        }
        tensor::check_stream(&self.ctx, handle).map_err(raise)?;
        // SAFETY: the handle is a stream of this context (checked above); the caller (torch)
        // keeps it alive for its calls, and the wrapper (borrowed: dropping it destroys
        // nothing) is only used by this communicator's calls on that stream, which the
        // caller orders with its own work as any launch on its current stream is.
        let s = unsafe { self.ctx.wrap_borrowed_stream(handle as _) };
        let mut streams = lock(&self.streams);
        streams.truncate(STREAM_CACHE - 1);
        streams.insert(0, (handle, s.clone()));
        Ok(s)
    }

    /// A described tensor as a buffer of the call on `stream`, after every check of the
    /// descriptor and the driver's word on where its memory is.
    fn raw<'s, T>(
        &self,
        arg: &TensorArg,
        what: &'static str,
        stream: &'s Arc<CudaStream>,
    ) -> PyResult<Raw<'s, T>> {
        tensor::check(arg, what, self.ctx.ordinal())?;
        Ok(Raw::new(arg.0, arg.1, stream))
    }

    /// `all_reduce_ptr`'s work, past PyO3's argument conversion: the one path of that call
    /// and of [`time_ptr_round`]'s rounds.
    fn reduce_ptr(
        &self,
        (input, input_len): (u64, usize),
        (output, output_len): (u64, usize),
        dtype: u8,
        stream: usize,
        algorithm: u8,
    ) -> PyResult<()> {
        let (kind, algorithm) = decode_ptr_call((input, input_len), (output, output_len), dtype, algorithm)?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(sum kind, T => {
            if input == output && input_len == output_len {
                let mut buf = Raw::<T>::new(output, output_len, &s);
                comm.all_reduce_in_place(&mut buf, &s, algorithm).map_err(raise)
            } else {
                let inp = Raw::<T>::new(input, input_len, &s);
                let mut out = Raw::<T>::new(output, output_len, &s);
                comm.all_reduce_with(&inp, &mut out, &s, algorithm).map_err(raise)
            }
        })
    }

    /// Takes the communicator out (later calls raise "closed") and waits, without the GIL,
    /// until calls in flight on other threads are done with it; then hands it to `finish`.
    /// A call that is still running after twice the timeout (it cannot be: every wait is
    /// bounded by it) puts the communicator back and reports it.
    fn take_and<R: Send>(
        &self,
        py: Python<'_>,
        finish: impl FnOnce(Communicator) -> symm_allreduce::Result<R> + Send,
    ) -> PyResult<Option<R>> {
        let Some(mut shared) = lock(&self.comm).take() else {
            return Ok(None);
        };
        lock(&self.streams).clear();
        let patience = shared.config().timeout * 2 + Duration::from_secs(1);
        let outcome = py.detach(move || {
            let start = Instant::now();
            loop {
                match Arc::try_unwrap(shared) {
                    Ok(comm) => return Ok(finish(comm)),
                    Err(back) if start.elapsed() > patience => return Err(back),
                    Err(back) => {
                        shared = back;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            }
        });
        match outcome {
            Ok(done) => done.map(Some).map_err(raise),
            Err(back) => {
                *lock(&self.comm) = Some(back);
                Err(invalid_call(format!(
                    "close: another thread was still inside a call of this communicator after {patience:?}; \
                     the communicator is still open"
                )))
            }
        }
    }
}

impl Drop for PyCommunicator {
    fn drop(&mut self) {
        // Dropping the communicator waits for its last call (bounded by the timeout): without
        // the GIL, so other Python threads run meanwhile.
        let comm = self.comm.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(comm) = comm {
            // Deallocation runs attached, so this borrows that attachment; where there is none
            // to have (the interpreter shutting down), the closure is dropped unrun, and the
            // communicator with it.
            let _ = Python::try_attach(|py| py.detach(move || drop(comm)));
        }
    }
}

#[pymethods]
impl PyCommunicator {
    /// This rank's index.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.comm()?.rank())
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> PyResult<usize> {
        Ok(self.comm()?.world_size())
    }

    /// The CUDA device index of this rank.
    #[getter]
    fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Whether the peer kernels are set up.
    #[getter]
    fn has_peer_kernels(&self) -> PyResult<bool> {
        Ok(self.comm()?.has_peer_kernels())
    }

    /// Why the peer kernels are not set up (None when they are).
    #[getter]
    fn peer_kernels_unavailable(&self) -> PyResult<Option<String>> {
        Ok(self.comm()?.peer_kernels_unavailable().map(str::to_string))
    }

    /// Whether the communicator has been closed.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.comm).is_none()
    }

    /// The configuration, every field.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, self.comm()?.config())
    }

    /// The crate's setup report.
    fn describe(&self) -> PyResult<String> {
        Ok(self.comm()?.describe())
    }

    /// Where an all-reduce of `nbytes` bytes of `dtype` goes, and why.
    #[pyo3(signature = (nbytes, dtype, algorithm = "auto"))]
    fn path(&self, nbytes: usize, dtype: &str, algorithm: &str) -> PyResult<String> {
        let kind = Kind::parse(dtype)?;
        let dtype = kind.element()?;
        if nbytes % dtype.size() != 0 {
            return Err(invalid_call(format!(
                "{nbytes} bytes is not a whole number of {} elements ({} bytes each)",
                kind.torch_name(),
                dtype.size()
            )));
        }
        let algorithm = parse_algorithm(algorithm)?;
        let decision = self
            .comm()?
            .path(nbytes / dtype.size(), dtype, algorithm)
            .map_err(raise)?;
        Ok(decision.to_string())
    }

    /// Raises the error that made the communicator unusable, if any.
    fn check_usable(&self) -> PyResult<()> {
        self.comm()?.check_usable().map_err(raise)
    }

    /// Waits for this rank's calls on `stream` and reports a peer timeout or kernel fault
    /// (without the GIL: other Python threads run while it waits).
    fn synchronize(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        py.detach(move || comm.synchronize(&s)).map_err(raise)
    }

    /// `output ← Σ_ranks input` (both `(ptr, numel, dtype, device_type, device_index,
    /// contiguous)` descriptors); `output` may be `input` (in place).
    #[pyo3(signature = (input, output, stream, algorithm = "auto"))]
    fn all_reduce(
        &self,
        input: TensorArg,
        output: TensorArg,
        stream: usize,
        algorithm: &str,
    ) -> PyResult<()> {
        let algorithm = parse_algorithm(algorithm)?;
        let kind = tensor::same_dtype(&[(&input, "input"), (&output, "output")])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(sum kind, T => {
            if input.0 == output.0 && input.1 == output.1 {
                let mut buf = self.raw::<T>(&output, "output", &s)?;
                comm.all_reduce_in_place(&mut buf, &s, algorithm).map_err(raise)
            } else {
                let inp = self.raw::<T>(&input, "input", &s)?;
                let mut out = self.raw::<T>(&output, "output", &s)?;
                comm.all_reduce_with(&inp, &mut out, &s, algorithm).map_err(raise)
            }
        })
    }

    /// The hot path of `SymmAllReduce.all_reduce` and `custom_all_reduce`: `output ← Σ_ranks
    /// input` for two buffers given as device address and element count (in place when both
    /// are the same), `dtype` and `algorithm` as codes (`dtype_code`, `algorithm_code`).
    ///
    /// For tensors the Python layer has checked through torch itself: plain `torch.Tensor`s,
    /// CUDA, of this rank's device, contiguous, of one summable dtype. Unlike `all_reduce`,
    /// it does not ask the driver again where the memory is (torch's device is the driver's);
    /// the stream is checked as for every call ([`PyCommunicator::stream`]), and the crate
    /// checks the rest (lengths, alignment, capacity). Keeps the GIL: it only enqueues, and
    /// waits on nothing but the communicator's own short-held locks.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_ptr(
        &self,
        input: u64,
        input_len: usize,
        output: u64,
        output_len: usize,
        dtype: u8,
        stream: usize,
        algorithm: u8,
    ) -> PyResult<()> {
        self.reduce_ptr((input, input_len), (output, output_len), dtype, stream, algorithm)
    }

    /// Zero-copy in-place sum of a buffer of this communicator's symmetric pool (a tensor
    /// made from `alloc_symmetric`'s capsule): every rank calls it with its buffer of the same
    /// allocation; anything else is refused (`ForeignPoolBuffer`) before anything runs.
    fn all_reduce_pool(&self, buffer: TensorArg, stream: usize) -> PyResult<()> {
        let kind = tensor::same_dtype(&[(&buffer, "buffer")])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(sum kind, T => {
            let mut buf = self.raw::<T>(&buffer, "buffer", &s)?;
            comm.all_reduce_pool_buffer(&mut buf, &s).map_err(raise)
        })
    }

    /// Gathers every rank's `input` into `output`, rank-major.
    fn all_gather(&self, input: TensorArg, output: TensorArg, stream: usize) -> PyResult<()> {
        let kind = tensor::same_dtype(&[(&input, "input"), (&output, "output")])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(gather kind, T => {
            let inp = self.raw::<T>(&input, "input", &s)?;
            let mut out = self.raw::<T>(&output, "output", &s)?;
            comm.all_gather(&inp, &mut out, &s).map_err(raise)
        })
    }

    /// Gathers `counts[q]` elements of every rank q into `output`, rank-major.
    fn all_gather_v(
        &self,
        input: TensorArg,
        counts: Vec<usize>,
        output: TensorArg,
        stream: usize,
    ) -> PyResult<()> {
        let kind = tensor::same_dtype(&[(&input, "input"), (&output, "output")])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(gather kind, T => {
            let inp = self.raw::<T>(&input, "input", &s)?;
            let mut out = self.raw::<T>(&output, "output", &s)?;
            comm.all_gather_v(&inp, &counts, &mut out, &s).map_err(raise)
        })
    }

    /// Sums `input` (`world · len` elements) and leaves this rank's slice in `output`.
    #[pyo3(signature = (input, output, stream, algorithm = "auto"))]
    fn reduce_scatter(
        &self,
        input: TensorArg,
        output: TensorArg,
        stream: usize,
        algorithm: &str,
    ) -> PyResult<()> {
        let algorithm = parse_algorithm(algorithm)?;
        let kind = tensor::same_dtype(&[(&input, "input"), (&output, "output")])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(sum kind, T => {
            let inp = self.raw::<T>(&input, "input", &s)?;
            let mut out = self.raw::<T>(&output, "output", &s)?;
            comm.reduce_scatter_with(&inp, &mut out, &s, algorithm).map_err(raise)
        })
    }

    /// `residual ← residual + Σ_ranks input`, `norm_out ← RMSNorm(residual) · weight`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (input, residual, weight, eps, norm_out, stream, algorithm = "auto"))]
    fn all_reduce_add_rmsnorm(
        &self,
        input: TensorArg,
        residual: TensorArg,
        weight: TensorArg,
        eps: f32,
        norm_out: TensorArg,
        stream: usize,
        algorithm: &str,
    ) -> PyResult<()> {
        let algorithm = parse_algorithm(algorithm)?;
        let kind = tensor::same_dtype(&[
            (&input, "input"),
            (&residual, "residual"),
            (&weight, "weight"),
            (&norm_out, "norm_out"),
        ])?;
        let comm = self.comm()?;
        let s = self.stream(stream)?;
        with_type!(sum kind, T => {
            let inp = self.raw::<T>(&input, "input", &s)?;
            let mut res = self.raw::<T>(&residual, "residual", &s)?;
            let w = self.raw::<T>(&weight, "weight", &s)?;
            let mut out = self.raw::<T>(&norm_out, "norm_out", &s)?;
            comm.all_reduce_add_rmsnorm_with(&inp, &mut res, &w, eps, &mut out, &s, algorithm)
                .map_err(raise)
        })
    }

    /// A buffer of `shape` elements of `dtype` in the symmetric pool, as a DLPack capsule
    /// (`torch.from_dlpack` makes it a tensor). Collective: every rank makes the same
    /// sequence of allocations and frees.
    fn alloc_symmetric<'py>(
        &self,
        py: Python<'py>,
        shape: Vec<i64>,
        dtype: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = Kind::parse(dtype)?;
        let comm = self.comm()?;
        let len = dlpack::element_count(&shape)?;
        // The buffer's own stream is only its device's tag: the NULL stream wrapper, which
        // nothing is launched on and which never dangles.
        let s = self.ctx.default_stream();
        with_type!(sum kind, T => {
            let t = comm.alloc_symmetric::<T>(len, &s).map_err(raise)?;
            dlpack::capsule(py, t, shape, kind, self.ctx.ordinal())
        })
    }

    /// Bytes of the symmetric pool still free, and the largest free region.
    fn pool_free(&self) -> PyResult<(usize, usize)> {
        Ok(self.comm()?.pool_free())
    }

    /// Waits for the last call, then (in a process group) votes with every rank before the
    /// workspace is unmapped; a virtual-rank group just releases it. Idempotent.
    /// Without the GIL, it waits first for calls still running on other threads.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let bootstrap = self.bootstrap.as_ref();
        self.take_and(py, move |comm| match bootstrap {
            Some(b) => comm.close(b),
            None => {
                drop(comm);
                Ok(())
            }
        })?;
        Ok(())
    }
}

/// `world` virtual ranks on one device in this process (each with its own mapping of every
/// peer's memory); every `Config` field as a keyword.
#[pyfunction]
#[pyo3(signature = (world, device, **options))]
fn local_group(
    py: Python<'_>,
    world: usize,
    device: usize,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<Py<PyCommunicator>>> {
    let config = parse_config(options)?;
    symm_allreduce::validate_world(world).map_err(raise)?;
    let comms = py
        .detach(|| {
            let ctx = symm_allreduce::context(device)?;
            let contexts = vec![ctx; world];
            Communicator::local_group(&contexts, config)
        })
        .map_err(raise)?;
    comms
        .into_iter()
        .map(|c| Py::new(py, PyCommunicator::new(c, None)?))
        .collect()
}

/// One rank of a process group whose bytes travel through `gather(bytes) -> list[bytes]`
/// (collective: every rank calls it with the same configuration).
#[pyfunction]
#[pyo3(signature = (rank, world, device, gather, timeout = 30.0, **options))]
fn from_gather(
    py: Python<'_>,
    rank: usize,
    world: usize,
    device: usize,
    gather: Py<PyAny>,
    timeout: f64,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<PyCommunicator> {
    let config = parse_config(options)?;
    symm_allreduce::validate_world(world).map_err(raise)?;
    if rank >= world {
        return Err(raise(Error::InvalidWorldSize {
            world,
            reason: format!("rank {rank} is not below the world size"),
        }));
    }
    let timeout = Duration::try_from_secs_f64(timeout)
        .map_err(|e| invalid_call(format!("bootstrap timeout {timeout} s is not a duration ({e})")))?;
    let bootstrap = PyBootstrap {
        rank,
        world,
        gather,
        timeout,
    };
    // Without the GIL: the setup waits on the peers (each exchange bounded by the timeout);
    // the group's gather takes the GIL for itself when it is called.
    let comm = py
        .detach(|| {
            let ctx = symm_allreduce::context(device)?;
            Communicator::new(&bootstrap, ctx, config)
        })
        .map_err(raise)?;
    PyCommunicator::new(comm, Some(bootstrap))
}

/// An example of a crate error of the named kind (`PeerTimeout`, `Diverged`, `LengthMismatch`,
/// ...) raised as Python sees it: for testing the exception mapping without a GPU.
#[pyfunction]
fn _raise_example(kind: &str) -> PyResult<()> {
    Err(raise(errors::example(kind)?))
}

/// Element size in bytes of a dtype name, or an `InvalidCallError` naming the supported ones.
#[pyfunction]
fn element_size(dtype: &str) -> PyResult<usize> {
    Ok(Kind::parse(dtype)?.size())
}

/// Validates a tensor descriptor for a rank on `device` without a GPU call where the
/// descriptor alone is wrong (CPU tensor, non-contiguous, unsupported dtype, another device).
#[pyfunction]
fn check_tensor(desc: TensorArg, device: usize) -> PyResult<()> {
    tensor::check_descriptor(&desc, "input", device)
}

/// The names of the dtypes the reductions take, and those the gathers also move.
#[pyfunction]
fn dtypes() -> (Vec<&'static str>, Vec<&'static str>) {
    let reduce = DType::ALL
        .iter()
        .map(|d| Kind::from_dtype(*d).torch_name())
        .collect();
    (reduce, Kind::ALL.iter().map(|k| k.torch_name()).collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", symm_allreduce::VERSION)?;
    m.add("MAX_RANKS", symm_allreduce::MAX_RANKS)?;
    m.add("CONFIG_KEYS", CONFIG_KEYS.to_vec())?;
    m.add("ALGORITHMS", Algorithm::ALL.map(Algorithm::name).to_vec())?;
    m.add_class::<PyCommunicator>()?;
    m.add_function(wrap_pyfunction!(kernels_available, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(local_group, m)?)?;
    m.add_function(wrap_pyfunction!(from_gather, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_example, m)?)?;
    m.add_function(wrap_pyfunction!(element_size, m)?)?;
    m.add_function(wrap_pyfunction!(check_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(algorithm_code, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_code, m)?)?;
    m.add_function(wrap_pyfunction!(check_ptr_call, m)?)?;
    m.add_function(wrap_pyfunction!(time_ptr_round, m)?)?;
    Ok(())
}
