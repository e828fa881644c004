"""``python -m symm_allreduce.bench``: all-reduce times from Python, measured the way symm-bench
measures them, on virtual ranks of one GPU (``--world`` ranks, one stream each), so that the
two tables compare row by row.

Modes (symm-bench's): ``eager`` (plain launches; a sample is 10 back-to-back rounds),
``graph_amortised`` (one ``torch.cuda.CUDAGraph`` per rank holding a chain of 10
all-reduces of the same input into the same output; a sample is one replay of every rank's
graph; time per all-reduce), ``graph_isolated`` (one all-reduce per graph, each replay timed).
Rounds per row: eager 200, graph_amortised 50 replays, graph_isolated 200.

Timing (symm-bench's ``timing.rs``): a sample is a fork and a join over the ranks' streams:
rank 0's stream records the start event, every other stream waits on it, the rounds are
enqueued, every other stream records a done event that rank 0's stream waits on, and rank 0's
stream records the end event; its span is the collective's (the ranks' kernels wait for each
other). Up to 16 rounds' samples are enqueued behind a gate that holds rank 0's stream (a
spin kernel, ``torch.cuda._sleep``, sized from the enqueue time measured so far), so the GPU
runs them back to back and the events time the GPU, not Python's enqueue rate. A gate that
opened before the enqueue ended (its event already complete when the host was done) is
retried with a longer hold; the count of samples that still include host time is printed.

Host overhead per eager call, in the same run, each measured inside the gated eager rounds
(mean per call, as symm-bench's ``host_us``): ``py_host_us`` is
``SymmAllReduce.all_reduce(x, out)`` (reading and checking the tensors through torch, reading
the current stream, the native call); ``native_host_us`` is that native call alone
(``all_reduce_ptr``) with its integers and the stream handle made beforehand (argument
conversion, the stream's check when its handle is new, the crate's ``all_reduce``: what
symm-bench's ``host_us`` is from Rust, plus the conversion); ``rust_host_us`` is that call made
from Rust in this process (a whole round of them timed by ``_native.time_ptr_round`` as
symm-bench times its rounds: the crate's call without Python's, in the same process and
environment as the two before it); ``checked_host_us`` is the checked
native call of tensors that are not plain torch tensors (``all_reduce`` of two descriptors made
beforehand: their conversion, and the driver asked where each tensor's memory is).
``harness_us`` is the timing's own cost per call in those rounds: an empty call in the place
of ``all_reduce`` (the two clock reads around it and the call of a ``functools.partial``), which
the Python and native columns include and the Rust round, timed inside Rust, does not.
``py_minus_rust_us`` (median) and ``py_minus_rust_p90_us`` are Python's overhead over Rust
measured in pairs, the harness taken out: each timed round makes every rank's
``all_reduce(x, out)`` from Python and the same round from Rust back to back (alternating which
goes first), and the columns are the median and 90th percentile, over consecutive pairs of
rounds (one of each order, averaged: the side that runs second finds warm caches), of the
differences per call less ``harness_us``. The separate means above each include whatever
preemption their own rounds met; the pairs share it. The Rust round makes its eight calls back
to back, with the caches the first one warmed; ``py_minus_rust_interleaved_us`` pairs call by
call instead: each rank's Python call and the same call timed from Rust (``time_ptr_round`` of
that one rank) next to each other inside the round (which goes first alternates by round), so
both run between the same switches of torch's current stream (the median over consecutive
pairs of rounds, averaged as above, of the differences per call, less ``harness_us``).

``--host-only`` needs no GPU and no torch: the per-call host work that does not touch the
device (describing a duck-typed tensor, the native descriptor checks and argument
conversion, the hot path's argument checks), in microseconds per call.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _native, local_group
from ._comm import _algorithm_code
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
    "rust_host_us",
    "checked_host_us",
    "harness_us",
    "py_minus_rust_us",
    "py_minus_rust_p90_us",
    "py_minus_rust_interleaved_us",
)

#: All-reduces per graph in graph_amortised (symm-bench's default chain).
GRAPH_CHAIN = 10
#: Timed rounds per row (symm-bench's defaults) and warm-up rounds.
ROUNDS = {"eager": 200, "graph_amortised": 50, "graph_isolated": 200}
WARMUP = {"eager": 10, "graph_amortised": 2, "graph_isolated": 2}
#: Rounds between one pair of timing events.
ROUNDS_PER_SAMPLE = {"eager": 10, "graph_amortised": 1, "graph_isolated": 1}
#: Most rounds enqueued behind one closed gate (symm-bench's ROUNDS_PER_GATE).
ROUNDS_PER_GATE = 16
#: Attempts at a chunk whose gate opened before its enqueue ended.
GATE_RETRIES = 3

#: A round: enqueues one call per rank and returns the host seconds spent inside the calls.
Round = Callable[[], float]


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
    """Nearest-rank percentile (symm-bench's ``Stats``)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class _Gate:
    """Holds one stream with a spin kernel while the host enqueues behind it."""

    def __init__(self, torch: Any, stream: Any) -> None:
        if not hasattr(torch.cuda, "_sleep"):
            raise RuntimeError("this torch has no torch.cuda._sleep, which the benchmark's launch gate uses")
        self.torch, self.stream = torch, stream
        self.opened = torch.cuda.Event()
        self.late = 0  # samples kept although their gate opened early (they include host time)
        cycles = 1 << 22
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles // 8)  # warm-up
            start.record(stream)
            torch.cuda._sleep(cycles)
            end.record(stream)
        end.synchronize()
        self.cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1e-3)
        self.hold_us = 2000.0

    def close(self) -> None:
        with self.torch.cuda.stream(self.stream):
            self.torch.cuda._sleep(int(self.hold_us * self.cycles_per_us))
            self.opened.record(self.stream)

    def held_through(self, enqueue_us: float) -> bool:
        """Whether the gate was still closed when the enqueue (of ``enqueue_us``) ended; the
        next hold is sized from it either way."""
        held = not self.opened.query()
        self.hold_us = max(self.hold_us if held else 2 * self.hold_us, 2 * enqueue_us + 200.0)
        return held


