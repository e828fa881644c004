//! NCCL on symmetric windows, on the GPU at world 1 (NCCL refuses several ranks on one GPU):
//! a communicator made by `with_nccl_fallback` registers its symmetric allocation as an NCCL
//! window, or says in `describe()` which setup step turned the windows off and why (NCCL
//! older than 2.27 included); calls routed to NCCL on pool buffers (all-reduce out of place
//! and in place, all-gather, the all-gather-v of fp4-sized odd byte counts) are byte-exact,
//! eagerly and replayed from a CUDA graph; plain buffers keep working beside them; and
//! `Config::nccl_windows: false` turns the windows off with that reason.
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU or NCCL every test is
//! reported as ignored with the reason (a failure under REQUIRE_GPU=1).

mod common;

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use symm_allreduce::{Algorithm, Communicator, Config, SocketStore, StoreAddress, SymmetricTensor};

/// fp4 (e2m1) payloads: two values a byte, 7168-wide rows; an odd tail on top.
const FP4_ROW: usize = 7168 / 2;

fn config(nccl_windows: bool) -> Config {
    Config {
        capacity_bytes: 1 << 20,
        pool_bytes: 160 << 20,
        nccl_above_bytes: Some(64 << 10),
        nccl_windows,
        ..Config::default()
    }
}

/// The bytes of a pool buffer (the pool holds reducible types; fp4 payloads are bytes), a
/// view the caller keeps inside the buffer's lifetime.
struct Bytes {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _buffer: SymmetricTensor<bf16>,
}

impl Bytes {
    fn new(comm: &Communicator, len: usize, stream: &Arc<CudaStream>) -> Bytes {
        let buffer = comm.alloc_symmetric::<bf16>(len.div_ceil(2), stream).unwrap();
        Bytes {
            ptr: buffer.device_address(),
            len,
            stream: stream.clone(),
            _buffer: buffer,
        }
    }
}

impl DeviceSlice<u8> for Bytes {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<u8> for Bytes {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl DevicePtrMut<u8> for Bytes {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// A lone rank with its own NCCL fallback.
fn lone_rank(ctx: &Arc<CudaContext>, config: Config) -> Communicator {
    let address = StoreAddress::unique("symm-win-test").unwrap();
    let store = SocketStore::new(&address, 0, 1, Duration::from_secs(30)).unwrap();
    Communicator::with_nccl_fallback(&store, ctx.clone(), config).expect("with_nccl_fallback at world 1")
}

/// Bytes that are neither zero nor repeating, with NaN-like and signed patterns.
fn bytes(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + seed * 17 + i / 251) % 256) as u8)
        .collect()
}

fn first_difference(what: &str, expected: &[u8], got: &[u8]) {
    assert_eq!(expected.len(), got.len(), "{what}: lengths");
    if let Some(i) = expected.iter().zip(got).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} of {} expected {:#04x} got {:#04x}",
            expected.len(),
            expected[i],
            got[i]
        );
    }
}

/// The registration succeeds, or `describe()` names the step and the reason; an NCCL older
/// than 2.27 is the only reason to be off before the check step.
fn registration_succeeds_or_describe_says_why(ctx: Arc<CudaContext>) {
    let comm = lone_rank(&ctx, config(true));
    let report = comm.describe();
    println!("{report}");
    let line = report
        .lines()
        .find(|l| l.starts_with("NCCL windows: "))
        .expect("describe() has an NCCL windows line");
    let version = symm_allreduce::nccl_library().unwrap().version;
    let minor: u32 = version.split('.').nth(1).unwrap().parse().unwrap();
    match comm.nccl_windows_unavailable() {
        None => {
            assert!(comm.has_nccl_windows());
            assert!(line.starts_with("NCCL windows: on ("), "{line}");
            assert!(minor >= 27, "windows on with NCCL {version}");
        }
        Some(why) => {
            assert!(line.contains(why), "{line} does not carry {why}");
            if minor < 27 {
                assert!(why.contains("2.27.0 or newer") && why.contains(&version), "{why}");
            } else {
                assert!(
                    why.contains("NCCL window check") || why.contains("NCCL window registration"),
                    "NCCL {version}: the reason names no step: {why}"
                );
            }
            println!("windows off: {why}");
        }
    }
    let off = lone_rank(&ctx, config(false));
    assert!(!off.has_nccl_windows());
    assert!(
        off.describe()
            .contains("NCCL windows: off (Config::nccl_windows is false"),
        "{}",
        off.describe()
    );
}

