"""Per-operation cost of the Python hot path's pieces (ns), on the GPU machine's CPU."""
import functools, statistics, time, sys
import torch
import symm_allreduce as sa
from symm_allreduce import _native
from symm_allreduce._comm import _bind_current_stream
from symm_allreduce._tensor import describe, SUM_CODES, PLAIN_TYPES

torch.cuda.init()
x = torch.zeros(4096, dtype=torch.bfloat16, device="cuda:0")
y = torch.zeros(4096, dtype=torch.bfloat16, device="cuda:0")
x2 = torch.zeros(1, 4096, dtype=torch.bfloat16, device="cuda:0")
describe(x)
raw = _bind_current_stream()
dt = x.dtype
N = 200_000

def bench(name, f):
    best = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(N):
            f()
        best.append((time.perf_counter_ns() - t0) / N)
    print(f"{name:40s} {min(best):7.1f} ns  (median {statistics.median(best):7.1f})")

def empty(): pass
bench("empty python call", empty)
bench("partial(empty)", functools.partial(empty))
bench("x.get_device()", x.get_device)
bench("x.is_contiguous()", x.is_contiguous)
bench("x2.is_contiguous()", x2.is_contiguous)
bench("x.data_ptr()", x.data_ptr)
bench("x.numel()", x.numel)
bench("x.dim()", x.dim)
bench("x.stride()", x.stride)
bench("lambda x.dtype", lambda: x.dtype)
bench("lambda x.is_cuda", lambda: x.is_cuda)
bench("lambda x.device", lambda: x.device)
bench("lambda type(x) in PLAIN", lambda: type(x) in PLAIN_TYPES)
bench("lambda SUM_CODES.get(dt)", lambda: SUM_CODES.get(dt))
bench("raw(0)", functools.partial(raw, 0))
bench("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
bench("torch.empty_like(x)", functools.partial(torch.empty_like, x))
bench("_native.kernels_available()", _native.kernels_available)
bench("describe(x)", functools.partial(describe, x))
tc = torch._C.TensorBase if hasattr(torch._C, "TensorBase") else torch._C._TensorBase
bench("TensorBase.is_contiguous(x)", functools.partial(tc.is_contiguous, x))
bench("TensorBase.data_ptr(x)", functools.partial(tc.data_ptr, x))
bench("x._cdata", lambda: x._cdata)

# One communicator round: 8 virtual ranks, py vs native, per call.
comms = sa.local_group(8, 0, capacity_bytes=1 << 20, pool_bytes=0, shared_sm_percent=100)
streams = [torch.cuda.Stream(0) for _ in comms]
bufs = [[torch.zeros(4096, dtype=torch.bfloat16, device="cuda:0") for _ in range(2)] for _ in comms]
torch.cuda.synchronize()
kind = int(_native.dtype_code(str(torch.bfloat16)))
def round_py():
    for c, s, (a, b) in zip(comms, streams, bufs):
        with torch.cuda.stream(s):
            c.all_reduce(a, b)
nat = [functools.partial(c._live().all_reduce_ptr, a.data_ptr(), 4096, b.data_ptr(), 4096, kind, int(s.cuda_stream), sa._comm._AUTO) for c, s, (a, b) in zip(comms, streams, bufs)]
def round_nat():
    for s, f in zip(streams, nat):
        with torch.cuda.stream(s):
            f()
def round_ctx():
    for s in streams:
        with torch.cuda.stream(s):
            pass
for name, f in (("round py", round_py), ("round native", round_nat), ("round ctx only", round_ctx)):
    ts = []
    for _ in range(30):
        t0 = time.perf_counter_ns()
        for _ in range(50):
            f()
        ts.append((time.perf_counter_ns() - t0) / 50 / 8)
        torch.cuda.synchronize()
    print(f"{name:40s} {min(ts):7.1f} ns/call (median {statistics.median(ts):7.1f})")
for c in comms:
    c.close()
