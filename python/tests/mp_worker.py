"""One rank of test_gpu.py's process-group test: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
come from the environment; every rank uses device 0. Prints `RANK r/W OK ...` on success."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import symm_allreduce as sar


def emulate(xs):
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    comm = sar.SymmAllReduce(dist.group.WORLD, torch.device("cuda", 0), 4 << 20, timeout=60.0)
    if comm.disabled:
        print(f"RANK {rank}/{world} disabled: {comm.reason}")
        return 2
    cases = [
        (torch.float32, 3),
        (torch.float16, 1000),
        (torch.bfloat16, 4099),
        (torch.bfloat16, 300_001),
        (torch.float32, 1_000_000),
    ]
    for i, (dtype, n) in enumerate(cases):
        xs = [
            torch.randn(n, generator=torch.Generator().manual_seed(97 * i + q)).to(dtype)
            for q in range(world)
        ]
        out = comm.custom_all_reduce(xs[rank].cuda())
        assert out is not None, comm.should_custom_ar(xs[rank].cuda())
        comm.synchronize()
        if not torch.equal(out.cpu(), emulate(xs)):
            print(f"RANK {rank}/{world} FAILED: {dtype} x {n} differs from the fp32 rank-order emulation")
            return 1
    # A captured call, replayed on new inputs.
    static = torch.zeros(8192, dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        out = comm.all_reduce(static)
    for it in range(3):
        xs = [
            torch.randn(8192, generator=torch.Generator().manual_seed(1000 + 10 * it + q)).to(torch.bfloat16)
            for q in range(world)
        ]
        static.copy_(xs[rank].cuda())
        graph.replay()
        comm.synchronize()
        torch.cuda.synchronize()
        if not torch.equal(out.cpu(), emulate(xs)):
            print(f"RANK {rank}/{world} FAILED: graph replay {it} differs")
            return 1

    # torch.compile of a function calling the custom op (each process compiles its own; the
    # handle is the same constant on every rank).
    def f(x: torch.Tensor, handle: int) -> torch.Tensor:
        return torch.ops.symm_allreduce.all_reduce(x * 2, handle) + 1

    for backend in ("aot_eager", "inductor"):
        cf = torch.compile(f, backend=backend, fullgraph=True)
        xs = [torch.randn(4099, generator=torch.Generator().manual_seed(2000 + q)) for q in range(world)]
        out = cf(xs[rank].cuda(), comm.handle)
        comm.synchronize()
        if not torch.equal(out.cpu(), emulate([x * 2 for x in xs]) + 1):
            print(f"RANK {rank}/{world} FAILED: torch.compile ({backend}) differs")
            return 1
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    print(
        f"RANK {rank}/{world} OK: {len(cases)} eager all-reduces and 3 graph replays over {world} processes, "
        "bit-identical to the fp32 rank-order emulation"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
