"""GPU tests on virtual ranks (one process, one GPU) and on processes over a gloo group.

Every result is checked bit for bit against an fp32 rank-order emulation computed by torch
on the host (what the crate's kernels compute: fp32 accumulation in absolute rank order,
rounded once to the dtype, so the Rust crate gives these same bits for the same inputs) and
against an f64 reference within the rounding bound.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import symm_allreduce as sar

try:
    import torch
except ImportError:  # the fixture `gpu` skips (or fails under REQUIRE_GPU=1)
    torch = None

pytestmark = pytest.mark.usefixtures("gpu")

HERE = Path(__file__).parent


def dtypes():
    return [torch.float32, torch.float16, torch.bfloat16]


def unit_roundoff(dtype):
    return {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]


def emulate(xs):
    """The crate's bits: fp32 sum in rank order, rounded once to the dtype (on the host)."""
    acc = xs[0].detach().cpu().float()
    for x in xs[1:]:
        acc = acc + x.detach().cpu().float()
    return acc.to(xs[0].dtype)


def assert_within_f64(out, xs):
    """|out - Σ x (f64)| ≤ 2·(u·|ref| + W·2⁻²⁴·Σ|x|) + 2⁻²⁴ (fp32 accumulation, one rounding)."""
    ref = sum(x.detach().cpu().double() for x in xs)
    mag = sum(x.detach().cpu().double().abs() for x in xs)
    bound = 2 * (unit_roundoff(xs[0].dtype) * ref.abs() + len(xs) * 2.0**-24 * mag) + 2.0**-24
    err = (out.detach().cpu().double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max())} over the bound"


def assert_bits(actual, expected):
    a, e = actual.detach().cpu(), expected.detach().cpu()
    assert a.dtype == e.dtype and a.shape == e.shape
    if not torch.equal(
        a.view(-1).view(torch.uint8 if a.element_size() == 1 else _int_of(a)),
        e.view(-1).view(torch.uint8 if e.element_size() == 1 else _int_of(e)),
    ):
        diff = (a.double() - e.double()).abs()
        raise AssertionError(f"bits differ at {int((a != e).sum())} elements, max diff {float(diff.max())}")


def _int_of(t):
    return {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def inputs(world, n, dtype, seed, offset=0):
    """Rank r's input: n elements (a view at element `offset` of a larger tensor)."""
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 131 + r)
        if dtype in (torch.uint8, torch.int8):
            lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
            full = torch.randint(lo, hi, (n + offset,), generator=g, dtype=dtype)
        else:
            full = torch.randn(n + offset, generator=g, dtype=torch.float32).to(dtype)
        xs.append(full.cuda()[offset:])
    return xs


class Group:
    """Virtual ranks with a stream each; `run` calls fn(rank, comm) on every rank's stream,
    then synchronizes every rank (raising what a rank's call hit)."""

    def __init__(self, world, **config):
        config.setdefault("capacity_bytes", 4 << 20)
        config.setdefault("pool_bytes", 2 << 20)
        self.world = world
        self.comms = sar.local_group(world, 0, **config)
        self.streams = [torch.cuda.Stream() for _ in range(world)]

    def launch(self, fn, ranks=None):
        torch.cuda.synchronize()
        out = {}
        for r in ranks if ranks is not None else range(self.world):
            with torch.cuda.stream(self.streams[r]):
                out[r] = fn(r, self.comms[r])
        return [out[r] for r in sorted(out)]

    def sync(self, ranks=None):
        for r in ranks if ranks is not None else range(self.world):
            with torch.cuda.stream(self.streams[r]):
                self.comms[r].synchronize()
        torch.cuda.synchronize()

    def run(self, fn):
        out = self.launch(fn)
        self.sync()
        return out

    def close(self):
        for c in self.comms:
            c.close()


_GROUPS: dict[int, Group] = {}


def group(world):
    if world not in _GROUPS:
        _GROUPS[world] = Group(world)
    return _GROUPS[world]


@pytest.fixture(scope="module", autouse=True)
def _close_groups():
    yield
    for g in _GROUPS.values():
        g.close()
    _GROUPS.clear()


