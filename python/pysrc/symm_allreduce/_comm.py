"""The communicator class, shaped like vLLM's ``CustomAllreduce`` and SGLang's custom
all-reduce object."""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import _native
from ._tensor import CODE_SIZES, PLAIN_TYPES, SUM_CODES, Descriptor, TensorLike, describe
from .errors import SymmAllReduceError

if TYPE_CHECKING:
    import torch

#: Every ``Config`` field, accepted as a keyword argument by :class:`SymmAllReduce` and
#: :func:`local_group` (``timeout`` in seconds, ``tuning`` a table file, ``algorithm`` and
#: ``multicast`` by name).
CONFIG_KEYS: tuple[str, ...] = tuple(_native.CONFIG_KEYS)

#: The dtypes the reductions sum (``torch`` names).
REDUCE_DTYPES: tuple[str, ...] = tuple(_native.dtypes()[0])

#: The dtypes the gathers move.
GATHER_DTYPES: tuple[str, ...] = tuple(_native.dtypes()[1])

#: Element size in bytes of each summable dtype, by its name with and without ``torch.``.
_REDUCE_SIZES: dict[str, int] = {
    prefix + name: int(_native.element_size(name)) for name in REDUCE_DTYPES for prefix in ("", "torch.")
}

#: The hot-path code of each algorithm name (``_native.algorithm_code``): the canonical names
#: up front, an alias once it has been used.
_ALGORITHM_CODES: dict[str, int] = {name: code for code, name in enumerate(_native.ALGORITHMS)}
_AUTO = _ALGORITHM_CODES["auto"]


def _algorithm_code(name: str) -> int:
    """The code of an algorithm name not seen yet (raises ``InvalidCallError`` with the crate's
    text for an unknown one, as the native call would); remembered when valid."""
    code = int(_native.algorithm_code(name))
    _ALGORITHM_CODES[name] = code  # only valid spellings get here: a few dozen at most
    return code


# Live communicators by handle, for the torch.library ops (which take the handle as an int).
# Both are safe from several threads (one dict store or pop, one `next` of a C iterator).
_REGISTRY: dict[int, SymmAllReduce] = {}
_HANDLES = itertools.count(1)

_TORCH: Any = None
_CURRENT_STREAM: Callable[[int], int] | None = None


def _torch() -> Any:
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH


def _bind_current_stream() -> Callable[[int], int]:
    """The cheapest reader of the current stream's handle: torch's own raw-stream accessor
    (what torch.compile's generated code calls; one C call, no ``torch.cuda.Stream`` object),
    else the public ``current_stream(device).cuda_stream``."""
    global _CURRENT_STREAM
    torch = _torch()
    torch.cuda.init()  # the raw accessor does not initialise CUDA in torch by itself
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:

        def raw(device: int) -> int:
            return int(torch.cuda.current_stream(device).cuda_stream)

    _CURRENT_STREAM = raw
    return raw


def _stream(device: int) -> int:
    """The handle of the current CUDA stream of ``device`` (an int; checked by the native
    module to belong to the communicator's device)."""
    current = _CURRENT_STREAM
    if current is None:
        current = _bind_current_stream()
    return current(device)


def validate_config(**config: Any) -> dict[str, Any]:
    """Checks keyword arguments as a ``Config`` (raising :class:`InvalidCallError` with the
    crate's text) and returns every field, defaults filled in."""
    return dict(_native.validate_config(**config))


def kernels_available() -> bool:
    """Whether the CUDA kernels are compiled into this build (True in every wheel built with
    nvcc)."""
    return bool(_native.kernels_available())


def _device_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None:
        text = str(device)
        if ":" in text:
            return int(text.rsplit(":", 1)[1])
        return int(_torch().cuda.current_device())
    return int(index)


