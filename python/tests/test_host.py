"""Tests that need neither a GPU nor torch: import, kernels embedded, config validation,
the exception mapping, duck-typed tensor descriptors, and a disabled group's fall-through."""

from __future__ import annotations

import os

import pytest

import symm_allreduce as sar
from symm_allreduce import _native
from symm_allreduce._tensor import describe


def test_import_and_version():
    assert sar.__version__ == "0.1.0"
    assert sar.MAX_RANKS == 8
    assert set(sar.REDUCE_DTYPES) == {"float32", "float16", "bfloat16"}
    assert set(sar.GATHER_DTYPES) == set(sar.REDUCE_DTYPES) | {"uint8", "int8"}


@pytest.mark.skipif(
    os.environ.get("SYMM_ALLREDUCE_REQUIRE_KERNELS") != "1",
    reason="only a wheel built with SYMM_ALLREDUCE_REQUIRE_KERNELS=1 must have the kernels",
)
def test_kernels_embedded():
    assert sar.kernels_available()


def test_config_defaults_and_every_field():
    c = sar.validate_config()
    assert set(c) == set(sar.CONFIG_KEYS)
    assert c["capacity_bytes"] == 64 << 20
    assert c["algorithm"] == "auto" and c["multicast"] == "off"
    assert c["timeout"] == 10.0 and c["reproducible"] is True
    assert c["shared_sm_percent"] == 25
    # The crossovers default to the tuning table's, else the published ones per world size.
    assert c["low_latency_max_bytes"] is None and c["one_shot_max_bytes"] is None
    given = dict(
        capacity_bytes=1 << 20,
        algorithm="two_shot",
        one_shot_max_bytes=4096,
        max_blocks_per_rank=16,
        shared_sm_percent=100,
        low_latency_max_bytes=0,
        timeout=2.5,
        nccl_above_bytes=1 << 19,
        peer_kernels=True,
        pdl=False,
        check_divergence=True,
        multicast="auto",
        reproducible=False,
        pool_bytes=0,
    )
    c = sar.validate_config(**given)
    for k, v in given.items():
        assert c[k] == v, k


def test_algorithm_aliases():
    assert sar.validate_config(algorithm="ll")["algorithm"] == "low_latency"
    assert sar.validate_config(algorithm="oneshot")["algorithm"] == "one_shot"


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        ({"max_blocks_per_rank": 0}, "max_blocks_per_rank must be in 1..=64, got 0"),
        ({"max_blocks_per_rank": 65}, "max_blocks_per_rank"),
        ({"shared_sm_percent": 0}, "shared_sm_percent must be in 1..=100, got 0"),
        ({"shared_sm_percent": 101}, "shared_sm_percent"),
        ({"timeout": 0.0}, "timeout must be in (0, 1 h]"),
        ({"timeout": 7200}, "timeout must be in (0, 1 h]"),
        ({"timeout": -1.0}, "timeout"),
        ({"algorithm": "fastest"}, "unknown algorithm"),
        ({"multicast": "yes"}, "unknown multicast setting"),
        ({"capacity": 1}, "unknown config keyword"),
        ({"capacity_bytes": "big"}, "config keyword capacity_bytes"),
        ({"multicast": "required", "peer_kernels": False}, "peer_kernels is false"),
        ({"tuning": "/nonexistent/tuning.json"}, "/nonexistent/tuning.json"),
    ],
)
def test_config_refused_with_the_crates_text(kw, text):
    with pytest.raises(sar.InvalidCallError) as e:
        sar.validate_config(**kw)
    assert text in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("kind", "cls", "text"),
    [
        ("PeerTimeout", sar.PeerTimeoutError, "waited more than 2s for rank 1"),
        ("Poisoned", sar.PeerTimeoutError, "unusable after an earlier failure"),
        ("Diverged", sar.DivergedError, "every rank must make the same calls"),
        ("CountsMismatch", sar.DivergedError, "counts differ"),
        ("LengthMismatch", sar.InvalidCallError, "they must be equal"),
        ("Empty", sar.InvalidCallError, "pass at least one element"),
        ("ExceedsCapacity", sar.InvalidCallError, "raise Config::capacity_bytes"),
        ("Misaligned", sar.InvalidCallError, "not aligned"),
        ("WrongDevice", sar.InvalidCallError, "on device 1 but this rank runs on device 0"),
        ("NoDevice", sar.UnavailableError, "CUDA_VISIBLE_DEVICES"),
        ("KernelsUnavailable", sar.UnavailableError, "install-nvcc"),
        ("DriverUnavailable", sar.UnavailableError, "install the NVIDIA driver"),
        ("KernelFault", sar.SymmAllReduceError, "every rank must run the same build"),
        ("Bootstrap", sar.SymmAllReduceError, "bootstrap failed"),
    ],
)
def test_error_mapping(kind, cls, text):
    with pytest.raises(sar.SymmAllReduceError) as e:
        _native._raise_example(kind)
    assert type(e.value) is cls
    assert e.value.kind == kind
    assert text in str(e.value)