# ---- all-reduce: worlds, dtypes, sizes, views -------------------------------------------------

SIZES = [1, 7, 8, 1000, 4099, 65_537, 393_217]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("view", [False, True])
def test_all_reduce_bits(world, dtype_name, n, view):
    dtype = getattr(torch, dtype_name)
    g = group(world)
    xs = inputs(world, n, dtype, seed=n + world, offset=3 if view else 0)
    if view:
        outs_full = [torch.full((n + 1,), 7.0, dtype=dtype, device="cuda") for _ in range(world)]
        outs = [o[1:] for o in outs_full]
        g.run(lambda r, c: c.all_reduce(xs[r], outs[r]))
        for o in outs_full:  # nothing written outside the view
            assert float(o[0]) == 7.0
    else:
        outs = g.run(lambda r, c: c.all_reduce(xs[r]))
    expected = emulate(xs)
    for r in range(world):
        assert outs[r].shape == xs[r].shape
        assert_bits(outs[r], expected)
    assert_within_f64(outs[0], xs)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("algorithm", ["auto", "low_latency", "one_shot", "two_shot"])
@pytest.mark.parametrize("n", [5, 1000, 8191])
def test_every_algorithm_gives_the_same_bits(world, algorithm, n):
    g = group(world)
    xs = inputs(world, n, torch.bfloat16, seed=7 * n)
    outs = g.run(lambda r, c: c.all_reduce(xs[r], algorithm=algorithm))
    expected = emulate(xs)
    for o in outs:
        assert_bits(o, expected)


def test_in_place_and_path():
    g = group(2)
    xs = inputs(2, 3000, torch.float16, seed=3)
    expected = emulate(xs)
    g.run(lambda r, c: c.all_reduce(xs[r], xs[r]))
    for x in xs:
        assert_bits(x, expected)
    text = g.comms[0].path(3000 * 2, torch.float16)
    assert "low" in text or "one" in text, text
    assert "peer kernels: on" in g.comms[0].describe()


# ---- other collectives ------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "uint8", "int8"])
def test_all_gather_and_all_gather_v(world, dtype_name):
    dtype = getattr(torch, dtype_name)
    g = group(world)
    xs = [x.view(-1, 3) for x in inputs(world, 3 * 37, dtype, seed=world)]
    outs = g.run(lambda r, c: c.all_gather(xs[r]))
    expected = torch.stack([x.cpu() for x in xs])
    for o in outs:
        assert_bits(o, expected)
    sizes = [1 + (5 * q) % 7 for q in range(world)]
    ys = [inputs(1, sizes[q] * 3, dtype, seed=100 + q)[0].view(-1, 3) for q in range(world)]
    outs = g.run(lambda r, c: c.all_gather_v(ys[r], sizes))
    expected = torch.cat([y.cpu() for y in ys])
    for o in outs:
        assert_bits(o, expected)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_reduce_scatter(world, dtype_name):
    dtype = getattr(torch, dtype_name)
    g = group(world)
    m = 129
    xs = [x.view(world * m, 2) for x in inputs(world, world * m * 2, dtype, seed=5)]
    outs = g.run(lambda r, c: c.reduce_scatter(xs[r]))
    full = emulate(xs)
    for r, o in enumerate(outs):
        assert_bits(o, full[r * m : (r + 1) * m])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_add_rmsnorm(world, tokens):
    g = group(world)
    hidden, eps, dtype = 4096, 1e-6, torch.bfloat16
    xs = [x.view(tokens, hidden) for x in inputs(world, tokens * hidden, dtype, seed=tokens)]
    residual0 = inputs(1, tokens * hidden, dtype, seed=999)[0].view(tokens, hidden)
    weight = inputs(1, hidden, dtype, seed=998)[0]
    residuals = [residual0.clone() for _ in range(world)]
    outs = g.run(lambda r, c: c.fused_add_rmsnorm(xs[r], residuals[r], weight, eps))
    s = emulate(xs)
    r_exact = (residual0.cpu().float() + s.float()).to(dtype)
    rf = r_exact.float()
    inv = 1.0 / torch.sqrt((rf * rf).mean(dim=1, keepdim=True) + eps)
    ref = ((rf * inv).to(dtype).float() * weight.cpu().float()).to(dtype)
    for r in range(world):
        assert_bits(residuals[r], r_exact)  # residual ← round(residual + Σ x), exactly
        assert_bits(outs[r], outs[0])  # every rank the same bits
        torch.testing.assert_close(outs[r].cpu().float(), ref.float(), rtol=2.0**-6, atol=2.0**-6)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [5000, 100_000])
