//! Reliability on the GPU (virtual ranks): a long soak with sampled verification, create and
//! drop without leaks, and a peer that was dropped.
//!
//! Run by [`common::harness`] (`harness = false`): without a GPU every test is reported as
//! ignored with the reason, and the run ends with a line counting GPU tests ran and skipped.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check_against_f64, check_bits, emulate, group, random_input, rng, TestElem};
use half::{bf16, f16};
use rand::Rng;
use symm_allreduce::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use symm_allreduce::{Algorithm, Communicator, Config, DType, Error};

/// Per-dtype device pools of random data (one per rank) and output slots.
struct Pools<T: TestElem> {
    host: Vec<Vec<T>>,
    input: Vec<CudaSlice<T>>,
    output: Vec<CudaSlice<T>>,
}

impl<T: TestElem> Pools<T> {
    fn new(streams: &[Arc<CudaStream>], len: usize, out_len: usize, seed: u64) -> Self {
        let mut g = rng(seed);
        let host: Vec<Vec<T>> = streams.iter().map(|_| random_input(&mut g, len)).collect();
        let input = streams
            .iter()
            .zip(&host)
            .map(|(s, h)| s.clone_htod(h).unwrap())
            .collect();
        let output = streams.iter().map(|s| s.alloc_zeros(out_len).unwrap()).collect();
        Pools { host, input, output }
    }

    /// Launches one all-reduce of `len` elements from pool offset `offset`; if `verify`, waits
    /// and checks it against both references.
    #[allow(clippy::too_many_arguments)]
    fn call(
        &mut self,
        comms: &[Communicator],
        streams: &[Arc<CudaStream>],
        offset: usize,
        len: usize,
        slot: usize,
        algo: Algorithm,
        verify: bool,
    ) {
        for r in 0..comms.len() {
            let input = self.input[r].slice(offset..offset + len);
            let mut output = self.output[r].slice_mut(slot..slot + len);
            comms[r]
                .all_reduce_with(&input, &mut output, &streams[r], algo)
                .unwrap();
        }
        if !verify {
            return;
        }
        let outs: Vec<Vec<T>> = (0..comms.len())
            .map(|r| {
                comms[r].synchronize(&streams[r]).unwrap();
                streams[r]
                    .clone_dtoh(&self.output[r].slice(slot..slot + len))
                    .unwrap()
            })
            .collect();
        let ins: Vec<Vec<T>> = self
            .host
            .iter()
            .map(|h| h[offset..offset + len].to_vec())
            .collect();
        let what = format!("{} len {len} offset {offset} {algo}", T::DTYPE);
        for (r, o) in outs.iter().enumerate() {
            check_bits(&format!("{what} rank {r}"), &outs[0], o).unwrap();
        }
        check_bits(&what, &emulate(&ins), &outs[0]).unwrap();
        check_against_f64(&ins, &outs[0]).unwrap();
    }
}

