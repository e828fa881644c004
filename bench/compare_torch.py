"""Side-by-side all-reduce latency of PyTorch symmetric memory and NCCL, timed the way
symm-bench times symm-allreduce, so one multi-GPU run gives one comparable table.

    torchrun --nproc-per-node=8 bench/compare_torch.py --dtype bf16,f32 --out bench-out/torch

Rows (per dtype, size, mode):
  nccl             torch.distributed.all_reduce (ncclAllReduce)
  nccl_symm        NCCL symmetric-window all-reduce, where this torch/NCCL offers it (a
                   separate run with --nccl-symm: the backend is chosen once per process)
  torch_one_shot   torch.ops.symm_mem.one_shot_all_reduce (out of place, symmetric input)
  torch_two_shot   torch.ops.symm_mem.two_shot_all_reduce_ (in place)
Modes: eager (batches of back-to-back ops), graph_amortised (10 ops captured in one graph,
time per op), graph_isolated (one op per graph replay, median of >= 200 replays).
Times are rank 0's CUDA-event medians after a barrier; algbw = S/t, busbw = algbw*2(W-1)/W.

NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0): on this
project's machines creating a multicast object can take the host's GPUs down.
"""
import argparse
import csv
import json
import os
import statistics

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = value

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SWEEP = [1 << k for k in range(10, 29)]  # 1 KiB .. 256 MiB


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def timed(fn, rounds, batch):
    """Median, p10, p90 of per-call microseconds: `rounds` samples of `batch` calls each."""
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / batch)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))]  # noqa: E731
    return statistics.median(samples), pick(0.1), pick(0.9)


def graph_of(fn, ops):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    return graph


def measure(fn, mode, iters):
    if mode == "eager":
        return timed(fn, max(iters // 4, 10), 20)
    if mode == "graph_amortised":
        g = graph_of(fn, 10)
        med, p10, p90 = timed(g.replay, max(iters // 4, 10), 1)
        return med / 10, p10 / 10, p90 / 10
    g = graph_of(fn, 1)
    return timed(g.replay, iters, 1)


def candidates(tensor, group, symm):
    """(name, callable) for every implementation this installation offers."""
    out = [("nccl", lambda: dist.all_reduce(tensor, group=group))]
    if symm is not None:
        buf, name = symm
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce"):
            out.append(("torch_one_shot", lambda: ops.one_shot_all_reduce(buf, "sum", name)))
        if hasattr(ops, "two_shot_all_reduce_"):
            out.append(("torch_two_shot", lambda: ops.two_shot_all_reduce_(buf, "sum", name)))
    return out


def symmetric_buffer(numel, dtype, group):
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(numel, dtype=dtype, device="cuda")
        handle = symm_mem.rendezvous(buf, group)
        if handle is None:
            return None, "rendezvous returned None"
        return (buf, group.group_name), None
    except Exception as e:  # an installation without symmetric memory
        return None, f"{type(e).__name__}: {e}"


def nccl_symmetric(numel, dtype, group):
    """NCCL symmetric windows: an all-reduce on a buffer from torch's NCCL symmetric-memory
    backend (selected once, at start, with --nccl-symm)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(numel, dtype=dtype, device="cuda")
        symm_mem.rendezvous(buf, group)
        return (lambda: dist.all_reduce(buf, group=group)), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="sweep")
    p.add_argument("--dtype", default="bf16,f32")
    p.add_argument("--modes", default="eager,graph_amortised,graph_isolated")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default="bench-out/torch")
    p.add_argument("--nccl-symm", action="store_true",
                   help="time only NCCL symmetric windows (torch's symmetric-memory backend can be "
                        "chosen once per process, so this is a separate run)")
    args = p.parse_args()
    if args.nccl_symm:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend("NCCL")

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    sizes = SWEEP if args.sizes == "sweep" else [parse_size(s) for s in args.sizes.split(",")]
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
    rows, notes = [], []
    for dname in args.dtype.split(","):
        dtype = dtypes[dname]
        for size in sizes:
            numel = size // torch.tensor([], dtype=dtype).element_size()
            tensor = torch.randn(numel, dtype=dtype, device="cuda")
            if args.nccl_symm:
                fn, why = nccl_symmetric(numel, dtype, group)
                impls = [("nccl_symm", fn)] if fn is not None else []
                if fn is None and rank == 0:
                    notes.append(f"nccl_symm unavailable: {why}")
            else:
                symm, why = symmetric_buffer(numel, dtype, group)
                if symm is None and rank == 0:
                    notes.append(f"torch symmetric memory unavailable at {size} B: {why}")
                impls = candidates(tensor, group, symm)
            for name, fn in impls:
                for mode in args.modes.split(","):
                    try:
                        med, p10, p90 = measure(fn, mode, args.iters)
                    except Exception as e:
                        if rank == 0:
                            notes.append(f"{name} {mode} {size} B failed: {type(e).__name__}: {e}")
                        continue
                    algbw = size / med / 1e3 if med else 0.0
                    rows.append({"dtype": dname, "mode": mode, "algo": name, "world": world,
                                 "size_bytes": size, "time_us": med, "p10_us": p10, "p90_us": p90,
                                 "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world})
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "torch_results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["algo"])
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(args.out, "torch_results.json"), "w") as f:
            json.dump({"world": world, "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                       "rows": rows, "notes": sorted(set(notes))}, f, indent=1)
        print(f"# torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, world {world}")
        print(f"# {'dtype':>5} {'mode':<16} {'algo':<15} {'size':>10} {'time_us':>9} {'p10':>8} "
              f"{'p90':>8} {'algbw':>8} {'busbw':>8}")
        for r in rows:
            print(f"  {r['dtype']:>5} {r['mode']:<16} {r['algo']:<15} {r['size_bytes']:>10} "
                  f"{r['time_us']:9.2f} {r['p10_us']:8.2f} {r['p90_us']:8.2f} {r['algbw_gbs']:8.2f} "
                  f"{r['busbw_gbs']:8.2f}")
        for n in sorted(set(notes)):
            print("# note:", n)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