def test_alloc_symmetric_zero_copy(world, n):
    g = group(world)
    xs = inputs(world, n, torch.bfloat16, seed=n)
    free_before = g.comms[0]._native.pool_free()[0]
    ts = g.launch(lambda r, c: c.alloc_symmetric((n,), torch.bfloat16))
    assert all(t.is_cuda and t.shape == (n,) and t.dtype == torch.bfloat16 for t in ts)
    assert g.comms[0]._native.pool_free()[0] < free_before
    for t, x in zip(ts, xs):
        t.copy_(x)
    g.run(lambda r, c: c.all_reduce(ts[r], ts[r]))  # an ordinary (copied-in) in-place call
    expected = emulate(xs)
    for t in ts:
        assert_bits(t, expected)
    for t, x in zip(ts, xs):
        t.copy_(x)
    g.run(lambda r, c: c.all_reduce_pool(ts[r]))  # zero-copy (low-latency in its range)
    for t in ts:
        assert_bits(t, expected)
    # A tensor that is not a pool allocation is refused before anything runs; the
    # communicator stays usable.
    plain = xs[0].clone()
    with pytest.raises(sar.InvalidCallError):
        g.comms[0].all_reduce_pool(plain)
    del t
    ts.clear()  # every rank frees in the same order
    assert g.comms[0]._native.pool_free()[0] == free_before


# ---- CUDA graphs and torch.compile ------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [4099, 300_001])
def test_cuda_graph_replays_on_changing_inputs(world, n):
    g = group(world)
    dtype = torch.bfloat16
    static = inputs(world, n, dtype, seed=1)
    g.run(lambda r, c: c.all_reduce(static[r]))  # warm-up, eager
    graphs = [torch.cuda.CUDAGraph() for _ in range(world)]
    outs = [None] * world
    for r in range(world):
        with torch.cuda.graph(graphs[r], stream=g.streams[r]):
            y = g.comms[r].all_reduce(static[r])
            outs[r] = g.comms[r].all_reduce(y)
    for it in range(4):
        fresh = inputs(world, n, dtype, seed=50 + it)
        for s, f in zip(static, fresh):
            s.copy_(f)
        g.launch(lambda r, c: graphs[r].replay())
        g.sync()
        once = emulate(fresh)
        twice = emulate([once] * world)
        for o in outs:
            assert_bits(o, twice)


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(10, 4, device="cuda")
        assert torch.ops.symm_allreduce.all_reduce(fx, 12345).shape == (10, 4)
        assert torch.ops.symm_allreduce.all_gather(fx, 2, 12345).shape == (2, 10, 4)
        assert torch.ops.symm_allreduce.reduce_scatter(fx, 2, 12345).shape == (5, 4)
        r = torch.empty(10, 4, device="cuda")
        w = torch.empty(4, device="cuda")
        assert torch.ops.symm_allreduce.fused_add_rmsnorm(fx, r, w, 1e-6, 12345).shape == (10, 4)


# ---- bad inputs, divergence, stuck peers -------------------------------------------------------


class Duck:
    """A tensor descriptor that lies about its address or device."""

    def __init__(self, real, ptr_offset=0, device_index=None):
        self.real, self.ptr_offset = real, ptr_offset
        self.dtype = real.dtype
        self.shape = real.shape
        idx = real.device.index if device_index is None else device_index
        self.device = torch.device("cuda", idx)

    def data_ptr(self):
        return self.real.data_ptr() + self.ptr_offset

    def numel(self):
        return self.real.numel()

    def is_contiguous(self):
        return True