/// All-reduce through NCCL on pool buffers (out of place, pool to pool, and in place), bf16
/// and f32 at 1 MiB to 64 MiB and odd lengths: a lone rank's sum is its input, bit for bit.
/// A plain buffer through the same communicator keeps the plain path.
fn all_reduce_through_nccl_on_pool_buffers_is_exact(ctx: Arc<CudaContext>) {
    let comm = lone_rank(&ctx, config(true));
    let stream = ctx.new_stream().unwrap();
    for bytes_len in [1usize << 20, (4 << 20) + 6, 64 << 20] {
        let len = bytes_len / 2;
        let path = comm
            .path(len, symm_allreduce::DType::BF16, Algorithm::Nccl)
            .unwrap();
        assert_eq!(path.algorithm, Algorithm::Nccl, "{path}");
        let host: Vec<bf16> = bytes(len, len * 2)
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1] & 0x7f])))
            .collect();
        let mut input = comm.alloc_symmetric::<bf16>(len, &stream).unwrap();
        let mut output = comm.alloc_symmetric::<bf16>(len, &stream).unwrap();
        stream.memcpy_htod(&host, &mut input).unwrap();
        comm.all_reduce_with(&input, &mut output, &stream, Algorithm::Nccl)
            .unwrap();
        comm.all_reduce_in_place(&mut input, &stream, Algorithm::Nccl)
            .unwrap();
        comm.synchronize(&stream).unwrap();
        let (mut out, mut again) = (vec![bf16::ZERO; len], vec![bf16::ZERO; len]);
        stream.memcpy_dtoh(&output, &mut out).unwrap();
        stream.memcpy_dtoh(&input, &mut again).unwrap();
        let bits = |v: &[bf16]| {
            v.iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect::<Vec<u8>>()
        };
        first_difference(&format!("pool to pool, {len} bf16"), &bits(&host), &bits(&out));
        first_difference(&format!("pool in place, {len} bf16"), &bits(&host), &bits(&again));
        // The same data from a plain buffer.
        let plain = stream.clone_htod(&host).unwrap();
        let mut plain_out = stream.alloc_zeros::<bf16>(len).unwrap();
        comm.all_reduce_with(&plain, &mut plain_out, &stream, Algorithm::Nccl)
            .unwrap();
        comm.synchronize(&stream).unwrap();
        first_difference(
            &format!("plain, {len} bf16"),
            &bits(&host),
            &bits(&stream.clone_dtoh(&plain_out).unwrap()),
        );
    }
    let len = (1 << 20) / 4 + 3;
    let host: Vec<f32> = (0..len).map(|i| (i as f32) * 0.37 - 1000.0).collect();
    let mut input = comm.alloc_symmetric::<f32>(len, &stream).unwrap();
    let mut output = comm.alloc_symmetric::<f32>(len, &stream).unwrap();
    stream.memcpy_htod(&host, &mut input).unwrap();
    comm.all_reduce_with(&input, &mut output, &stream, Algorithm::Nccl)
        .unwrap();
    comm.synchronize(&stream).unwrap();
    let mut out = vec![0f32; len];
    stream.memcpy_dtoh(&output, &mut out).unwrap();
    assert!(
        host.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
        "f32 pool to pool"
    );
}

/// `config(true)` with every `Auto` call sent to NCCL: the all-gather-v has no per-call
/// algorithm, and below the workspace's capacity `Auto` takes the peer kernels.
fn nccl_configured() -> Config {
    Config {
        algorithm: Algorithm::Nccl,
        ..config(true)
    }
}