class SymmAllReduce:
    """One rank's all-reduce communicator over torch tensors.

    ``SymmAllReduce(group, device, max_size)`` is a collective constructor over a
    ``torch.distributed`` process group (a CPU/gloo group, as vLLM's and SGLang's custom
    all-reduce take): setup bytes travel through the group, the memory handles over the
    crate's local socket exchange. It never raises: a group that cannot run the peer
    kernels (several hosts, no peer access, a world of one, no kernels in the build, a bad
    configuration) comes up with ``disabled`` True and ``reason`` saying why, so a stack
    falls through to NCCL. Every ``Config`` field is a keyword (``max_size`` is
    ``capacity_bytes``).

    Calls run on the current CUDA stream of ``device``; every rank makes the same calls in
    the same order. Sums are fp32 in rank order: every rank gets the same bits.
    """

    disabled: bool
    reason: str | None

    def __init__(
        self,
        group: Any = None,
        device: Any = None,
        max_size: int = 8192 * 1024,
        **config: Any,
    ) -> None:
        self.disabled = True
        self.reason = None
        self._native: Any | None = None
        self._device = 0
        self._rank = 0
        self._world = 1
        self.max_size = int(config.pop("capacity_bytes", max_size))
        self.handle = 0
        try:
            self._setup(group, device, config)
        except SymmAllReduceError as e:
            self.reason = str(e)
        except Exception as e:  # a broken group: the stack falls through, as for the rest
            self.reason = f"setup failed: {type(e).__name__}: {e}"
        if self._native is not None:
            self._register()

    def _setup(self, group: Any, device: Any, config: dict[str, Any]) -> None:
        import torch.distributed as dist

        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._device = _device_index(device if device is not None else _torch().cuda.current_device())

        def gather(payload: Any) -> list[Any]:
            out: list[Any] = [None] * self._world
            dist.all_gather_object(out, payload, group=group)
            return out

        # Every rank's verdict first, so that all come up disabled together (a rank that
        # refused alone would leave the others waiting in the setup's exchanges).
        why: str | None = None
        try:
            validate_config(capacity_bytes=self.max_size, **config)
        except SymmAllReduceError as e:
            why = str(e)
        if why is None and not kernels_available():
            why = "the CUDA kernels are not in this build of symm_allreduce (built without nvcc)"
        if why is None and self._world == 1:
            why = "a group of one rank has nothing to reduce"
        if why is None and self._world > _native.MAX_RANKS:
            why = f"the group has {self._world} ranks; symm-allreduce takes at most {_native.MAX_RANKS}"
        verdicts = gather((socket.gethostname(), why))
        hosts = sorted({h for h, _ in verdicts})
        if len(hosts) > 1:
            self.reason = (
                f"the group spans {len(hosts)} hosts ({', '.join(hosts)}): symm-allreduce is single-node; "
                "use NCCL for this group"
            )
            return
        for rank, (_, w) in enumerate(verdicts):
            if w is not None:
                self.reason = w if rank == self._rank else f"rank {rank}: {w}"
                return
        native = _native.from_gather(
            self._rank, self._world, self._device, gather, capacity_bytes=self.max_size, **config
        )
        self._adopt(native)

    def _adopt(self, native: Any) -> None:
        self._native = native
        self._rank = int(native.rank)
        self._world = int(native.world_size)
        self._device = int(native.device)
        self.max_size = int(native.config()["capacity_bytes"])
        self.disabled = not native.has_peer_kernels
        self.reason = native.peer_kernels_unavailable

    def _register(self) -> None:
        self.handle = next(_HANDLES)
        _REGISTRY[self.handle] = self

    @classmethod
    def _wrap(cls, native: Any) -> SymmAllReduce:
        self = cls.__new__(cls)
        self.disabled = True
        self.reason = None
        self.max_size = 0
        self.handle = 0
        self._adopt(native)
        self._register()
        return self

    # ---- properties ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world

    @property
    def device(self) -> int:
        """The CUDA device index this rank runs on."""
        return self._device

    def _live(self) -> Any:
        if self._native is None:
            from .errors import UnavailableError

            e = UnavailableError(f"this communicator is disabled: {self.reason}")
            e.kind = "Disabled"
            raise e
        return self._native

    # ---- vLLM / SGLang surface ----------------------------------------------------------

    def should_custom_ar(self, inp: TensorLike) -> bool:
        """Whether :meth:`custom_all_reduce` takes ``inp``: enabled, a contiguous CUDA tensor of
        this rank's device, a summable dtype, 1 to ``max_size`` bytes."""
        if self.disabled or self._native is None:
            return False
        if type(inp) in PLAIN_TYPES:
            return self._plain_kind(inp) is not None
        return self._takes(describe(inp))

    def _plain_kind(self, t: Any) -> int | None:
        """The dtype code of a plain torch tensor that :meth:`custom_all_reduce` takes, else
        None (what :meth:`_takes` says of its descriptor, read through torch directly)."""
        kind = SUM_CODES.get(t.dtype)
        if kind is None or not (t.get_device() == self._device and t.is_contiguous()):
            return None
        n = t.numel()
        return kind if 0 < n and n * CODE_SIZES[kind] <= self.max_size else None

    def _takes(self, d: Descriptor) -> bool:
        if d[3] != "cuda" or d[4] != self._device or not d[5] or d[1] == 0:
            return False
        size = _REDUCE_SIZES.get(d[2])
        return size is not None and d[1] * size <= self.max_size

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``input`` over the ranks in a new tensor, or ``None`` when this
        communicator does not take it (the caller then falls through to NCCL)."""
        native = self._native
        if self.disabled or native is None:
            return None
        if type(input) in PLAIN_TYPES:
            # The hot path (as in all_reduce), with the checks of _plain_kind inline.
            dev = self._device
            kind = SUM_CODES.get(input.dtype)
            if kind is None or not (input.get_device() == dev and input.is_contiguous()):
                return None
            n = input.numel()
            if n == 0 or n * CODE_SIZES[kind] > self.max_size:
                return None
            torch = _TORCH or _torch()
            out = torch.empty_like(input, memory_format=torch.contiguous_format)
            current = _CURRENT_STREAM or _bind_current_stream()
            native.all_reduce_ptr(input.data_ptr(), n, out.data_ptr(), n, kind, current(dev), _AUTO)
            return out
        d = describe(input)
        if not self._takes(d):
            return None
        return self._all_reduce(native, input, d, None, "auto")

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """A context manager for a stack's graph-capture code. A no-op: nothing is registered
        around capture (calls inside ``torch.cuda.graph`` are captured as they are)."""
        yield

    # ---- collectives --------------------------------------------------------------------

    def all_reduce(
        self, inp: torch.Tensor, out: torch.Tensor | None = None, *, algorithm: str = "auto"
    ) -> torch.Tensor:
        """``out ← Σ_ranks inp`` (a new tensor of ``inp``'s shape when ``out`` is None; ``out``
        may be ``inp`` for an in-place sum; an :meth:`alloc_symmetric` tensor is reduced like
        any tensor)."""
        native = self._native
        if native is None:
            native = self._live()
        code = _ALGORITHM_CODES.get(algorithm)
        if code is None:
            code = _algorithm_code(algorithm)
        # The hot path: plain torch tensors, read and checked through torch (no descriptor
        # tuples, no string per call; see _native.Communicator.all_reduce_ptr). Anything
        # else, and anything it refuses, takes the checked path, which raises the precise error.
        # `get_device()` is -1 off CUDA (and the communicator's device is >= 0): no `is_cuda`.
        dev = self._device
        if type(inp) in PLAIN_TYPES and inp.get_device() == dev and inp.is_contiguous():
            dtype = inp.dtype
            kind = SUM_CODES.get(dtype)
            if kind is not None:
                current = _CURRENT_STREAM or _bind_current_stream()
                ptr = inp.data_ptr()
                n = inp.numel()
                if out is None:
                    torch = _TORCH or _torch()
                    out = torch.empty_like(inp, memory_format=torch.contiguous_format)
                    native.all_reduce_ptr(ptr, n, out.data_ptr(), n, kind, current(dev), code)
                    return out
                if out is inp:
                    native.all_reduce_ptr(ptr, n, ptr, n, kind, current(dev), code)
                    return out
                if (
                    type(out) in PLAIN_TYPES
                    and out.dtype is dtype
                    and out.get_device() == dev
                    and out.is_contiguous()
                ):
                    native.all_reduce_ptr(ptr, n, out.data_ptr(), out.numel(), kind, current(dev), code)
                    return out
        return self._all_reduce(native, inp, describe(inp), out, algorithm)

    def _all_reduce(
        self, native: Any, inp: torch.Tensor, d: Descriptor, out: torch.Tensor | None, algorithm: str
    ) -> torch.Tensor:
        """The one call path of :meth:`all_reduce` and :meth:`custom_all_reduce` (``d``:
        ``inp``'s descriptor, made once per call)."""
        if out is None:
            torch = _torch()
            out = torch.empty_like(inp, memory_format=torch.contiguous_format)
        native.all_reduce(d, d if out is inp else describe(out), _stream(self._device), algorithm)
        return out

    def all_reduce_pool(self, t: torch.Tensor) -> torch.Tensor:
        """``t ← Σ_ranks t`` in place for a tensor from :meth:`alloc_symmetric` (the whole
        tensor): every rank calls it with its tensor of the same allocation. In the low-latency
        and one-shot ranges it takes the kernel an ordinary tensor would (the low-latency
        kernel copies nothing in; the one-shot's copy-in costs less than a second barrier),
        above them the zero-copy kernel that reads every rank's copy in place. Any other tensor
        raises ``InvalidCallError`` (``ForeignPoolBuffer``) before anything runs."""
        self._live().all_reduce_pool(describe(t), _stream(self._device))
        return t

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``inp`` stacked rank-major: shape ``(world, *inp.shape)`` by default
        (any tensor of ``world · inp.numel()`` elements as ``out``)."""
        native = self._live()
        if out is None:
            out = _torch().empty((self._world, *inp.shape), dtype=inp.dtype, device=inp.device)
        native.all_gather(describe(inp), describe(out), _stream(self._device))
        return out

    def all_gather_v(
        self, inp: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rank q's ``sizes[q]`` rows (along dim 0) concatenated in rank order: shape
        ``(sum(sizes), *inp.shape[1:])``. ``sizes`` is the same on every rank and
        ``sizes[rank] == inp.shape[0]``."""
        native = self._live()
        row = 1
        for d in inp.shape[1:]:
            row *= int(d)
        if out is None:
            out = _torch().empty((sum(sizes), *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        counts = [int(s) * row for s in sizes]
        native.all_gather_v(describe(inp), counts, describe(out), _stream(self._device))
        return out

    def reduce_scatter(
        self, inp: torch.Tensor, out: torch.Tensor | None = None, *, algorithm: str = "auto"
    ) -> torch.Tensor:
        """This rank's slice of ``Σ_ranks inp``: ``inp`` split along dim 0 into ``world``
        equal parts (flat when dim 0 does not divide), part ``rank`` of the sum."""
        native = self._live()
        if out is None:
            shape: tuple[int, ...]
            if inp.dim() > 0 and inp.shape[0] % self._world == 0:
                shape = (inp.shape[0] // self._world, *inp.shape[1:])
            else:
                shape = (inp.numel() // self._world,)
            out = _torch().empty(shape, dtype=inp.dtype, device=inp.device)
        native.reduce_scatter(describe(inp), describe(out), _stream(self._device), algorithm)
        return out

    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        out: torch.Tensor | None = None,
        *,
        algorithm: str = "auto",
    ) -> torch.Tensor:
        """All-reduce + residual add + RMSNorm in one kernel over ``[tokens, hidden]`` rows:
        ``residual ← residual + Σ_ranks x`` (in place) and the result
        ``RMSNorm(residual) · weight`` (returned; ``out`` if given). Bit-identical to
        :meth:`all_reduce` followed by the same epilogue."""
        native = self._live()
        if out is None:
            out = _torch().empty(x.shape, dtype=x.dtype, device=x.device)
        native.all_reduce_add_rmsnorm(
            describe(x),
            describe(residual),
            describe(weight),
            float(eps),
            describe(out),
            _stream(self._device),
            algorithm,
        )
        return out

    def alloc_symmetric(self, shape: int | Sequence[int], dtype: Any) -> torch.Tensor:
        """A tensor over this communicator's symmetric pool (``pool_bytes``), mapped by every
        rank: :meth:`all_reduce_pool` reduces it (zero-copy above the one-shot range;
        :meth:`all_reduce` like any tensor). Collective: every rank allocates (and frees, by
        dropping the tensors) in the same order with the same shapes."""
        native = self._live()
        dims = [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]
        capsule = native.alloc_symmetric(dims, str(dtype))
        return _torch().utils.dlpack.from_dlpack(capsule)

    # ---- introspection and lifetime -----------------------------------------------------

    def describe(self) -> str:
        """The crate's setup report (topology, paths per size), or why it is disabled."""
        if self._native is None:
            return f"symm_allreduce: disabled: {self.reason}"
        text = str(self._native.describe())
        if self.disabled:
            text = f"symm_allreduce: disabled: {self.reason}\n{text}"
        return text

    def path(self, nbytes: int, dtype: Any, algorithm: str = "auto") -> str:
        """Where an all-reduce of ``nbytes`` bytes of ``dtype`` goes (low-latency, one-shot,
        two-shot) and why."""
        return str(self._live().path(int(nbytes), str(dtype), algorithm))

    def config(self) -> dict[str, Any]:
        """Every ``Config`` field as the communicator uses it."""
        return dict(self._live().config())

    def synchronize(self) -> None:
        """Waits for this rank's calls on the current stream and raises a peer timeout (or a
        kernel fault) they hit."""
        self._live().synchronize(_stream(self._device))

    def check_usable(self) -> None:
        """Raises the error that made the communicator unusable, if any."""
        self._live().check_usable()

    def close(self) -> None:
        """Releases the workspace (collective in a process group: every rank calls it).
        Idempotent; pool tensors keep the memory mapped until they are freed."""
        _REGISTRY.pop(self.handle, None)
        if self._native is not None:
            self._native.close()
        self.disabled = True
        self.reason = self.reason or "closed"

    def __repr__(self) -> str:
        state = f"disabled: {self.reason}" if self.disabled else f"max_size={self.max_size}"
        return f"SymmAllReduce(rank={self._rank}, world={self._world}, device={self._device}, {state})"


def local_group(world: int, device: Any = 0, **config: Any) -> list[SymmAllReduce]:
    """``world`` virtual ranks on one GPU in this process (tests, notebooks): element r is rank
    r. Each rank must run on its own stream (the ranks' kernels wait for each other on the
    device); ``with torch.cuda.stream(s[r]): comms[r].all_reduce(...)``. Raises (unlike the
    group constructor) when setup fails."""
    natives = _native.local_group(int(world), _device_index(device), **config)
    return [SymmAllReduce._wrap(n) for n in natives]


def lookup(handle: int) -> SymmAllReduce:
    """The live communicator with this ``handle`` (for the torch.library ops)."""
    try:
        return _REGISTRY[handle]
    except KeyError:
        from .errors import InvalidCallError

        e = InvalidCallError(f"no live symm_allreduce communicator has handle {handle}")
        e.kind = "InvalidCall"
        raise e from None
