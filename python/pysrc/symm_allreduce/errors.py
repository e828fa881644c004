"""Exceptions of :mod:`symm_allreduce`.

Every error of the Rust crate becomes one of these, carrying the crate's own message (which
says what to do) and the crate's variant name as ``kind`` (``"PeerTimeout"``,
``"LengthMismatch"``, ...). Catch :class:`SymmAllReduceError` for all of them, or the
subclass for the case a caller handles differently.
"""

from __future__ import annotations


class SymmAllReduceError(Exception):
    """Base class of every symm_allreduce error (a failed CUDA call, a failed setup, ...)."""

    #: The crate's error variant (``"PeerTimeout"``, ``"Cuda"``, ...), or ``"InvalidCall"`` for
    #: an argument the package refused before calling the crate.
    kind: str = "Unknown"


class PeerTimeoutError(SymmAllReduceError, TimeoutError):
    """A peer did not arrive within ``Config.timeout``: the communicator is poisoned (create a
    new one). Also raised by every later call on it (``kind == "Poisoned"``)."""


class DivergedError(SymmAllReduceError):
    """Ranks made different calls (another length, dtype, collective or pool buffer), or
    all-gather counts that differ across ranks."""


class InvalidCallError(SymmAllReduceError, ValueError):
    """Bad arguments or configuration: a CPU tensor, another device, not contiguous, an
    unsupported dtype, misaligned, lengths that do not match, over the capacity, an
    unknown or out-of-range config keyword. Nothing was launched; the communicator stays
    usable."""


class UnavailableError(SymmAllReduceError, RuntimeError):
    """What the call needs is not here: no driver, no device, kernels not built, an
    unsupported device, no NCCL fallback, no multicast."""


__all__ = [
    "DivergedError",
    "InvalidCallError",
    "PeerTimeoutError",
    "SymmAllReduceError",
    "UnavailableError",
]
