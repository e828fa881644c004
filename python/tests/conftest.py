"""GPU tests skip with the reason printed when there is no torch or no GPU, and fail instead
under ``REQUIRE_GPU=1``."""

from __future__ import annotations

import os

import pytest


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


@pytest.fixture(scope="session")
def gpu() -> None:
    why = _gpu_missing()
    if why is None:
        return
    if os.environ.get("REQUIRE_GPU") == "1":
        pytest.fail(f"REQUIRE_GPU=1 but {why}")
    print(f"SKIP: {why}")
    pytest.skip(why)
