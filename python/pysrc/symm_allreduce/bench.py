"""``python -m symm_allreduce.bench``: all-reduce times from Python, in symm-bench's modes and
columns, on virtual ranks of one GPU (``--world`` ranks, one stream each).

Modes (as symm-bench's): ``eager`` (plain launches, batches of 10 back-to-back rounds per
timing sample), ``graph_amortised`` (one CUDA graph of 10 all-reduces per rank, time per
all-reduce), ``graph_isolated`` (one graph of 1 all-reduce per rank, each replay timed alone).
Device times are CUDA events on rank 0's stream around every rank's launches (the ranks'
kernels wait for each other, so rank 0's span is the collective's).

Host overhead, per eager call, in the same run: ``py_host_us`` is
``SymmAllReduce.all_reduce(x, out)`` (describing the tensors, the current stream, the
native call), ``native_host_us`` the native call alone with the descriptors made beforehand
(argument conversion, the package's checks of the stream and the memory, the crate's
``all_reduce``). symm-bench's ``host_us`` column is the crate's call from Rust.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import local_group
from ._tensor import describe

MODES = ("eager", "graph_amortised", "graph_isolated")
COLUMNS = (
    "dtype",
    "mode",
    "algo",
    "world",
    "size_bytes",
    "count",
    "time_us",
    "p10_us",
    "p90_us",
    "samples",
    "algbw_gbs",
    "busbw_gbs",
    "py_host_us",
    "native_host_us",
)


def _parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1
        for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
            if p.endswith(suffix):
                p, mult = p[:-1], m
        out.append(int(float(p) * mult))
    return out


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _time_rounds(
    torch: Any, streams: list[Any], launch: Any, rounds: int, samples: int, warmup: int
) -> list[float]:
    """Per-round device time (us) on rank 0's stream, one sample per `rounds` rounds."""
    for _ in range(warmup):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        for _ in range(rounds):
            launch()
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / rounds)
    torch.cuda.synchronize()
    return times


def _host_us(torch: Any, comms: list[Any], streams: list[Any], calls: list[Any], iters: int) -> float:
    """Median host time of one rank's call (rank 0's), every rank calling each round."""
    samples = []
    for _ in range(iters):
        for r, (s, call) in enumerate(zip(streams, calls)):
            with torch.cuda.stream(s):
                if r == 0:
                    t0 = time.perf_counter()
                    call()
                    samples.append((time.perf_counter() - t0) * 1e6)
                else:
                    call()
    torch.cuda.synchronize()
    return statistics.median(samples)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = _parse_sizes(args.sizes)
    capacity = max(sizes)
    comms = local_group(args.world, args.device, capacity_bytes=capacity, pool_bytes=0)
    streams = [torch.cuda.Stream(args.device) for _ in comms]
    rows = []
    try:
        for size in sizes:
            n = max(1, size // elem)
            bufs = [
                [torch.zeros(n, dtype=dtype, device=f"cuda:{args.device}") for _ in range(2)] for _ in comms
            ]
            torch.cuda.synchronize()

            def eager_round(bufs: list[list[Any]] = bufs) -> None:
                for c, s, (x, y) in zip(comms, streams, bufs):
                    with torch.cuda.stream(s):
                        c.all_reduce(x, y, algorithm=args.algo)

            py_calls = [
                (lambda c=c, b=b: c.all_reduce(b[0], b[1], algorithm=args.algo)) for c, b in zip(comms, bufs)
            ]
            native_calls = []
            for c, s, b in zip(comms, streams, bufs):
                d_in, d_out, handle = describe(b[0]), describe(b[1]), int(s.cuda_stream)
                native_calls.append(
                    lambda n=c._native, i=d_in, o=d_out, h=handle: n.all_reduce(i, o, h, args.algo)
                )
            py_host = _host_us(torch, comms, streams, py_calls, args.host_iters)
            native_host = _host_us(torch, comms, streams, native_calls, args.host_iters)
            for mode in args.modes:
                if mode == "eager":
                    times = _time_rounds(torch, streams, eager_round, 10, args.samples, args.warmup)
                else:
                    per_graph = 10 if mode == "graph_amortised" else 1
                    graphs = [torch.cuda.CUDAGraph() for _ in comms]
                    for c, s, g, (x, y) in zip(comms, streams, graphs, bufs):
                        with torch.cuda.graph(g, stream=s):
                            for i in range(per_graph):
                                a, b = (x, y) if i % 2 == 0 else (y, x)
                                c.all_reduce(a, b, algorithm=args.algo)

                    def replay(graphs: list[Any] = graphs) -> None:
                        for s, g in zip(streams, graphs):
                            with torch.cuda.stream(s):
                                g.replay()

                    times = [t / per_graph for t in _time_rounds(torch, streams, replay, 1, args.samples, 2)]
                for c, s in zip(comms, streams):
                    with torch.cuda.stream(s):
                        c.synchronize()
                t = statistics.median(times)
                algbw = n * elem / t / 1e3
                rows.append(
                    {
                        "dtype": args.dtype,
                        "mode": mode,
                        "algo": args.algo,
                        "world": args.world,
                        "size_bytes": n * elem,
                        "count": n,
                        "time_us": t,
                        "p10_us": _percentile(times, 0.1),
                        "p90_us": _percentile(times, 0.9),
                        "samples": len(times),
                        "algbw_gbs": algbw,
                        "busbw_gbs": algbw * 2 * (args.world - 1) / args.world,
                        "py_host_us": py_host,
                        "native_host_us": native_host,
                    }
                )
    finally:
        torch.cuda.synchronize()
        for c in comms:
            c.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (floats to 2 decimals)."""

    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    table = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m symm_allreduce.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8, help="virtual ranks on the device (default 8)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="bf16")
    p.add_argument("--algo", default="auto", help="auto, low_latency, one_shot, two_shot")
    p.add_argument("--sizes", default="8K,32K,128K,512K,2M,8M", help="message sizes in bytes (K, M suffixes)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--samples", type=int, default=50, help="timed samples per row and mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--host-iters", type=int, default=200, help="eager calls timed on the host per size")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: expected {', '.join(MODES)}")
    rows = run(args)
    print(format_table(rows))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(",".join(COLUMNS) + "\n")
            for r in rows:
                f.write(",".join(str(r[c]) for c in COLUMNS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