def _kind(excinfo):
    return getattr(excinfo.value, "kind", None)


def test_bad_inputs_raise_and_leave_the_communicator_usable():
    g = group(2)
    c = g.comms[0]
    x = torch.randn(1000, device="cuda").to(torch.bfloat16)
    with torch.cuda.stream(g.streams[0]):
        with pytest.raises(sar.InvalidCallError, match="is a cpu tensor"):
            c.all_reduce(x.cpu())
        with pytest.raises(sar.InvalidCallError, match="not contiguous"):
            c.all_reduce(x.view(100, 10).t())
        with pytest.raises(sar.InvalidCallError, match="unsupported dtype torch.float64"):
            c.all_reduce(x.double())
        with pytest.raises(sar.InvalidCallError, match="unsupported dtype torch.int32"):
            c.all_reduce(x.int())
        with pytest.raises(sar.InvalidCallError, match="cannot be summed"):
            c.all_reduce(x.view(torch.uint8)[:1000].clone())
        with pytest.raises(sar.InvalidCallError) as e:
            c.all_reduce(Duck(x, ptr_offset=1), torch.empty_like(x))
        assert _kind(e) == "Misaligned"
        with pytest.raises(sar.InvalidCallError) as e:
            c.all_reduce(Duck(x, device_index=1), torch.empty_like(x))
        assert _kind(e) == "WrongDevice"
        with pytest.raises(sar.InvalidCallError) as e:
            c.all_reduce(x, torch.empty(999, dtype=x.dtype, device="cuda"))
        assert _kind(e) == "LengthMismatch"
        with pytest.raises(sar.InvalidCallError, match="every tensor of one call has the same dtype"):
            c.all_reduce(x, torch.empty(1000, dtype=torch.float16, device="cuda"))
        with pytest.raises(sar.InvalidCallError) as e:
            c.all_reduce(x[:0])
        assert _kind(e) == "Empty"
        with pytest.raises(sar.InvalidCallError) as e:
            c.all_reduce(torch.empty(3 << 20, dtype=torch.float32, device="cuda"))
        assert _kind(e) == "ExceedsCapacity"
        with pytest.raises(sar.InvalidCallError) as e:
            c.fused_add_rmsnorm(x.view(1, 1000), x.view(1, 1000).clone(), x[:999].clone())
        assert _kind(e) == "InvalidShape"
        with pytest.raises(sar.InvalidCallError, match="unknown algorithm"):
            c.all_reduce(x, algorithm="fastest")
        if torch.cuda.device_count() > 1:
            with pytest.raises(sar.InvalidCallError) as e:
                c.all_reduce(x.to("cuda:1"))
            assert _kind(e) == "WrongDevice"
    # Still usable: a correct call on every rank.
    xs = inputs(2, 1000, torch.bfloat16, seed=77)
    outs = g.run(lambda r, c: c.all_reduce(xs[r]))
    for o in outs:
        assert_bits(o, emulate(xs))


def test_all_gather_v_counts_mismatch_is_diverged_and_recoverable():
    g = Group(2)
    try:
        mine = [[3, 4], [3, 5]]  # rank 1 says it has 5 rows, rank 0 thinks 4
        ys = [torch.ones(mine[r][r], 2, device="cuda") for r in range(2)]
        g.launch(lambda r, c: c.all_gather_v(ys[r], mine[r]))
        errors = []
        for r in range(2):
            with torch.cuda.stream(g.streams[r]), pytest.raises(sar.DivergedError) as e:
                g.comms[r].synchronize()
            errors.append(_kind(e))
        assert errors == ["CountsMismatch", "CountsMismatch"]
        xs = inputs(2, 1000, torch.float32, seed=78)
        outs = g.run(lambda r, c: c.all_reduce(xs[r]))
        for o in outs:
            assert_bits(o, emulate(xs))
    finally:
        g.close()