fn soak_100k_calls_random_sizes_and_dtypes_sampled_verification(ctx: Arc<CudaContext>) {
    const CALLS: usize = 100_000;
    const POOL: usize = 1 << 20;
    const MAX_LEN: usize = 70_000;
    let world = 4;
    let (comms, streams) = group(
        &ctx,
        world,
        Config {
            capacity_bytes: MAX_LEN * 4,
            ..Config::default()
        },
    );
    let mut f32s = Pools::<f32>::new(&streams, POOL, MAX_LEN * 4, 1);
    let mut f16s = Pools::<f16>::new(&streams, POOL, MAX_LEN * 4, 2);
    let mut bf16s = Pools::<bf16>::new(&streams, POOL, MAX_LEN * 4, 3);
    let mut g = rng(4);
    let started = Instant::now();
    let mut verified = 0;
    for c in 0..CALLS {
        // Mostly decode-sized messages, sometimes large ones.
        let len = if g.random_range(0..10) == 0 {
            g.random_range(1..=MAX_LEN)
        } else {
            g.random_range(1..=4096)
        };
        let offset = g.random_range(0..(POOL - len) / 8) * 8;
        let slot = g.random_range(0..4) * MAX_LEN;
        let algo = [Algorithm::Auto, Algorithm::OneShot, Algorithm::TwoShot][g.random_range(0..3)];
        let verify = c % 97 == 0 || c == CALLS - 1;
        verified += verify as usize;
        match DType::ALL[g.random_range(0..3)] {
            DType::F32 => f32s.call(&comms, &streams, offset, len, slot, algo, verify),
            DType::F16 => f16s.call(&comms, &streams, offset, len, slot, algo, verify),
            DType::BF16 => bf16s.call(&comms, &streams, offset, len, slot, algo, verify),
        }
    }
    for (c, s) in comms.iter().zip(&streams) {
        c.synchronize(s).unwrap();
    }
    eprintln!(
        "soak: {CALLS} calls × {world} ranks in {:?}, {verified} verified",
        started.elapsed()
    );
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn create_and_drop_200_times_leaks_no_memory_or_descriptors(ctx: Arc<CudaContext>) {
    let stream = ctx.new_stream().unwrap();
    let input = stream.clone_htod(&vec![1.5f32; 100_000]).unwrap();
    let mut output = stream.alloc_zeros::<f32>(100_000).unwrap();
    let config = Config {
        capacity_bytes: 16 << 20,
        ..Config::default()
    };
    // Warm up lazily created driver state before taking the baseline.
    drop(Communicator::local_group(&[ctx.clone(), ctx.clone()], config.clone()).unwrap());
    ctx.synchronize().unwrap();
    let (free_before, _) = ctx.mem_get_info().unwrap();
    let fds_before = open_fds();
    for i in 0..200 {
        let comms = Communicator::local_group(std::slice::from_ref(&ctx), config.clone()).unwrap();
        comms[0].all_reduce(&input, &mut output, &stream).unwrap();
        comms[0].synchronize(&stream).unwrap();
        if i % 50 == 0 {
            assert!(stream.clone_dtoh(&output).unwrap().iter().all(|&x| x == 1.5));
        }
        drop(comms);
        let pair = Communicator::local_group(&[ctx.clone(), ctx.clone()], config.clone()).unwrap();
        drop(pair);
    }
    ctx.synchronize().unwrap();
    let (free_after, _) = ctx.mem_get_info().unwrap();
    let fds_after = open_fds();
    // Each group maps 3 × 16 MiB per rank: 200 leaked groups would be gigabytes.
    let lost = free_before.saturating_sub(free_after);
    assert!(
        lost <= 4 << 20,
        "device memory fell by {lost} bytes over 400 groups"
    );
    assert_eq!(fds_after, fds_before, "file descriptors leaked");
}

fn a_dropped_peer_is_a_timeout_not_a_hang(ctx: Arc<CudaContext>) {
    let timeout = Duration::from_millis(300);
    let mut comms = Communicator::local_group(
        &[ctx.clone(), ctx.clone()],
        Config {
            capacity_bytes: 1 << 20,
            timeout,
            ..Config::default()
        },
    )
    .unwrap();
    drop(comms.pop());
    let stream = ctx.new_stream().unwrap();
    let input = stream.clone_htod(&vec![1.0f32; 4096]).unwrap();
    let mut output = stream.alloc_zeros::<f32>(4096).unwrap();
    let started = Instant::now();
    comms[0].all_reduce(&input, &mut output, &stream).unwrap();
    let err = comms[0].synchronize(&stream).unwrap_err();
    assert!(matches!(err, Error::PeerTimeout { peer: 1, .. }), "{err:?}");
    assert!(started.elapsed() < timeout * 20);
    assert!(matches!(
        comms[0].all_reduce(&input, &mut output, &stream),
        Err(Error::Poisoned { .. })
    ));
}

fn wrong_device_context_is_rejected(ctx: Arc<CudaContext>) {
    // Only meaningful with a second GPU; with one, check the rank's own device passes.
    let comms = Communicator::local_group(std::slice::from_ref(&ctx), Config::default()).unwrap();
    let count = CudaContext::device_count().unwrap_or(1) as usize;
    if count < 2 {
        assert_eq!(comms[0].device(), 0);
        common::skip(
            "wrong_device_context_is_rejected (second device)",
            "one GPU: covered by plan::validate_call unit tests",
        );
        return;
    }
    let other = symm_allreduce::context(1).unwrap();
    let s = other.new_stream().unwrap();
    let input = s.clone_htod(&[1.0f32; 64]).unwrap();
    let mut output = s.alloc_zeros::<f32>(64).unwrap();
    assert!(matches!(
        comms[0].all_reduce(&input, &mut output, &s),
        Err(Error::WrongDevice { .. })
    ));
}

fn main() -> std::process::ExitCode {
    common::harness::run(
        "reliability",
        vec![
            gpu_test!(soak_100k_calls_random_sizes_and_dtypes_sampled_verification),
            gpu_test!(create_and_drop_200_times_leaks_no_memory_or_descriptors),
            gpu_test!(a_dropped_peer_is_a_timeout_not_a_hang),
            gpu_test!(wrong_device_context_is_rejected),
        ],
    )
}
