"""Environment switches of the kernels' A/B measurements: ``VIBEQWEN_...=0`` / ``=1`` read at every call (so a CUDA
graph keeps the path it was captured with)."""

from __future__ import annotations

import os

__all__ = ["env_switch"]


def env_switch(name: str, default: str) -> bool:
    """Environment variable ``name`` (``default`` where unset) as a switch: "1" on, "0" off.

    Raises:
        ValueError: another value, naming the variable."""
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"
