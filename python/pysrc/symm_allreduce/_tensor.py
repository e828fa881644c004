"""Tensors as the plain descriptors the native module validates (duck-typed: anything with
``data_ptr()``, ``numel()``, ``dtype``, ``device`` and ``is_contiguous()``)."""

from __future__ import annotations

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


def describe(t: TensorLike) -> Descriptor:
    """The descriptor of ``t``; the device index of a bare ``cuda`` device is -1 (refused)."""
    device = t.device
    kind = getattr(device, "type", str(device))
    index = getattr(device, "index", None)
    return (
        int(t.data_ptr()),
        int(t.numel()),
        str(t.dtype),
        str(kind),
        -1 if index is None else int(index),
        bool(t.is_contiguous()),
    )