def test_mismatched_lengths_across_ranks_are_diverged_with_the_check():
    g = Group(2, check_divergence=True, timeout=5.0)
    try:
        xs = [torch.ones(1000, device="cuda"), torch.ones(1001, device="cuda")]
        g.launch(lambda r, c: c.all_reduce(xs[r], algorithm="one_shot"))
        kinds = []
        for r in range(2):
            with torch.cuda.stream(g.streams[r]):
                with pytest.raises(sar.DivergedError) as e:
                    g.comms[r].synchronize()
                kinds.append(_kind(e))
                # Poisoned from now on, still as a DivergedError.
                with pytest.raises(sar.DivergedError):
                    g.comms[r].all_reduce(xs[r])
        assert "Diverged" in kinds, kinds
    finally:
        g.close()
    fresh = group(2)
    ys = inputs(2, 64, torch.float32, seed=79)
    for o in fresh.run(lambda r, c: c.all_reduce(ys[r])):
        assert_bits(o, emulate(ys))


@pytest.mark.parametrize("algorithm", ["low_latency", "one_shot", "two_shot"])
def test_a_stuck_peer_is_a_peer_timeout_within_twice_the_timeout(algorithm):
    timeout = 1.0
    g = Group(2, timeout=timeout)
    try:
        x = torch.ones(2048, device="cuda")
        torch.cuda.synchronize()
        t0 = time.monotonic()
        with torch.cuda.stream(g.streams[0]):  # rank 1 never calls
            g.comms[0].all_reduce(x, algorithm=algorithm)
            with pytest.raises(sar.PeerTimeoutError) as e:
                g.comms[0].synchronize()
        elapsed = time.monotonic() - t0
        assert _kind(e) == "PeerTimeout"
        assert elapsed < 2 * timeout, f"PeerTimeout after {elapsed:.2f} s (timeout {timeout} s)"
        print(f"PeerTimeout ({algorithm}) after {elapsed:.3f} s: {e.value}")
        with torch.cuda.stream(g.streams[0]), pytest.raises(sar.PeerTimeoutError) as e:
            g.comms[0].all_reduce(x)
        assert _kind(e) == "Poisoned"
    finally:
        g.close()


# ---- threads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_on_its_own_thread(world):
    """Each virtual rank driven by its own Python thread (as a torch worker pool would): the
    calls run concurrently, each thread waits in synchronize() without holding the GIL, and
    the sums are the emulation's bits. Then rank 0's communicator used from a thread that is
    not the one that made it."""
    from concurrent.futures import ThreadPoolExecutor

    g = group(world)
    xs = inputs(world, 65_537, torch.bfloat16, seed=61)
    torch.cuda.synchronize()

    def rank_work(r):
        with torch.cuda.stream(g.streams[r]):
            out = g.comms[r].all_reduce(xs[r])
            twice = g.comms[r].all_reduce(out)
            g.comms[r].synchronize()
        return out, twice

    with ThreadPoolExecutor(max_workers=world) as pool:
        outs = list(pool.map(rank_work, range(world)))
    once = emulate(xs)
    for out, twice in outs:
        assert_bits(out, once)
        assert_bits(twice, emulate([once] * world))
    with ThreadPoolExecutor(max_workers=1) as pool:
        outs = pool.submit(lambda: g.run(lambda r, c: c.all_reduce(xs[r]))).result(timeout=120)
    for o in outs:
        assert_bits(o, once)


# ---- a vLLM-shaped caller ---------------------------------------------------------------------


class CudaCommunicatorLike:
    """What vLLM's CudaCommunicator / GroupCoordinator do with their CustomAllreduce object
    (`ca_comm`): the same method names, called the same way."""

    def __init__(self, ca_comm):
        self.ca_comm = ca_comm
        self.fallbacks = 0

    def all_reduce(self, input_):
        ca_comm = self.ca_comm
        if ca_comm is not None and not ca_comm.disabled and ca_comm.should_custom_ar(input_):
            out = ca_comm.custom_all_reduce(input_)
            assert out is not None
            return out
        self.fallbacks += 1  # vLLM: pynccl / torch.distributed
        return None

    @contextmanager
    def graph_capture(self):
        ca_comm = self.ca_comm
        maybe_ca_context = contextlib_nullcontext() if ca_comm is None else ca_comm.capture()
        with maybe_ca_context:
            yield


