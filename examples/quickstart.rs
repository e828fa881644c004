//! The README's example: two ranks in one process, out-of-place all-reduce, checked; then
//! the same call and the fused all-reduce + residual + RMSNorm captured in a CUDA graph and
//! replayed, with cudarc's defaults (event tracking on, nothing switched off).
//!
//!     cargo run --release --example quickstart

use symm_allreduce::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use symm_allreduce::{Algorithm, Communicator, Config, DType};

fn main() -> std::process::ExitCode {
    // A typed error, never a panic, when there is no driver or GPU; printed in its human
    // (Display) form, which says what to do.
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            // No driver or no GPU: 2, as symm-bench; any other failure: 1.
            let no_gpu = e
                .downcast_ref::<symm_allreduce::Error>()
                .is_some_and(|e| e.is_no_gpu());
            std::process::ExitCode::from(if no_gpu { 2 } else { 1 })
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = symm_allreduce::context(0)?;
    // Two ranks in one process ("virtual ranks" on one GPU; one context per GPU on more).
    let comms = Communicator::local_group(&[ctx.clone(), ctx.clone()], Config::default())?;
    let s = [ctx.new_stream()?, ctx.new_stream()?];
    let x = [
        s[0].clone_htod(&[1.0f32; 4099])?,
        s[1].clone_htod(&[2.0f32; 4099])?,
    ];
    let mut y = [s[0].alloc_zeros::<f32>(4099)?, s[1].alloc_zeros::<f32>(4099)?];
    for r in 0..2 {
        // Out of place, any length, f32 / half::f16 / half::bf16; capturable in a CUDA graph.
        comms[r].all_reduce(&x[r], &mut y[r], &s[r])?;
    }
    for r in 0..2 {
        comms[r].synchronize(&s[r])?; // also surfaces a peer timeout
        assert!(s[r].clone_dtoh(&y[r])?.iter().all(|&v| v == 3.0));
        println!("{}", comms[r].path(4099, DType::F32, Algorithm::Auto)?);
    }

    // In a CUDA graph, cudarc's defaults left as they are: the all-reduce, then the fused
    // all-reduce + residual add + RMSNorm of a [2, 1024] activation (residual updated in place).
    let (hidden, tokens) = (1024, 2);
    let mut residual = [
        s[0].clone_htod(&vec![1.0f32; tokens * hidden])?,
        s[1].clone_htod(&vec![1.0f32; tokens * hidden])?,
    ];
    let weight = [
        s[0].clone_htod(&vec![0.5f32; hidden])?,
        s[1].clone_htod(&vec![0.5f32; hidden])?,
    ];
    let part = [x[0].slice(0..tokens * hidden), x[1].slice(0..tokens * hidden)];
    let mut normed = [
        s[0].alloc_zeros::<f32>(tokens * hidden)?,
        s[1].alloc_zeros::<f32>(tokens * hidden)?,
    ];
    let mut graphs = Vec::new();
    for r in 0..2 {
        s[r].begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        comms[r].all_reduce(&x[r], &mut y[r], &s[r])?;
        comms[r].all_reduce_add_rmsnorm(
            &part[r],
            &mut residual[r],
            &weight[r],
            1e-6,
            &mut normed[r],
            &s[r],
        )?;
        graphs.push(
            s[r].end_capture(CUgraphInstantiate_flags(0))?
                .ok_or("empty graph")?,
        );
    }
    for _replay in 0..3 {
        for g in &graphs {
            g.launch()?;
        }
    }
    for r in 0..2 {
        comms[r].synchronize(&s[r])?;
        // residual = 1 + 3 per replay = 10; each row is constant, so RMSNorm gives 1, times 0.5.
        assert!(s[r].clone_dtoh(&residual[r])?.iter().all(|&v| v == 10.0));
        assert!(s[r]
            .clone_dtoh(&normed[r])?
            .iter()
            .all(|&v| (v - 0.5).abs() < 1e-6));
    }
    println!(
        "graph replayed 3 times, event tracking {}: {}",
        if ctx.is_event_tracking() { "on" } else { "off" },
        comms[0].add_rmsnorm_path(tokens, hidden, DType::F32, Algorithm::Auto)?
    );
    Ok(())
}