def test_error_hierarchy():
    assert issubclass(sar.PeerTimeoutError, TimeoutError)
    assert issubclass(sar.InvalidCallError, ValueError)
    assert issubclass(sar.UnavailableError, RuntimeError)
    for c in (sar.PeerTimeoutError, sar.DivergedError, sar.InvalidCallError, sar.UnavailableError):
        assert issubclass(c, sar.SymmAllReduceError)
    # The base class is not any of the handled kinds.
    assert not issubclass(sar.SymmAllReduceError, (ValueError, TimeoutError, RuntimeError))


class _Device:
    def __init__(self, type_: str, index: int | None) -> None:
        self.type = type_
        self.index = index


class FakeTensor:
    """A duck-typed tensor: the five things the package reads."""

    def __init__(
        self, ptr=0x7F00_0000_0000, numel=1024, dtype="torch.float16", device=("cuda", 0), contiguous=True
    ):
        self._ptr, self._numel, self.dtype = ptr, numel, dtype
        self.device = _Device(*device)
        self._contiguous = contiguous

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def is_contiguous(self):
        return self._contiguous


def test_duck_typed_descriptor():
    t = FakeTensor()
    assert describe(t) == (0x7F00_0000_0000, 1024, "torch.float16", "cuda", 0, True)
    assert describe(FakeTensor(device=("cuda", None)))[4] == -1
    _native.check_tensor(describe(t), 0)


@pytest.mark.parametrize(
    ("tensor", "cls", "text"),
    [
        (FakeTensor(device=("cpu", None)), sar.InvalidCallError, "is a cpu tensor"),
        (FakeTensor(device=("cuda", 1)), sar.InvalidCallError, "on device 1 but this rank runs on device 0"),
        (FakeTensor(contiguous=False), sar.InvalidCallError, "not contiguous"),
        (FakeTensor(dtype="torch.float64"), sar.InvalidCallError, "unsupported dtype torch.float64"),
        (FakeTensor(dtype="torch.int32"), sar.InvalidCallError, "unsupported dtype"),
    ],
)
def test_descriptor_refusals(tensor, cls, text):
    with pytest.raises(cls) as e:
        _native.check_tensor(describe(tensor), 0)
    assert text in str(e.value)


def test_element_sizes():
    assert [_native.element_size(n) for n in ("float32", "torch.bfloat16", "half", "uint8")] == [4, 2, 2, 1]
    with pytest.raises(sar.InvalidCallError):
        _native.element_size("complex64")


def test_local_group_without_a_driver_is_unavailable():
    try:
        n = sar.device_count()
    except sar.UnavailableError as e:
        assert e.kind in ("DriverUnavailable", "NoDevice")
        with pytest.raises(sar.UnavailableError):
            sar.local_group(2, 0)
    else:
        pytest.skip(f"this machine has a CUDA driver ({n} devices): covered by the GPU tests")


def test_local_group_refuses_bad_worlds_before_any_device_call():
    with pytest.raises(sar.InvalidCallError, match="invalid world size 9"):
        sar.local_group(9, 0)
    with pytest.raises(sar.InvalidCallError, match="max_blocks_per_rank"):
        sar.local_group(2, 0, max_blocks_per_rank=0)


class _FakeDist:
    """torch.distributed's surface that the group constructor uses, for one rank whose
    peers are simulated by the answers of ``all_gather_object``."""

    def __init__(self, rank, world, peers):
        self.rank, self.world, self.peers = rank, world, peers

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def all_gather_object(self, out, obj, group=None):
        for q in range(self.world):
            out[q] = obj if q == self.rank else self.peers(q, obj)


def _with_fake_dist(monkeypatch, dist):
    import sys
    import types

    torch = types.ModuleType("torch")
    torch.distributed = dist
    torch.cuda = types.SimpleNamespace(current_device=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)


def test_group_spanning_hosts_comes_up_disabled(monkeypatch):
    dist = _FakeDist(0, 2, lambda q, obj: ("other-host", None))
    _with_fake_dist(monkeypatch, dist)
    comm = sar.SymmAllReduce(object(), device=0)
    assert comm.disabled
    assert "spans 2 hosts" in comm.reason
    assert comm.custom_all_reduce(FakeTensor()) is None
    assert not comm.should_custom_ar(FakeTensor())
    assert "disabled" in comm.describe()
    with pytest.raises(sar.UnavailableError, match="disabled"):
        comm.all_reduce(FakeTensor())
    comm.close()