def contextlib_nullcontext():
    from contextlib import nullcontext

    return nullcontext()


def test_vllm_shaped_smoke():
    g = group(2)
    tps = [CudaCommunicatorLike(c) for c in g.comms]
    assert all(not c.disabled and c.reason is None for c in g.comms)
    xs = inputs(2, 8192, torch.bfloat16, seed=21)
    outs = g.run(lambda r, c: tps[r].all_reduce(xs[r]))
    for o in outs:
        assert_bits(o, emulate(xs))
    # Not taken (falls through): wrong dtype, too large, not contiguous.
    assert tps[0].all_reduce(xs[0].double()) is None
    too_large = torch.empty(g.comms[0].max_size // 2 + 1, dtype=torch.bfloat16, device="cuda")
    assert tps[0].all_reduce(too_large) is None
    assert tps[0].all_reduce(xs[0].view(64, 128).t()) is None
    assert tps[0].fallbacks == 3
    # graph_capture then a captured decode step, replayed.
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    outs = [None, None]
    for r in range(2):
        with tps[r].graph_capture(), torch.cuda.graph(graphs[r], stream=g.streams[r]):
            outs[r] = tps[r].all_reduce(xs[r] * 1)
    for it in range(3):
        fresh = inputs(2, 8192, torch.bfloat16, seed=30 + it)
        for x, f in zip(xs, fresh):
            x.copy_(f)
        g.launch(lambda r, c: graphs[r].replay())
        g.sync()
        for o in outs:
            assert_bits(o, emulate(fresh))


# ---- processes over a gloo group --------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_mps():
    """A private MPS daemon (its own pipe and log directories), stopped afterwards; yields the
    environment for its clients, or None where there is no nvidia-cuda-mps-control."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as pipes, tempfile.TemporaryDirectory() as logs:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipes, CUDA_MPS_LOG_DIRECTORY=logs)
        started = subprocess.run([control, "-d"], env=env, capture_output=True, timeout=30)
        if started.returncode != 0:
            print(f"MPS daemon did not start: {started.stderr.decode()!r}; running without MPS")
            yield None
            return
        try:
            yield env
        finally:
            subprocess.run([control], input=b"quit\n", env=env, capture_output=True, timeout=30)


def run_ranks(world, part):
    """Runs mp_worker.py's ``part`` in ``world`` processes on one GPU over a gloo group (under
    a private MPS daemon where there is one) and checks that every rank reports success."""
    with private_mps() as mps_env:
        base = mps_env if mps_env is not None else dict(os.environ)
        port = _free_port()
        procs = []
        for rank in range(world):
            env = dict(
                base, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "mp_worker.py"), part],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append(out.decode(errors="replace"))
        print(f"MPS: {'on' if mps_env is not None else 'off (no nvidia-cuda-mps-control)'}")
        for rank, (p, out) in enumerate(zip(procs, outputs)):
            print(f"--- rank {rank} (exit {p.returncode}) ---\n{out}")
        assert all(p.returncode == 0 for p in procs), outputs
        assert all(f"RANK {r}/{world} OK {part}" in outputs[r] for r in range(world))


@pytest.mark.parametrize("world", [2, 4])
def test_processes_over_a_gloo_group(world):
    """W processes on one GPU, a gloo group: eager all-reduces of every dtype and a captured
    graph replayed on changing inputs, bit-identical to the fp32 rank-order emulation."""
    run_ranks(world, "eager")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("part", ["compile", "compile-graphs"])
def test_torch_compile_across_processes(world, part):
    """torch.compile in W processes over a gloo group: the four torch.library ops chained in
    one function (aot_eager, and inductor with dynamic shapes), bit-identical to the same
    function run eagerly; and inductor's CUDA graphs (mode="reduce-overhead") replayed on
    changing inputs. torch.compile is tested across processes rather than on virtual ranks: a
    rank's first compiled call compiles while its peers' kernels may already wait, and only
    separate processes keep a compile from waiting on them."""
    run_ranks(world, part)
