//! The README's example: two ranks in one process, out-of-place all-reduce, checked.
//!
//!     cargo run --release --example quickstart

use symm_allreduce::{Algorithm, Communicator, Config, DType};

fn main() -> std::process::ExitCode {
    // A typed error, never a panic, when there is no driver or GPU; printed in its human
    // (Display) form, which says what to do.
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
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
    Ok(())
}