def test_a_peers_bad_config_disables_every_rank(monkeypatch):
    import socket

    host = socket.gethostname()
    dist = _FakeDist(0, 2, lambda q, obj: (host, "invalid configuration: timeout must be in (0, 1 h]"))
    _with_fake_dist(monkeypatch, dist)
    comm = sar.SymmAllReduce(object(), device=0)
    assert comm.disabled
    assert comm.reason.startswith("rank 1: invalid configuration")


def test_own_bad_config_disables_without_raising(monkeypatch):
    import socket

    host = socket.gethostname()
    dist = _FakeDist(0, 2, lambda q, obj: (host, None))
    _with_fake_dist(monkeypatch, dist)
    comm = sar.SymmAllReduce(object(), device=0, timeout=0.0)
    assert comm.disabled and "timeout must be in" in comm.reason
    comm = sar.SymmAllReduce(object(), device=0, no_such_keyword=1)
    assert comm.disabled and "unknown config keyword" in comm.reason


def test_world_of_one_is_disabled(monkeypatch):
    _with_fake_dist(monkeypatch, _FakeDist(0, 1, None))
    comm = sar.SymmAllReduce(object(), device=0)
    assert comm.disabled and "one rank" in comm.reason


def test_bench_helpers_without_a_gpu():
    from symm_allreduce import bench

    assert bench._parse_sizes("8K, 2M,100") == [8192, 2 << 20, 100]
    row = {c: 1 for c in bench.COLUMNS} | {"time_us": 4.25, "dtype": "bf16"}
    table = bench.format_table([row])
    lines = table.splitlines()
    assert lines[0].split() == list(bench.COLUMNS)
    assert "4.25" in lines[1].split() and "bf16" in lines[1].split()
    with pytest.raises(SystemExit):
        bench.main(["--modes", "eager,fastest"])
    # Pairs of rounds of the two orders: an order that reads 1 µs higher than the other
    # shifts every pair by the same half, and an odd last round is dropped.
    assert bench._order_balanced([3.0, 1.0, 3.5, 1.5, 9.0]) == [2.0, 2.5]
    assert bench._order_balanced([]) == []


