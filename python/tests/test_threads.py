"""One communicator used from other Python threads, without torch.

The native class is an ordinary (sendable) Python class: any thread may call it, and its
blocking calls (setup, ``synchronize``, ``close``) release the GIL, so a rank waiting on a
stuck peer stalls only its own thread. The device tests need a CUDA driver and device (not
torch): they skip with the reason printed without one, and fail instead under
``REQUIRE_GPU=1``. The registry test runs everywhere.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

import symm_allreduce as sar
from symm_allreduce import _native


@pytest.fixture(scope="module")
def device() -> int:
    try:
        n = sar.device_count()
        why = None if n > 0 else "no CUDA device"
    except sar.UnavailableError as e:
        why = f"no CUDA device: {e}"
    if why is None and not sar.kernels_available():
        why = "this build has no kernels"
    if why is None:
        return 0
    if os.environ.get("REQUIRE_GPU") == "1":
        pytest.fail(f"REQUIRE_GPU=1 but {why}")
    print(f"SKIP: {why}")
    pytest.skip(why)


def _in_thread(fn, timeout=60.0):
    """Runs fn() on a new thread; returns its result or re-raises what it raised there."""
    box: dict[str, object] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the test's thread
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the thread is still running after {timeout} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def _capsule_address(capsule) -> int:
    """The data pointer of a DLPack capsule (DLManagedTensor's first field), without torch."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    return ctypes.c_void_p.from_address(managed).value


def test_a_communicator_is_usable_from_another_thread(device):
    comms = _native.local_group(2, device, timeout=2.0, capacity_bytes=1 << 20, pool_bytes=2 << 20)
    try:
        c = comms[0]
        here = (c.rank, c.world_size, c.describe(), c.path(8192, "bfloat16"), c.config())
        there = _in_thread(lambda: (c.rank, c.world_size, c.describe(), c.path(8192, "bfloat16"), c.config()))
        assert there == here
        _in_thread(lambda: c.synchronize(0))  # the legacy stream of the rank's device
        _in_thread(c.check_usable)
        # An error raised on that thread is the package's exception, as on the main thread.
        with pytest.raises(sar.InvalidCallError, match="unsupported dtype"):
            _in_thread(lambda: c.path(8192, "float64"))
        # Closed on another thread: every thread then sees it closed.
        _in_thread(c.close)
        assert c.closed
        with pytest.raises(sar.InvalidCallError, match="closed"):
            c.describe()
        c.close()  # idempotent
    finally:
        for c in comms:
            c.close()


def test_a_thread_waiting_on_a_stuck_peer_does_not_hold_the_gil(device):
    """Rank 1 never calls: rank 0's all-reduce waits on the device for the timeout, and a
    thread in ``synchronize`` waits for it. Meanwhile this thread keeps running Python (it
    could not if the wait held the GIL), and the waiting thread gets ``PeerTimeoutError``
    within twice the timeout."""
    timeout = 1.0
    comms = _native.local_group(2, device, timeout=timeout, capacity_bytes=1 << 20, pool_bytes=2 << 20)
    try:
        c = comms[0]
        n = 4096
        capsule = c.alloc_symmetric([n], "float32")  # device memory without torch
        desc = (_capsule_address(capsule), n, "float32", "cuda", device, True)
        c.all_reduce(desc, desc, 0, "one_shot")  # in place, on the legacy stream; rank 1 never comes
        started = time.monotonic()
        outcome: dict[str, object] = {}

        def wait():
            try:
                c.synchronize(0)
            except sar.PeerTimeoutError as e:
                outcome["error"] = e
            outcome["elapsed"] = time.monotonic() - started

        t = threading.Thread(target=wait)
        t.start()
        ticks = 0
        while t.is_alive():
            ticks += 1
            time.sleep(0.001)
        t.join()
        elapsed = outcome["elapsed"]
        assert isinstance(outcome.get("error"), sar.PeerTimeoutError), outcome
        assert elapsed < 2 * timeout, f"PeerTimeout after {elapsed:.2f} s (timeout {timeout} s)"
        # About one tick per millisecond while the other thread waited ~timeout; a wait that
        # held the GIL would leave this thread a handful at most.
        assert ticks > 100 * timeout, f"this thread ran only {ticks} times in {elapsed:.2f} s"
        print(f"PeerTimeout on another thread after {elapsed:.3f} s; this thread ran {ticks} times meanwhile")
        del capsule
    finally:
        for c in comms:
            c.close()


def test_group_constructors_and_handles_from_many_threads(monkeypatch):
    """The Python layer from several threads at once: group constructors (disabled here: a
    peer refuses) and the registry of handles that the torch.library ops look up, where every
    communicator gets its own handle and closes from other threads remove the right one."""
    import socket
    import sys
    import types

    class Dist:
        def get_rank(self, group=None):
            return 0

        def get_world_size(self, group=None):
            return 2

        def all_gather_object(self, out, obj, group=None):
            out[0], out[1] = obj, (socket.gethostname(), "a peer's verdict")

    dist = Dist()
    torch = types.ModuleType("torch")
    torch.distributed = dist  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(current_device=lambda: 0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    made: list[sar.SymmAllReduce] = []
    lock = threading.Lock()

    def make():
        for _ in range(50):
            comm = sar.SymmAllReduce(object(), device=0)
            assert comm.disabled and comm.reason == "rank 1: a peer's verdict"
            comm._register()  # as a communicator that came up registers itself
            with lock:
                made.append(comm)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 200
    assert len({c.handle for c in made}) == 200 and 0 not in {c.handle for c in made}
    assert all(sar.lookup(c.handle) is c for c in made)
    _in_thread(lambda: [c.close() for c in made])
    for c in made:
        with pytest.raises(sar.InvalidCallError, match="no live"):
            sar.lookup(c.handle)
