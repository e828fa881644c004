"""symm_allreduce: symm-allreduce's single-node all-reduce kernels on torch tensors.

A thin typed layer over the Rust crate (no libtorch link): tensors go down as their
address, length, dtype, device and contiguity, the current CUDA stream as an integer; the
Rust side validates all of it and raises the exceptions of :mod:`symm_allreduce.errors`.

>>> import symm_allreduce as sar
>>> comm = sar.SymmAllReduce(cpu_group, device=torch.device("cuda", local_rank))  # doctest: +SKIP
>>> out = comm.custom_all_reduce(x)  # None: not taken, use NCCL  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util

from . import errors
from ._comm import (
    CONFIG_KEYS,
    GATHER_DTYPES,
    REDUCE_DTYPES,
    SymmAllReduce,
    kernels_available,
    local_group,
    lookup,
    validate_config,
)
from ._native import MAX_RANKS, __version__, device_count
from .errors import (
    DivergedError,
    InvalidCallError,
    PeerTimeoutError,
    SymmAllReduceError,
    UnavailableError,
)

if importlib.util.find_spec("torch") is not None:
    from . import ops  # noqa: F401  (registers torch.ops.symm_allreduce.*)

__all__ = [
    "CONFIG_KEYS",
    "GATHER_DTYPES",
    "MAX_RANKS",
    "REDUCE_DTYPES",
    "DivergedError",
    "InvalidCallError",
    "PeerTimeoutError",
    "SymmAllReduce",
    "SymmAllReduceError",
    "UnavailableError",
    "__version__",
    "device_count",
    "errors",
    "kernels_available",
    "local_group",
    "lookup",
    "validate_config",
]