def test_bench_pairs_rounds_of_both_orders():
    """``_timed_differences`` alternates the order from the first timed round on and averages
    each pair: a side that reads 1 µs a call dearer when it runs first leaves no trace."""
    from symm_allreduce import bench

    class Timer:
        def time(self, samples, per_sample, round_):
            for _ in range(samples * per_sample):
                round_()
            return [], 0.0

    class Cuda:
        @staticmethod
        def synchronize():
            pass

    class Torch:
        cuda = Cuda

    orders = []

    def pair(python_first):
        orders.append(python_first)
        # 4 ranks: Python 3 µs a call over Rust, plus 1 µs a call for whichever runs first.
        return (4 * (3e-6 + (1e-6 if python_first else 0.0)), 4 * (0.0 if python_first else 1e-6))

    diffs = bench._timed_differences(Torch, Timer(), pair, 4)
    per_sample = bench.ROUNDS_PER_SAMPLE["eager"]
    timed = -(-bench.ROUNDS["eager"] // per_sample) * per_sample
    assert len(diffs) == timed // 2
    assert orders[-timed] is True  # the timed rounds start with Python first
    assert all(a != b for a, b in zip(orders[-timed:], orders[-timed + 1 :]))
    assert diffs == pytest.approx([3.0] * len(diffs))


def test_bench_host_only_without_a_gpu(capsys):
    from symm_allreduce import bench

    steps = bench.host_only(200)
    assert [name for name, _ in steps][:2] == [
        "describe(tensor), duck-typed",
        "native descriptor check + argument conversion, one tensor",
    ]
    assert all(0.0 < us < 1000.0 for _, us in steps), steps
    assert bench.main(["--host-only", "--host-iters", "100"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(steps)


# ---- the all-reduce's hot path (plain torch tensors as integers) -----------------------------


def test_hot_path_codes():
    names = _native.ALGORITHMS
    assert names[0] == "auto" and len(set(names)) == len(names)
    for code, name in enumerate(names):
        assert _native.algorithm_code(name) == code
    assert names[_native.algorithm_code("ll")] == "low_latency"
    assert names[_native.algorithm_code("oneshot")] == "one_shot"
    with pytest.raises(sar.InvalidCallError, match="unknown algorithm"):
        _native.algorithm_code("fastest")
    codes = {_native.dtype_code(n) for n in sar.GATHER_DTYPES}
    assert codes == set(range(len(sar.GATHER_DTYPES)))
    assert _native.dtype_code("torch.bfloat16") == _native.dtype_code("bf16")
    with pytest.raises(sar.InvalidCallError, match="unsupported dtype"):
        _native.dtype_code("float64")


@pytest.mark.parametrize(
    ("args", "cls", "text"),
    [
        ((1 << 40, 8, 1 << 41, 8, 99, 0), sar.InvalidCallError, "unknown dtype code 99"),
        ((1 << 40, 8, 1 << 41, 8, 2, 99), sar.InvalidCallError, "unknown algorithm code 99"),
        ((0, 8, 1 << 41, 8, 2, 0), sar.InvalidCallError, "input is a null address"),
        ((1 << 40, 8, 0, 8, 2, 0), sar.InvalidCallError, "output is a null address"),
        ((-1, 8, 1 << 41, 8, 2, 0), OverflowError, None),
        ((1 << 40, 8, 1 << 41, 8, 256, 0), OverflowError, None),
    ],
)
def test_hot_path_argument_refusals(args, cls, text):
    with pytest.raises(cls, match=text):
        _native.check_ptr_call(*args)


def test_hot_path_arguments_accepted():
    _native.check_ptr_call(1 << 40, 8, 1 << 41, 8, _native.dtype_code("bfloat16"), 0)
    _native.check_ptr_call(0, 0, 0, 0, 0, 0)  # empty: the crate refuses it with its own error


def test_the_benchs_rust_round_refuses_lists_of_other_lengths():
    # One communicator, input, output and stream per rank: a missing one is refused before
    # any call (no communicator is needed to see it).
    with pytest.raises(sar.InvalidCallError, match="0 communicators, 1 inputs, 0 outputs and 0 streams"):
        _native.time_ptr_round([], [1 << 40], [], 8, 2, [], 0)
    assert _native.time_ptr_round([], [], [], 8, 2, [], 0) >= 0.0  # no rank: an empty round


class _FakeDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class _FakeTorchTensor:
    """What the hot path reads of a torch tensor (the class stands for torch.Tensor)."""

    def __init__(self, torch, ptr, numel, dtype, device=0, contiguous=True, cuda=True):
        self._ptr, self._numel, self.dtype = ptr, numel, getattr(torch, dtype)
        self.is_cuda, self._device, self._contiguous = cuda, device if cuda else -1, contiguous

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def get_device(self):
        return self._device

    def is_contiguous(self):
        return self._contiguous

    @property
    def device(self):
        return _Device("cuda" if self.is_cuda else "cpu", self._device if self.is_cuda else None)


class _RecordingNative:
    """A native communicator that records the calls the Python layer makes."""

    rank, world_size, device, has_peer_kernels, peer_kernels_unavailable = 0, 2, 0, True, None

    def __init__(self):
        self.calls = []

    def config(self):
        return {"capacity_bytes": 1 << 20}

    def all_reduce_ptr(self, *args):
        self.calls.append(("all_reduce_ptr", *args))

    def all_reduce(self, *args):
        self.calls.append(("all_reduce", *args))

    def close(self):
        pass


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in `torch` module (tensor class, dtypes, empty_like, the raw-stream reader) and
    the package's torch registries emptied for it (restored afterwards)."""
    import sys
    import types

    from symm_allreduce import _comm, _tensor

    torch = types.ModuleType("torch")
    for name in ("float32", "float16", "bfloat16", "float64", "uint8"):
        setattr(torch, name, _FakeDtype(name))
    torch.Tensor = type("Tensor", (_FakeTorchTensor,), {})
    torch.nn = types.SimpleNamespace(Parameter=type("Parameter", (torch.Tensor,), {}))
    torch.contiguous_format = object()
    torch.allocated = []

    def empty_like(t, memory_format=None):
        assert memory_format is torch.contiguous_format
        out = torch.Tensor(torch, 0x7F00_0009_0000, t.numel(), t.dtype.name, t.get_device())
        torch.allocated.append(out)
        return out

    torch.empty_like = empty_like
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: 0x5000 + device)
    torch.cuda = types.SimpleNamespace(init=lambda: None, current_device=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_comm, "_TORCH", None)
    monkeypatch.setattr(_comm, "_CURRENT_STREAM", None)
    monkeypatch.setattr(_comm, "_ALGORITHM_CODES", dict(_comm._ALGORITHM_CODES))
    saved = [(c, c.copy()) for c in (_tensor.PLAIN_TYPES, _tensor.SUM_CODES, _tensor.CODE_SIZES)]
    saved += [(c, c.copy()) for c in (_tensor._TORCH_TYPES, _tensor._OTHER_TYPES, _tensor._DTYPE_NAMES)]
    for c, _ in saved:
        c.clear()
    yield torch
    for c, old in saved:
        c.clear()
        c.update(old)


def test_hot_path_dispatch(fake_torch):
    torch = fake_torch
    native = _RecordingNative()
    comm = sar.SymmAllReduce._wrap(native)
    try:
        bf16 = _native.dtype_code("bfloat16")

        def tensor(ptr, numel=1024, dtype="bfloat16", **kw):
            return torch.Tensor(torch, ptr, numel, dtype, **kw)

        x, y = tensor(0x7F00_0000_0000), tensor(0x7F00_0001_0000)
        # The first call describes the tensor (the checked path) and registers torch's types.
        comm.all_reduce(x, y)
        assert native.calls.pop()[0] == "all_reduce"
        # From then on: integers, the stream of the rank's device, the algorithm's code.
        comm.all_reduce(x, y)
        assert native.calls.pop() == ("all_reduce_ptr", x._ptr, 1024, y._ptr, 1024, bf16, 0x5000, 0)
        comm.all_reduce(x, x, algorithm="ll")
        ll = _native.algorithm_code("low_latency")
        assert native.calls.pop() == ("all_reduce_ptr", x._ptr, 1024, x._ptr, 1024, bf16, 0x5000, ll)
        out = comm.all_reduce(x, algorithm="two_shot")
        assert out is torch.allocated[-1]
        two = _native.algorithm_code("two_shot")
        assert native.calls.pop() == ("all_reduce_ptr", x._ptr, 1024, out._ptr, 1024, bf16, 0x5000, two)
        p = torch.nn.Parameter(torch, 0x7F00_0002_0000, 1024, "bfloat16")
        comm.all_reduce(p, y)
        assert native.calls.pop()[0] == "all_reduce_ptr"
        # An unknown algorithm is refused before anything is called.
        with pytest.raises(sar.InvalidCallError, match="unknown algorithm"):
            comm.all_reduce(x, y, algorithm="fastest")
        assert native.calls == []
        # Whatever the hot path does not take goes the checked way (which raises the error).
        sub = type("Sub", (torch.Tensor,), {})(torch, 0x7F00_0003_0000, 1024, "bfloat16")
        for inp, o in [
            (tensor(0x7F00_0000_0000, contiguous=False), y),
            (tensor(0x7F00_0000_0000, device=1), y),
            (tensor(0x7F00_0000_0000, cuda=False), y),
            (tensor(0x7F00_0000_0000, dtype="float64"), y),
            (tensor(0x7F00_0000_0000, dtype="uint8"), y),
            (x, tensor(0x7F00_0001_0000, dtype="float32")),
            (x, tensor(0x7F00_0001_0000, contiguous=False)),
            (x, tensor(0x7F00_0001_0000, device=1)),
            (sub, y),
            (x, sub),
            (FakeTensor(dtype="torch.bfloat16"), y),
        ]:
            comm.all_reduce(inp, o)
            call = native.calls.pop()
            assert call[0] == "all_reduce", (inp, o)
            assert call[1] == describe(inp) and call[2] == describe(o) and call[4] == "auto"
        # custom_all_reduce / should_custom_ar: the same checks plus the size.
        for t, taken in [
            (x, True),
            (tensor(0x7F00_0000_0000, numel=(1 << 20) // 2), True),
            (tensor(0x7F00_0000_0000, numel=(1 << 20) // 2 + 1), False),
            (tensor(0x7F00_0000_0000, numel=0), False),
            (tensor(0x7F00_0000_0000, device=1), False),
            (tensor(0x7F00_0000_0000, contiguous=False), False),
            (tensor(0x7F00_0000_0000, cuda=False), False),
            (tensor(0x7F00_0000_0000, dtype="uint8"), False),
            (tensor(0x7F00_0000_0000, numel=1 << 18, dtype="float32"), True),
        ]:
            assert comm.should_custom_ar(t) is taken
            out = comm.custom_all_reduce(t)
            if taken:
                assert out is torch.allocated[-1]
                code, n = _native.dtype_code(t.dtype.name), t._numel
                assert native.calls.pop() == ("all_reduce_ptr", t._ptr, n, out._ptr, n, code, 0x5000, 0)
            else:
                assert out is None
            assert native.calls == []
    finally:
        comm.close()
