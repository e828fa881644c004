"""One rank of test_gpu.py's process-group tests: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
come from the environment; every rank uses device 0; the part to run is the first argument:

- ``eager``: eager all-reduces of every dtype and odd sizes, and a captured graph replayed on
  changing inputs;
- ``compile``: ``torch.compile`` (aot_eager, and inductor with dynamic shapes) of a function
  chaining all four ``torch.ops.symm_allreduce`` ops, bit-identical to the same function run
  eagerly, its all-reduce equal to the fp32 rank-order emulation;
- ``compile-graphs``: ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graphs) of a
  function calling the all-reduce op, replayed on changing inputs.

Prints ``RANK r/W OK <part>: ...`` on success, ``RANK r/W FAILED: ...`` otherwise."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import symm_allreduce as sar

HIDDEN = 4096


def emulate(xs):
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def rank_inputs(world, n, dtype, seed):
    """Every rank's input (each rank makes all of them, to compute the expected sums)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed + q)).to(dtype) for q in range(world)]


def part_eager(rank, world, comm):
    cases = [
        (torch.float32, 3),
        (torch.float16, 1000),
        (torch.bfloat16, 4099),
        (torch.bfloat16, 300_001),
        (torch.float32, 1_000_000),
    ]
    for i, (dtype, n) in enumerate(cases):
        xs = rank_inputs(world, n, dtype, 97 * i)
        out = comm.custom_all_reduce(xs[rank].cuda())
        assert out is not None, comm.should_custom_ar(xs[rank].cuda())
        comm.synchronize()
        if not torch.equal(out.cpu(), emulate(xs)):
            return False, f"{dtype} x {n} differs from the fp32 rank-order emulation"
    # A captured call, replayed on new inputs.
    static = torch.zeros(8192, dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        out = comm.all_reduce(static)
    for it in range(3):
        xs = rank_inputs(world, 8192, torch.bfloat16, 1000 + 10 * it)
        static.copy_(xs[rank].cuda())
        graph.replay()
        comm.synchronize()
        torch.cuda.synchronize()
        if not torch.equal(out.cpu(), emulate(xs)):
            return False, f"graph replay {it} differs"
    return (
        True,
        f"{len(cases)} eager all-reduces and 3 graph replays, bit-identical to the fp32 rank-order emulation",
    )


def chain(x, residual, weight, world: int, handle: int):
    """The four ops, each one's input the previous one's output (so no compiler can reorder
    the collectives, which every rank must make in the same order)."""
    ops = torch.ops.symm_allreduce
    y = ops.all_reduce(x * 2, handle) + 1
    part = ops.reduce_scatter(y, world, handle)  # this rank's rows of Σ y
    full = ops.all_gather(part, world, handle).view(y.shape)  # Σ y, every row
    normed = ops.fused_add_rmsnorm(full, residual, weight, 1e-6, handle)
    return y, part, full, normed


def part_compile(rank, world, comm):
    weight = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    runs = [("aot_eager", False, (4 * world,)), ("inductor", True, (4 * world, 12 * world, 20 * world))]
    for backend, dynamic, token_counts in runs:
        compiled = torch.compile(chain, backend=backend, fullgraph=True, dynamic=dynamic)
        for tokens in token_counts:
            seed = 2000 + tokens
            xs = [x.view(tokens, HIDDEN) for x in rank_inputs(world, tokens * HIDDEN, torch.bfloat16, seed)]
            residual0 = (
                rank_inputs(1, tokens * HIDDEN, torch.bfloat16, seed + 500)[0].view(tokens, HIDDEN).cuda()
            )
            x = xs[rank].cuda()
            res_eager, res_compiled = residual0.clone(), residual0.clone()
            eager = chain(x, res_eager, weight, world, comm.handle)
            got = compiled(x, res_compiled, weight, world, comm.handle)
            comm.synchronize()
            torch.cuda.synchronize()
            if not torch.equal(eager[0].cpu(), emulate([2 * x for x in xs]) + 1):
                return False, f"{backend}: the eager all-reduce of {tokens} tokens differs from the emulation"
            names = ("all_reduce", "reduce_scatter", "all_gather", "fused_add_rmsnorm")
            for name, e, g in zip(names, eager, got):
                if not torch.equal(e.cpu(), g.cpu()):
                    return (
                        False,
                        f"torch.compile ({backend}, {tokens} tokens): {name} differs from the eager call",
                    )
            if not torch.equal(res_eager.cpu(), res_compiled.cpu()):
                return (
                    False,
                    f"torch.compile ({backend}, {tokens} tokens): the residual differs from the eager call",
                )
    return (
        True,
        "torch.compile (aot_eager; inductor, dynamic shapes) of the four chained ops, bit-identical to eager",
    )


def part_compile_graphs(rank, world, comm):
    def f(x, handle: int):
        return torch.ops.symm_allreduce.all_reduce(x * 2, handle) + 1

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    static = torch.empty(4099, device="cuda")
    replays = 5  # the first calls warm up and record, the rest replay the CUDA graph
    for it in range(replays):
        xs = rank_inputs(world, 4099, torch.float32, 3000 + 10 * it)
        static.copy_(xs[rank].cuda())
        out = compiled(static, comm.handle)
        comm.synchronize()
        torch.cuda.synchronize()
        if not torch.equal(out.cpu(), emulate([2 * x for x in xs]) + 1):
            return False, f"torch.compile (reduce-overhead), call {it}, differs from the emulation"
    return (
        True,
        f"torch.compile (reduce-overhead, CUDA graphs): {replays} calls on changing inputs, bit-identical",
    )


PARTS = {"eager": part_eager, "compile": part_compile, "compile-graphs": part_compile_graphs}


def main() -> int:
    part = sys.argv[1] if len(sys.argv) > 1 else "eager"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    # A rank's first compiled call compiles while the peers' kernels may already wait for it:
    # the timeout covers a compile.
    comm = sar.SymmAllReduce(dist.group.WORLD, torch.device("cuda", 0), 4 << 20, timeout=120.0)
    if comm.disabled:
        print(f"RANK {rank}/{world} disabled: {comm.reason}")
        return 2
    ok, message = PARTS[part](rank, world, comm)
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank}/{world} {'OK ' + part if ok else 'FAILED'}: {message}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
