"""L2 prefetch of weights a later kernel of the decode step will stream (Hopper: ``cp.async.bulk.prefetch.L2``).

At one token a decode step's kernels are mostly latency-bound: HBM idles through the MoE's routing and barriers,
the delta rule and the small norms, then each GEMV streams its weights at ~75% of the copy rate from a cold start.
:func:`l2_prefetch` asks L2 for a weight's bytes ahead of the GEMM that reads them (a side branch of the decode
graph, `vibeqwen.model.qwen`), so that the GEMM finds them there. It is a hint: nothing waits for it, and the
results are the same bits with or without it. Measured in ``bench/kernels/bench_l2_prefetch.py`` (the GEMM alone
after a prefetch) and ``bench/decode_ab.py`` (``VIBEQWEN_L2_PREFETCH`` variants: :func:`prefetch_plan`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

#: bytes a prefetch instruction asks for (one lane each)
PIECE = 8192
#: where the decode step may issue a prefetch (``VIBEQWEN_L2_PREFETCH``): "in" forks before layer i's mixer and asks
#: for layer i's output projection (streamed by the mixer's last GEMM, after its latency-bound input projection /
#: delta rule / attention); "moe" forks before layer i's MoE and "out" before layer i's output projection, each
#: asking for layer i + 1's input projection
POINTS = ("in", "moe", "out")


def prefetch_plan() -> dict[str, float]:
    """``VIBEQWEN_L2_PREFETCH`` as {fork point: fraction}; empty (unset or "0": no prefetch) by default.

    The value joins ``POINT`` or ``POINT:FRACTION`` items with "+" (e.g. ``in+moe:0.5``): at fork point POINT
    (:data:`POINTS`; "moe" and "out" exclude each other: both ask for the same weights) a side branch asks L2 for
    FRACTION (0 < f <= 1, default 1) of each 16-row tile of the weights, from the tile's start (the part its GEMM
    reads first). Read when a graph is captured.

    Raises:
        ValueError: another value, naming the variable."""
    v = os.environ.get("VIBEQWEN_L2_PREFETCH", "0")
    if v in ("", "0"):
        return {}
    plan: dict[str, float] = {}
    for item in v.split("+"):
        point, _, frac = item.partition(":")
        try:
            f = float(frac) if frac else 1.0
        except ValueError:
            f = -1.0
        if point not in POINTS or not 0 < f <= 1 or point in plan:
            plan = {}
            break
        plan[point] = f
    if not plan or {"moe", "out"} <= set(plan):
        raise ValueError(f"VIBEQWEN_L2_PREFETCH must be 0 or POINT[:FRACTION] items joined by '+', POINT in {POINTS} "
                         f"(each once; not both moe and out), 0 < FRACTION <= 1; got {v!r}")
    return plan


def l2_prefetch(tensors: Sequence[torch.Tensor], row_bytes: Sequence[int], fraction: float = 1.0) -> None:
    """Ask L2 for the first ``fraction`` of every ``row_bytes[i]``-byte row of ``tensors[i]`` (one launch each).

    Args:
        tensors: contiguous CUDA tensors, 16-byte aligned, each a whole number of rows of ``row_bytes[i]`` bytes
            (e.g. the FP8 MMA codes: a 16-row tile is ``16 K`` bytes, read from its start by the GEMM).
        row_bytes: bytes per row of each tensor, multiples of 16.
        fraction: 0 < fraction <= 1; the bytes asked for in each row are rounded up to a whole :data:`PIECE`
            (at most the row).

    Raises:
        ValueError: a tensor that is not contiguous on a CUDA device, misaligned, or not whole rows; a bad
            fraction or row size.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"l2_prefetch: fraction must be in (0, 1], got {fraction}")
    if len(tensors) != len(row_bytes):
        raise ValueError(f"l2_prefetch: {len(tensors)} tensors but {len(row_bytes)} row sizes")
    for t, rb in zip(tensors, row_bytes):
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cuda" or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("l2_prefetch: tensors must be contiguous, 16-byte aligned CUDA tensors")
        if rb <= 0 or rb % 16 or nbytes % rb:
            raise ValueError(f"l2_prefetch: row_bytes {rb} must be a positive multiple of 16 dividing the "
                             f"tensor's {nbytes} bytes")
    from vibeqwen_kernels._l2_prefetch_kernels import _l2_prefetch_kernel
    from vibeqwen_kernels.pdl import pdl_launch

    for t, rb in zip(tensors, row_bytes):
        n_rows = t.numel() * t.element_size() // rb
        per_row = -(-int(rb * fraction) // PIECE) if rb > PIECE else 1
        per_row = max(1, min(per_row, -(-rb // PIECE)))
        n_pieces = n_rows * per_row
        lanes = 32
        _l2_prefetch_kernel[(-(-n_pieces // lanes),)](t.data_ptr(), rb, per_row, n_pieces, PIECE_B=PIECE,
                                                      LANES=lanes, num_warps=1, **pdl_launch(t.device))
