"""Tensors as the plain descriptors the native module validates (duck-typed: anything with
``data_ptr()``, ``numel()``, ``dtype``, ``device`` and ``is_contiguous()``).

This is the checked path: a torch tensor is read through five C-level accessors (no
``torch.device`` object, no ``str(dtype)`` after the first call for a dtype); any other
object through the generic attributes. What the values mean is checked by the native module
on every call, whatever made them (the driver is asked where the memory is).

The all-reduce's hot path (``SymmAllReduce.all_reduce``) does not build descriptors for plain
torch tensors (:data:`PLAIN_TYPES`, filled the first time a torch tensor is described): it
reads them through the same accessors, checks them against the communicator, and passes
the address, the length and the dtype's code (:data:`SUM_CODES`) as integers.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

#: ``(data_ptr, numel, dtype name, device type, device index, is_contiguous)``.
Descriptor = tuple[int, int, str, str, int, bool]


class TensorLike(Protocol):
    """What a tensor argument needs (``torch.Tensor`` has it)."""

    @property
    def dtype(self) -> Any: ...

    @property
    def device(self) -> Any: ...

    def data_ptr(self) -> int: ...

    def numel(self) -> int: ...

    def is_contiguous(self) -> bool: ...


# dtype object -> its name (``torch.bfloat16`` -> "torch.bfloat16"); bounded, so that odd
# duck-typed dtypes cannot grow it without end.
_DTYPE_NAMES: dict[Any, str] = {}
_DTYPE_NAMES_MAX = 64

# Classes known to be torch.Tensor (or a subclass), read through the fast path, and classes
# known not to be (bounded, as the dtype names).
_TORCH_TYPES: set[type] = set()
_OTHER_TYPES: set[type] = set()

#: The exact classes whose accessors are torch's own (``torch.Tensor``, ``torch.nn.Parameter``;
#: no subclass that could override them): the hot path trusts what they report. Empty until
#: the first torch tensor is described.
PLAIN_TYPES: set[type] = set()

#: The hot-path code (``_native.dtype_code``) of each summable torch dtype object.
SUM_CODES: dict[Any, int] = {}

#: Element size in bytes of each hot-path dtype code.
CODE_SIZES: dict[int, int] = {}


def dtype_name(dtype: Any) -> str:
    """``str(dtype)``, remembered per dtype object."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = str(dtype)
        if len(_DTYPE_NAMES) < _DTYPE_NAMES_MAX:
            _DTYPE_NAMES[dtype] = name
        return name
    except TypeError:  # an unhashable duck-typed dtype
        return str(dtype)


def _is_torch_tensor(t: object) -> bool:
    cls = type(t)
    if cls in _TORCH_TYPES:
        return True
    if cls in _OTHER_TYPES:
        return False
    torch = sys.modules.get("torch")
    if torch is None:  # not remembered: torch may be imported later
        return False
    if isinstance(t, torch.Tensor):
        _TORCH_TYPES.add(cls)
        if not PLAIN_TYPES:
            _register_torch(torch)
        return True
    if len(_OTHER_TYPES) < _DTYPE_NAMES_MAX:
        _OTHER_TYPES.add(cls)
    return False


def _register_torch(torch: Any) -> None:
    """Fills :data:`SUM_CODES` and :data:`CODE_SIZES`, then :data:`PLAIN_TYPES` (last: the
    hot path looks there first)."""
    from . import _native

    for name in _native.dtypes()[0]:
        dtype = getattr(torch, name, None)
        if dtype is not None:
            code = int(_native.dtype_code(name))
            CODE_SIZES[code] = int(_native.element_size(name))
            SUM_CODES[dtype] = code
    PLAIN_TYPES.update((torch.Tensor, torch.nn.Parameter))


def describe(t: TensorLike) -> Descriptor:
    """The descriptor of ``t``; the device index of a bare ``cuda`` device is -1 (refused)."""
    if _is_torch_tensor(t):
        tt: Any = t
        if tt.is_cuda:
            return (
                tt.data_ptr(),
                tt.numel(),
                dtype_name(tt.dtype),
                "cuda",
                tt.get_device(),
                tt.is_contiguous(),
            )
    device = t.device
    kind = getattr(device, "type", str(device))
    index = getattr(device, "index", None)
    return (
        int(t.data_ptr()),
        int(t.numel()),
        dtype_name(t.dtype),
        str(kind),
        -1 if index is None else int(index),
        bool(t.is_contiguous()),
    )