class _Timer:
    """symm-bench's fork/join timing of rounds over W streams (rank 0's carries the events)."""

    def __init__(self, torch: Any, streams: list[Any]) -> None:
        self.torch, self.streams = torch, streams
        self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(ROUNDS_PER_GATE)]
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(ROUNDS_PER_GATE)]
        self.done = [torch.cuda.Event() for _ in streams[1:]]
        self.gate = _Gate(torch, streams[0])

    def time(self, samples: int, rounds_per_sample: int, round_: Round) -> tuple[list[float], float]:
        """Per sample: GPU µs per round; and host µs inside the calls per round (mean)."""
        per_gate = min(max(ROUNDS_PER_GATE // max(rounds_per_sample, 1), 1), ROUNDS_PER_GATE)
        round_us: list[float] = []
        host = 0.0
        left = samples
        while left > 0:
            n = min(left, per_gate)
            for attempt in range(GATE_RETRIES):
                self.gate.close()
                t0 = time.perf_counter()
                chunk_host = self._enqueue(n, rounds_per_sample, round_)
                held = self.gate.held_through((time.perf_counter() - t0) * 1e6)
                self.ends[n - 1].synchronize()
                if held or attempt == GATE_RETRIES - 1:
                    break
            if not held:
                self.gate.late += n
            host += chunk_host
            round_us += [
                self.starts[i].elapsed_time(self.ends[i]) * 1e3 / rounds_per_sample for i in range(n)
            ]
            left -= n
        return round_us, host * 1e6 / max(samples * rounds_per_sample, 1)

    def _enqueue(self, samples: int, rounds_per_sample: int, round_: Round) -> float:
        s0 = self.streams[0]
        host = 0.0
        for i in range(samples):
            self.starts[i].record(s0)
            for s in self.streams[1:]:
                s.wait_event(self.starts[i])
            for _ in range(rounds_per_sample):
                host += round_()
            for s, done in zip(self.streams[1:], self.done):
                done.record(s)
                s0.wait_event(done)
            self.ends[i].record(s0)
        return host


def _eager_round(torch: Any, streams: list[Any], calls: Sequence[Callable[..., Any]]) -> Round:
    """One call per rank, each on its rank's stream; returns the host time inside the calls."""
    perf = time.perf_counter

    def round_() -> float:
        spent = 0.0
        for s, call in zip(streams, calls):
            with torch.cuda.stream(s):
                t0 = perf()
                call()
                spent += perf() - t0
        return spent

    return round_


def _measure(
    torch: Any,
    timer: _Timer,
    comms: list[Any],
    streams: list[Any],
    mode: str,
    calls: Sequence[Callable[..., Any]],
    round_: Round | None = None,
) -> tuple[list[float], float]:
    """Per-all-reduce GPU µs per sample in ``mode``, and host µs per call: of ``calls`` (a
    call per rank), or in eager mode of ``round_`` (the same calls as one round that times
    itself) where it is given."""
    per_sample = ROUNDS_PER_SAMPLE[mode]
    samples = -(-ROUNDS[mode] // per_sample)
    if mode == "eager":
        round_ = round_ or _eager_round(torch, streams, calls)
        timer.time(-(-WARMUP[mode] // per_sample), per_sample, round_)
        times, host = timer.time(samples, per_sample, round_)
        ops = 1
    else:
        ops = GRAPH_CHAIN if mode == "graph_amortised" else 1
        graphs = []
        for s, call in zip(streams, calls):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(ops):
                    call()
            graphs.append(g)

        def replay() -> float:
            spent = 0.0
            for s, g in zip(streams, graphs):
                with torch.cuda.stream(s):
                    t0 = time.perf_counter()
                    g.replay()
                    spent += time.perf_counter() - t0
            return spent

        timer.time(WARMUP[mode], 1, replay)
        times, host = timer.time(samples, 1, replay)
    torch.cuda.synchronize()
    for c, s in zip(comms, streams):
        with torch.cuda.stream(s):
            c.synchronize()  # raises what a rank's call hit
    return [t / ops for t in times], host / len(streams)


def _noop(*_: Any) -> None:
    """The empty call the harness is timed with."""


def _harness_us(torch: Any, timer: _Timer, comms: list[Any], streams: list[Any]) -> float:
    """Host µs per call of the eager rounds' own timing: an empty call (a ``functools.partial``
    of two arguments, as the timed calls are) in the place of each rank's call."""
    calls = [functools.partial(_noop, None, None) for _ in streams]
    return _measure(torch, timer, comms, streams, "eager", calls)[1]


def _timed_differences(
    torch: Any, timer: _Timer, pair: Callable[[bool], tuple[float, float]], ranks: int
) -> list[float]:
    """Runs ``pair`` for the eager warm-up and then the timed rounds, Python first in even
    rounds and Rust first in odd ones (``pair(python_first)`` makes one round and returns the
    host seconds of its Python side and of its Rust side); returns the timed rounds'
    differences in µs per call, averaged over consecutive pairs of rounds (one of each order:
    :func:`_order_balanced`)."""
    diffs: list[float] = []

    def round_() -> float:
        py, rust = pair(len(diffs) % 2 == 0)
        diffs.append((py - rust) * 1e6 / ranks)
        return py + rust

    per_sample = ROUNDS_PER_SAMPLE["eager"]
    timer.time(-(-WARMUP["eager"] // per_sample), per_sample, round_)
    diffs.clear()  # the timed rounds only (a chunk the gate retried counts its rounds again)
    timer.time(-(-ROUNDS["eager"] // per_sample), per_sample, round_)
    torch.cuda.synchronize()
    return _order_balanced(diffs)


def _order_balanced(diffs: Sequence[float]) -> list[float]:
    """The means of rounds 2k and 2k + 1 (an odd last round dropped). Whichever side of a pair
    runs second finds the caches the first one warmed, so one order can read higher than the
    other; where the two orders' differences sit apart, a median over single rounds lands
    anywhere between them, a median over pairs does not."""
    return [(diffs[i] + diffs[i + 1]) / 2 for i in range(0, len(diffs) - 1, 2)]


def _paired_difference(
    torch: Any, timer: _Timer, streams: list[Any], calls: Sequence[Callable[..., Any]], rust_round: Round
) -> list[float]:
    """Python's host µs per call minus Rust's, paired round by round: every timed round runs
    the Python calls of every rank and the same calls from Rust back to back, so the two see
    the same machine state and a preempted round shows up as one outlier rather than as drift
    between two separate measurements."""
    py_round = _eager_round(torch, streams, calls)

    def pair(python_first: bool) -> tuple[float, float]:
        if python_first:
            py = py_round()
            return py, rust_round()
        rust = rust_round()
        return py_round(), rust

    return _timed_differences(torch, timer, pair, len(streams))


def _interleaved_difference(
    torch: Any,
    timer: _Timer,
    streams: list[Any],
    calls: Sequence[Callable[..., Any]],
    rust_calls: Sequence[Callable[[], float]],
) -> list[float]:
    """Python's host µs per call minus Rust's, paired call by call: in every timed round each
    rank makes its Python call and the same call from Rust (``rust_calls[r]``, a one-rank
    ``time_ptr_round``) next to each other on its stream, every rank in the round's order (so
    the ranks' calls still match)."""
    perf = time.perf_counter

    def timed(call: Callable[..., Any]) -> float:
        t0 = perf()
        call()
        return perf() - t0

    def pair(python_first: bool) -> tuple[float, float]:
        py = rust = 0.0
        for s, call, from_rust in zip(streams, calls, rust_calls):
            with torch.cuda.stream(s):
                if python_first:
                    py += timed(call)
                    rust += from_rust()
                else:
                    rust += from_rust()
                    py += timed(call)
        return py, rust

    return _timed_differences(torch, timer, pair, len(streams))


def _from_rust(
    comms: Sequence[Any],
    streams: Sequence[Any],
    bufs: Sequence[Sequence[Any]],
    ranks: Sequence[int],
    n: int,
    kind: int,
    algo: int,
) -> Callable[[], float]:
    """The all-reduce of ``ranks`` (``bufs[r]``: input, output) timed from Rust: one call
    enqueues them all and returns the host seconds they took (``_native.time_ptr_round``)."""
    return functools.partial(
        _native.time_ptr_round,
        [comms[r]._live() for r in ranks],
        [bufs[r][0].data_ptr() for r in ranks],
        [bufs[r][1].data_ptr() for r in ranks],
        n,
        kind,
        [int(streams[r].cuda_stream) for r in ranks],
        algo,
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = _parse_sizes(args.sizes)
    kind, algo = int(_native.dtype_code(str(dtype))), _algorithm_code(args.algo)
    # Every SM the ranks' blocks can use, as symm-bench --virtual: the virtual ranks stand in
    # for a GPU per rank, and nothing but the collectives runs (Config::shared_sm_percent).
    comms = local_group(
        args.world, args.device, capacity_bytes=max(sizes), pool_bytes=0, shared_sm_percent=100
    )
    streams = [torch.cuda.Stream(args.device) for _ in comms]
    timer = _Timer(torch, streams)
    rows = []
    try:
        harness = _harness_us(torch, timer, comms, streams)
        for size in sizes:
            n = max(1, size // elem)
            bufs = [
                [torch.zeros(n, dtype=dtype, device=f"cuda:{args.device}") for _ in range(2)] for _ in comms
            ]
            torch.cuda.synchronize()
            # The same input into the same output on every call (symm-bench's buffers), called
            # as a stack calls it (no keyword for the default algorithm).
            py_calls = [
                functools.partial(c.all_reduce, x, y)
                if args.algo == "auto"
                else functools.partial(c.all_reduce, x, y, algorithm=args.algo)
                for c, (x, y) in zip(comms, bufs)
            ]
            native_calls = []
            checked_calls = []
            for c, s, (x, y) in zip(comms, streams, bufs):
                d_in, d_out, handle = describe(x), describe(y), int(s.cuda_stream)
                # The integers the hot path passes (d_in[0], d_out[0]: the tensors' addresses).
                native_calls.append(
                    functools.partial(c._live().all_reduce_ptr, d_in[0], n, d_out[0], n, kind, handle, algo)
                )
                checked_calls.append(
                    lambda n=c._native, i=d_in, o=d_out, h=handle: n.all_reduce(i, o, h, args.algo)
                )
            # The same calls as native_calls, timed from Rust: every rank's in one round, and
            # one rank's at a time for the call-by-call pairing.
            rust_round = _from_rust(comms, streams, bufs, range(len(comms)), n, kind, algo)
            _, py_host = _measure(torch, timer, comms, streams, "eager", py_calls)
            _, native_host = _measure(torch, timer, comms, streams, "eager", native_calls)
            _, rust_host = _measure(torch, timer, comms, streams, "eager", native_calls, rust_round)
            _, checked_host = _measure(torch, timer, comms, streams, "eager", checked_calls)
            paired = _paired_difference(torch, timer, streams, py_calls, rust_round)
            rust_calls = [_from_rust(comms, streams, bufs, [r], n, kind, algo) for r in range(len(comms))]
            interleaved = _interleaved_difference(torch, timer, streams, py_calls, rust_calls)
            for mode in args.modes:
                times, _ = _measure(torch, timer, comms, streams, mode, py_calls)
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
                        "rust_host_us": rust_host,
                        "checked_host_us": checked_host,
                        "harness_us": harness,
                        "py_minus_rust_us": statistics.median(paired) - harness,
                        "py_minus_rust_p90_us": _percentile(paired, 0.9) - harness,
                        "py_minus_rust_interleaved_us": statistics.median(interleaved) - harness,
                    }
                )
    finally:
        torch.cuda.synchronize()
        for c in comms:
            c.close()
    if timer.gate.late:
        print(
            f"note: {timer.gate.late} samples were enqueued past their gate and include host time",
            file=sys.stderr,
        )
    return rows


class _DuckTensor:
    """A tensor's five accessors (what ``describe`` reads), for the host-only timing."""

    def __init__(self, ptr: int, numel: int, dtype: str) -> None:
        self._ptr, self._numel, self.dtype = ptr, numel, dtype
        self.device = _DuckDevice()

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._numel

    def is_contiguous(self) -> bool:
        return True


class _DuckDevice:
    type = "cuda"
    index = 0


def host_only(iters: int) -> list[tuple[str, float]]:
    """Per-call host µs of the steps of an eager call that need no device (median of 5
    batches of ``iters`` calls)."""
    x = _DuckTensor(0x7F00_0000_0000, 4096, "torch.bfloat16")
    y = _DuckTensor(0x7F00_0001_0000, 4096, "torch.bfloat16")
    dx = describe(x)
    check = _native.check_tensor
    ptr_check = _native.check_ptr_call
    bf16, auto = int(_native.dtype_code("bfloat16")), _algorithm_code("auto")
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("describe(tensor), duck-typed", lambda: describe(x)),
        ("native descriptor check + argument conversion, one tensor", lambda: check(dx, 0)),
        (
            "both tensors of an out-of-place call, described and checked",
            lambda: (check(describe(x), 0), check(describe(y), 0)),
        ),
        ("python call overhead (empty function)", lambda: None),
        (
            "hot path: native argument conversion and checks of an out-of-place call (integers)",
            lambda: ptr_check(0x7F00_0000_0000, 4096, 0x7F00_0001_0000, 4096, bf16, auto),
        ),
    ]
    out = []
    for name, fn in steps:
        batches = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            batches.append((time.perf_counter() - t0) * 1e6 / iters)
        out.append((name, statistics.median(batches)))
    return out


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
    p.add_argument("--host-only", action="store_true", help="only the host steps that need no GPU")
    p.add_argument("--host-iters", type=int, default=20000, help="calls per batch with --host-only")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: expected {', '.join(MODES)}")
    if args.host_only:
        for name, us in host_only(args.host_iters):
            print(f"{us:8.3f} us  {name}")
        return 0
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
