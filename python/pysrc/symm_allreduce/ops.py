"""``torch.ops.symm_allreduce.*``: the collectives as torch.library custom ops with fake
(meta) implementations, so that ``torch.compile`` traces through them and
``torch.cuda.graph`` captures them on the current stream.

Each op takes the communicator's ``handle`` (:attr:`SymmAllReduce.handle`, an int) as its
last argument. Importing :mod:`symm_allreduce` registers them when torch is installed.
"""

# No `from __future__ import annotations`: torch.library reads the annotations as types.

import torch

from ._comm import lookup


@torch.library.custom_op("symm_allreduce::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    """The sum of ``x`` over the ranks of communicator ``handle``, in a new tensor."""
    return lookup(handle).all_reduce(x)


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("symm_allreduce::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    """Every rank's ``x`` stacked rank-major: ``(world, *x.shape)``."""
    return lookup(handle).all_gather(x)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    return x.new_empty((world, *x.shape))


@torch.library.custom_op("symm_allreduce::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    """This rank's part of the sum, ``x`` split along dim 0 into ``world`` parts."""
    return lookup(handle).reduce_scatter(x)


@reduce_scatter.register_fake
def _reduce_scatter_fake(x: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    if x.dim() > 0 and x.shape[0] % world == 0:
        return x.new_empty((x.shape[0] // world, *x.shape[1:]))
    return x.new_empty((x.numel() // world,))


@torch.library.custom_op("symm_allreduce::fused_add_rmsnorm", mutates_args=("residual",))
def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int
) -> torch.Tensor:
    """``residual += Σ_ranks x`` (in place); returns ``RMSNorm(residual) · weight``."""
    return lookup(handle).fused_add_rmsnorm(x, residual, weight, eps)


@fused_add_rmsnorm.register_fake
def _fused_add_rmsnorm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


__all__ = ["all_gather", "all_reduce", "fused_add_rmsnorm", "reduce_scatter"]
