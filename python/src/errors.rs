//! The crate's [`Error`] as Python exceptions: one base class and a subclass per kind that a
//! caller handles differently, defined in `symm_allreduce/errors.py`, each with the crate's
//! message and the variant's name as `kind`.

use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use symm_allreduce::{BarrierPhase, Error};

/// The exception class (in `symm_allreduce.errors`) a crate error maps to.
pub(crate) fn class_of(e: &Error) -> &'static str {
    match e {
        Error::PeerTimeout { .. } => "PeerTimeoutError",
        Error::Diverged { .. } | Error::PoolMismatch { .. } | Error::CountsMismatch { .. } => "DivergedError",
        // A poisoned communicator is handled like the failure that poisoned it.
        Error::Poisoned { cause } => match class_of(cause) {
            c @ ("PeerTimeoutError" | "DivergedError") => c,
            _ => "SymmAllReduceError",
        },
        Error::Empty
        | Error::LengthMismatch { .. }
        | Error::InvalidShape { .. }
        | Error::ExceedsCapacity { .. }
        | Error::Misaligned { .. }
        | Error::WrongDevice { .. }
        | Error::InvalidCollective { .. }
        | Error::InvalidConfig(_)
        | Error::InvalidWorldSize { .. }
        | Error::ForeignPoolBuffer { .. }
        | Error::PoolExhausted { .. }
        | Error::InvalidTuning { .. }
        | Error::TuningMismatch { .. }
        | Error::MissingSecret { .. } => "InvalidCallError",
        Error::DriverUnavailable { .. }
        | Error::NoDevice
        | Error::DeviceNotFound { .. }
        | Error::KernelsUnavailable
        | Error::Unsupported { .. }
        | Error::NcclUnavailable { .. }
        | Error::MulticastUnavailable { .. } => "UnavailableError",
        _ => "SymmAllReduceError",
    }
}

/// The variant's name (`PeerTimeout`), from its `Debug` form.
fn variant_name(e: &Error) -> String {
    let debug = format!("{e:?}");
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or_default()
        .to_string()
}

fn build(class: &str, kind: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let cls = py.import("symm_allreduce.errors")?.getattr(class)?;
            let exc = cls.call1((message.clone(),))?;
            exc.setattr("kind", kind)?;
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|e| PyRuntimeError::new_err(format!("{message} (symm_allreduce.errors: {e})")))
    })
}

/// A crate error as its Python exception.
pub(crate) fn raise(e: Error) -> PyErr {
    build(class_of(&e), &variant_name(&e), e.to_string())
}

/// An `InvalidCallError` of the package's own (a call the crate's typed API cannot even
/// express: a CPU tensor, a dtype without a Rust type, an unknown keyword).
pub(crate) fn invalid_call(message: impl std::fmt::Display) -> PyErr {
    build("InvalidCallError", "InvalidCall", message.to_string())
}

/// A sample error of each kind, for the torch-free tests of the mapping.
pub(crate) fn example(kind: &str) -> PyResult<Error> {
    Ok(match kind {
        "PeerTimeout" => Error::PeerTimeout {
            rank: 0,
            peer: 1,
            phase: BarrierPhase::Start,
            timeout: Duration::from_secs(2),
        },
        "Poisoned" => Error::Poisoned {
            cause: Box::new(Error::PeerTimeout {
                rank: 1,
                peer: 0,
                phase: BarrierPhase::Arrival,
                timeout: Duration::from_secs(2),
            }),
        },
        "Diverged" => Error::Diverged {
            rank: 0,
            peer: 1,
            this_call: "one_shot of 1000 f32 elements".into(),
            peer_call: "one_shot of 1001 f32 elements".into(),
        },
        "CountsMismatch" => Error::CountsMismatch { rank: 0, peer: 1 },
        "LengthMismatch" => Error::LengthMismatch { input: 4, output: 5 },
        "Empty" => Error::Empty,
        "ExceedsCapacity" => Error::ExceedsCapacity {
            bytes: 10,
            capacity: 4,
        },
        "Misaligned" => Error::Misaligned {
            which: "input",
            address: 0x7f00_0000_0001,
        },
        "WrongDevice" => Error::WrongDevice {
            which: "input",
            expected: 0,
            found: 1,
        },
        "NoDevice" => Error::NoDevice,
        "KernelsUnavailable" => Error::KernelsUnavailable,
        "DriverUnavailable" => Error::DriverUnavailable {
            detail: "libcuda.so.1: cannot open shared object file".into(),
        },
        "KernelFault" => Error::KernelFault { code: 0xdead },
        "Bootstrap" => Error::Bootstrap {
            reason: "the group's all-gather failed".into(),
        },
        other => {
            return Err(crate::errors::invalid_call(format!(
                "no example of the error kind {other:?}"
            )))
        }
    })
}