/// The all-gather-v of fp4-sized, odd byte counts and the all-gather through NCCL on pool
/// buffers: byte for byte. Counts above the workspace's capacity go to NCCL under `Auto`;
/// the smaller ones on a communicator configured with `Algorithm::Nccl`.
fn all_gather_v_through_nccl_on_pool_buffers_is_byte_exact(ctx: Arc<CudaContext>) {
    let sized = lone_rank(&ctx, config(true));
    let above = 1000 * FP4_ROW + 1;
    assert!(above > config(true).capacity_bytes);
    let path = sized.all_gather_v_path(&[above]).unwrap();
    assert_eq!(
        path.algorithm,
        Algorithm::Nccl,
        "{above} bytes under Auto: {path}"
    );
    drop(sized);
    let comm = lone_rank(&ctx, nccl_configured());
    let stream = ctx.new_stream().unwrap();
    for count in [3 * FP4_ROW + 1, 97 * FP4_ROW + 7, above] {
        let path = comm.all_gather_v_path(&[count]).unwrap();
        assert_eq!(path.algorithm, Algorithm::Nccl, "{count} bytes: {path}");
        let host = bytes(count, count);
        let mut input = Bytes::new(&comm, count, &stream);
        let mut output = Bytes::new(&comm, count, &stream);
        stream.memcpy_htod(&host, &mut input).unwrap();
        comm.all_gather_v(&input, &[count], &mut output, &stream).unwrap();
        comm.synchronize(&stream).unwrap();
        let mut got = vec![0u8; count];
        stream.memcpy_dtoh(&output, &mut got).unwrap();
        first_difference(&format!("all_gather_v of {count} bytes"), &host, &got);

        let mut gathered = Bytes::new(&comm, count, &stream);
        comm.all_gather_with(&input, &mut gathered, &stream, Algorithm::Nccl)
            .unwrap();
        comm.synchronize(&stream).unwrap();
        stream.memcpy_dtoh(&gathered, &mut got).unwrap();
        first_difference(&format!("all_gather of {count} bytes"), &host, &got);
    }
}

/// NCCL calls on pool buffers captured in a CUDA graph and replayed on new inputs.
fn nccl_calls_on_pool_buffers_replay_from_a_graph(ctx: Arc<CudaContext>) {
    let comm = lone_rank(&ctx, nccl_configured());
    let stream: Arc<CudaStream> = ctx.new_stream().unwrap();
    let (len, count) = (1 << 19, 5 * FP4_ROW + 3);
    let path = comm.all_gather_v_path(&[count]).unwrap();
    assert_eq!(path.algorithm, Algorithm::Nccl, "{path}");
    let mut ar_in = comm.alloc_symmetric::<bf16>(len, &stream).unwrap();
    let mut ar_out = comm.alloc_symmetric::<bf16>(len, &stream).unwrap();
    let mut ag_in = Bytes::new(&comm, count, &stream);
    let mut ag_out = Bytes::new(&comm, count, &stream);
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    comm.all_reduce_with(&ar_in, &mut ar_out, &stream, Algorithm::Nccl)
        .unwrap();
    comm.all_gather_v(&ag_in, &[count], &mut ag_out, &stream).unwrap();
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    for replay in 0..20 {
        let ar: Vec<bf16> = (0..len)
            .map(|i| bf16::from_bits(((i * 7 + replay * 13) % 0x7f00) as u16))
            .collect();
        let ag = bytes(replay, count);
        stream.memcpy_htod(&ar, &mut ar_in).unwrap();
        stream.memcpy_htod(&ag, &mut ag_in).unwrap();
        graph.launch().unwrap();
        comm.synchronize(&stream).unwrap();
        let mut got = vec![bf16::ZERO; len];
        stream.memcpy_dtoh(&ar_out, &mut got).unwrap();
        assert!(
            ar.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
            "replay {replay}: all-reduce"
        );
        let mut got = vec![0u8; count];
        stream.memcpy_dtoh(&ag_out, &mut got).unwrap();
        first_difference(&format!("replay {replay}: all_gather_v"), &ag, &got);
    }
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "gpu_nccl_windows",
        vec![
            gpu_nccl_test!(registration_succeeds_or_describe_says_why),
            gpu_nccl_test!(all_reduce_through_nccl_on_pool_buffers_is_exact),
            gpu_nccl_test!(all_gather_v_through_nccl_on_pool_buffers_is_byte_exact),
            gpu_nccl_test!(nccl_calls_on_pool_buffers_replay_from_a_graph),
        ],
    )
}
