"""The decode router in one CUDA launch (``csrc/bf16_mma.cu``): router GEMM, top-k routing, shared-expert gate and
the expert alignment that :func:`~vibeqwen_kernels.moe.fused.fused_moe`'s grouped GEMMs read.

Replaces, for 1-64 tokens (the model uses it up to :func:`route_model_max_t`), the cuBLAS router GEMM,
:func:`~vibeqwen_kernels.moe.fused.fused_router` and :func:`~vibeqwen_kernels.moe.fused.moe_align` (3-5 launches a
layer). Same results: the logits are the bf16 GEMM output the reference rounds to (fp32 sums in another order: a
logit can differ by one bf16 ulp), the ids those of :func:`~vibeqwen_kernels.moe.naive.route_topk_ref` on these
logits, the weights to ~1e-6 relative (the kernel's softmax uses the fast exponential), the alignment position for
position :func:`~vibeqwen_kernels.moe.fused.moe_align`'s.

* :func:`prepack_router` -- the router and shared-gate rows -> :class:`RouterWeight`.
* :func:`fused_route` -- one launch.
* :func:`route_supported` -- whether a call can run here.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.bf16_mma import bf16_mma_library, shuffle_bf16_mma
from vibeqwen_kernels.pdl import pdl_mode

#: tokens per launch (the kernel's 8 n8 tiles)
ROUTE_MAX_T = 64
#: routed experts and top-k the kernel takes
ROUTE_MAX_EXPERTS = 512
ROUTE_MAX_TOP_K = 16
#: K must be a multiple of it (16 warps x a pair of k16 steps)
ROUTE_K_MULTIPLE = 512


@dataclass(frozen=True)
class RouterWeight:
    """A layer's router rows in the kernel's layout.

    Attributes:
        packed: bf16 ``[tiles, K / 16, 32, 8]`` (:func:`shuffle_bf16_mma` of the E router rows then the
            shared-expert gate row).
        num_experts: E, routed experts (row E is the shared gate).
        hidden: K.
        counter: uint32 (int32 storage) ``[1 + ROUTE_MAX_T / 8]``, zero: the kernel's counts of finished CTAs (all
            of them, then per token group: :func:`route_split`), back to zero after every launch. One per weight:
            launches of one weight must not run concurrently (one stream).
    """

    packed: torch.Tensor
    num_experts: int
    hidden: int
    counter: torch.Tensor

    @property
    def tiles(self) -> int:
        return self.packed.shape[0]


def prepack_router(router: torch.Tensor, shared_gate: torch.Tensor, packed: torch.Tensor | None = None) -> RouterWeight:
    """``gate.weight`` bf16 ``[E, K]`` and ``shared_expert_gate.weight`` ``[1, K]`` -> :class:`RouterWeight` on their
    device. ``packed``: an existing :func:`shuffle_bf16_mma` of exactly those E + 1 rows followed by zero rows (e.g.
    the padded router GEMM weight's MMA copy), used instead of a new copy.

    Raises:
        ValueError: other shapes, E > 512, or a ``packed`` of the wrong shape.
    """
    if (router.dim() != 2 or shared_gate.dim() != 2 or shared_gate.shape[0] != 1
            or shared_gate.shape[1] != router.shape[1]):
        raise ValueError(f"prepack_router: need router [E, K] and shared gate [1, K], got {tuple(router.shape)} and "
                         f"{tuple(shared_gate.shape)}")
    e, k = router.shape
    if e > ROUTE_MAX_EXPERTS:
        raise ValueError(f"prepack_router: the kernel takes at most {ROUTE_MAX_EXPERTS} routed experts, got {e}")
    tiles = -(-(e + 1) // 16)
    if packed is None:
        packed = shuffle_bf16_mma(torch.cat([router, shared_gate]).to(torch.bfloat16))
    elif tuple(packed.shape) != (tiles, k // 16, 32, 8) or packed.dtype != torch.bfloat16:
        raise ValueError(f"prepack_router: packed must be bf16 [{tiles}, {k // 16}, 32, 8], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    return RouterWeight(packed=packed, num_experts=e, hidden=k,
                        counter=torch.zeros(1 + ROUTE_MAX_T // 8, dtype=torch.int32, device=router.device))


#: tokens up to which the model routes with the kernel (SparseMoE): all it takes. Per call (bench/kernels/bench_route.py),
#: cuBLAS GEMM + fused_router + moe_align / this kernel: H200, twenty-seventh session (token groups), T 8 14.95 / 7.89
#: us, 16 15.68 / 8.62, 32 16.00 / 10.72, 64 16.33 / 18.42 (one CTA routed the 64 tokens), so the model kept 32; H100,
#: thirty-eighth session, with the routing split by token group (:func:`route_split`): 32 16.33 / 9.90, 64 16.57 /
#: 14.20, and decode b64 13.478 / 13.464 ms against 13.576 / 13.510 with the limit at 32.
ROUTE_MODEL_MAX_T = 64


def route_model_max_t() -> int:
    """Tokens up to which the model routes with the kernel: :data:`ROUTE_MODEL_MAX_T`, or ``VIBEQWEN_ROUTE_MAX_T``
    (0 to 64; for measuring). Read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: a ``VIBEQWEN_ROUTE_MAX_T`` that is not an integer from 0 to 64.
    """
    v = os.environ.get("VIBEQWEN_ROUTE_MAX_T")
    if v is None:
        return ROUTE_MODEL_MAX_T
    if not v.strip().isdigit() or int(v) > ROUTE_MAX_T:
        raise ValueError(f"VIBEQWEN_ROUTE_MAX_T must be an integer from 0 to {ROUTE_MAX_T}, got {v!r}")
    return int(v)


def route_supported(w: RouterWeight, t: int, top_k: int, device: torch.device) -> bool:
    """Whether :func:`fused_route` can route ``t`` tokens of this weight here: 1 <= t <= ROUTE_MAX_T (64), K % 512
    == 0, E <= 512, top_k <= 16, the library built on ``device`` (sm_90+, nvcc), and neither ``VIBEQWEN_FUSED_ROUTE``
    nor ``VIBEQWEN_BF16_MMA`` ``0``. (The model also keeps to :func:`route_model_max_t` tokens, per call.)"""
    return (1 <= t <= ROUTE_MAX_T and w.hidden % ROUTE_K_MULTIPLE == 0 and w.num_experts <= ROUTE_MAX_EXPERTS
            and 1 <= top_k <= min(ROUTE_MAX_TOP_K, w.num_experts) and route_enabled(torch.device(device)))


#: routing warps of the kernel's last CTA from 17 tokens (one or two tokens each; 16 below)
ROUTE_WIDE_WARPS = 32


def route_warps(t: int) -> int:
    """The kernel's warps for ``t`` tokens: where one CTA routes every token (no :func:`route_split`),
    :data:`ROUTE_WIDE_WARPS` at 17-64 tokens (one routing warp a token up to 32, two tokens from 33; in the router
    GEMM the second 16 warps take the upper token tiles of a CTA with more than one, or idle), else 16.
    ``VIBEQWEN_ROUTE_WIDE=0`` keeps 16 (for measuring: the outputs are the same bit for bit). Read at every call, so
    a CUDA graph keeps what it was captured with."""
    if (16 < t <= ROUTE_MAX_T and os.environ.get("VIBEQWEN_ROUTE_WIDE", "1") != "0"
            and not route_split(t, route_groups(t))):
        return ROUTE_WIDE_WARPS
    return 16


def route_split(t: int, groups: int) -> bool:
    """Whether the kernel's routing is split by token group for ``t`` tokens in ``groups`` groups: from three groups
    (17+ tokens in groups of 8), the last CTA of each group routes its <= 8 tokens (a warp a token) and the last of
    those aligns, where otherwise one CTA routes every token (at 32 tokens 8.4k-9.3k clocks on 32 warps, H200 and
    H100: most of the launch). H100, thirty-eighth session, per call split / not: T 32 9.90 / 10.86 us, 64 14.20 /
    18.70, but 16 9.59 / 8.67 (two groups: the hand-off between the CTAs costs more than the routing it spreads);
    decode, one engine, b24 7.815 / 7.817 against 7.879 / 7.852 ms, b32 9.076 / 9.056 against 9.102 / 9.089.
    ``VIBEQWEN_ROUTE_SPLIT=0`` turns it off (for measuring: the outputs are the same bit for bit). Read at every
    call, like :func:`route_warps`."""
    return groups > 2 and os.environ.get("VIBEQWEN_ROUTE_SPLIT", "1") != "0"


def route_groups(t: int) -> int:
    """The kernel grid's token groups for ``t`` tokens: ceil(t / 8), one n8 token tile per CTA (17 x groups CTAs),
    or 1 with ``VIBEQWEN_ROUTE_GROUPS=0`` (every CTA all t tokens: each read all of x, its warps ran up to 8 token
    tiles; the earlier grid, for measuring). The same outputs bit for bit. Read at every call, like
    :func:`route_warps`."""
    return 1 if os.environ.get("VIBEQWEN_ROUTE_GROUPS") == "0" else -(-t // 8)


def route_batch_loads() -> bool:
    """Whether the kernel's routing lanes issue all of a token's logit loads before they use any (one L2 round trip;
    routers of <= 256 experts). Without it the compiler places each load next to its key: in the 32-token kernel's
    SASS (``moe_route_kernel<4, 8, 32, 1>``) the 9 loads come in batches of 2-3 with their uses between, ~4 round
    trips where one would do. The same outputs bit for bit. On by default since the forty-eighth session (its tests
    passed on an H100; with the tagged logits and shared-late switches of ``moe_decode``, decode b8 4.274 -> 4.240 ms
    there, b32 / b64 even); ``VIBEQWEN_ROUTE_BATCH_LOADS=0`` keeps the loads where the compiler puts them. Read at
    every call, like :func:`route_warps`."""
    return os.environ.get("VIBEQWEN_ROUTE_BATCH_LOADS", "1") != "0"


def route_enabled(device: torch.device) -> bool:
    """Whether the fused router may run on ``device``: the library builds there and neither ``VIBEQWEN_FUSED_ROUTE``
    nor ``VIBEQWEN_BF16_MMA`` is ``0``."""
    return (os.environ.get("VIBEQWEN_FUSED_ROUTE", "1") != "0" and os.environ.get("VIBEQWEN_BF16_MMA", "1") != "0"
            and bf16_mma_library(device) is not None)


def fused_route(x: torch.Tensor, w: RouterWeight, top_k: int, block_m: int, *, logits: torch.Tensor | None = None,
                debug: torch.Tensor | None = None):
    """Route 1-64 tokens and group their pairs by expert, in one launch.

    Args:
        x: bf16 ``[T, K]`` on the weight's device (last dim contiguous, rows 16-byte aligned; else copied).
        w: :class:`RouterWeight`.
        top_k: routed experts per token.
        block_m: the expert GEMMs' pairs per block (a power of two, e.g. 16).
        logits: optional fp32 ``[T, 16 * tiles]`` workspace (it receives the bf16-rounded logits of every row,
            padding rows included); default a new one.
        debug: optional int64 ``[16 + 2 * ctas]`` (profiling; ``ctas = tiles * route_groups(T)``, CTA ``c = y *
            tiles + tile``): each CTA's %globaltimer at its start (``[16 + c]``) and after its GEMM (``[16 + ctas +
            c]``); the last CTA's (with :func:`route_split`, the aligning CTA's, from its own group's routing) at
            the start / end of its routing (``[0]``, ``[1]``) and its clock64 at the start, after routing (the split:
            after every token's ids are read back), after the scan and at the end (``[8]``, ``[9]``, ``[11]``,
            ``[12]``); without the split, its first routing warp's clock64 once its keys are built, sorted, chosen
            and summed (``[2]`` .. ``[5]``; ``[13]`` is scratch).

    Returns:
        ``(topk_weights, topk_ids, sorted_ids, block_expert, num_padded)``: float32 / int32 ``[T, top_k + 1]`` as
        :func:`~vibeqwen_kernels.moe.fused.fused_router` (slot top_k: id E, sigmoid of the shared-gate logit),
        then :func:`~vibeqwen_kernels.moe.fused.moe_align`'s three outputs for E + 1 experts and ``block_m``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (x, top_k, block_m, K, logits, debug).
        RuntimeError: the library is unavailable on the device, or the launch failed.
    """
    from vibeqwen_kernels.moe.fused import align_bounds

    t = x.shape[0] if x.dim() == 2 else 0
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != w.hidden or not 1 <= t <= ROUTE_MAX_T:
        raise ValueError(f"fused_route: x must be bf16 [1..{ROUTE_MAX_T}, {w.hidden}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.device != w.packed.device:
        raise ValueError(f"fused_route: x is on {x.device}, the weight on {w.packed.device}")
    if not 1 <= top_k <= min(ROUTE_MAX_TOP_K, w.num_experts) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"fused_route: need 1 <= top_k <= {min(ROUTE_MAX_TOP_K, w.num_experts)} and block_m a "
                         f"power of two, got top_k {top_k}, block_m {block_m}")
    if w.hidden % ROUTE_K_MULTIPLE:
        raise ValueError(f"fused_route: K={w.hidden} is not a multiple of {ROUTE_K_MULTIPLE}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.stride(0) < x.shape[1] or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    groups = route_groups(t)
    if debug is not None and (debug.dtype != torch.int64 or debug.numel() < 16 + 2 * w.tiles * groups
                              or debug.device != x.device or not debug.is_contiguous()):
        raise ValueError(f"fused_route: debug must be a contiguous int64 tensor of >= {16 + 2 * w.tiles * groups} "
                         f"elements on {x.device}")
    dev, kp = x.device, top_k + 1
    n_rows = 16 * w.tiles
    if logits is None:
        logits = torch.empty((t, n_rows), device=dev, dtype=torch.float32)
    elif (tuple(logits.shape) != (t, n_rows) or logits.dtype != torch.float32 or not logits.is_contiguous()
          or logits.device != dev):
        raise ValueError(f"fused_route: logits must be a contiguous float32 [{t}, {n_rows}] tensor on {dev}")
    lib = bf16_mma_library(dev)
    if lib is None:
        raise RuntimeError("fused_route: the CUDA kernel is not available on this device")
    p_max, b_max = align_bounds(t * kp, w.num_experts + 1, block_m)
    weights = torch.empty((t, kp), device=dev, dtype=torch.float32)
    ids = torch.empty((t, kp), device=dev, dtype=torch.int32)
    sorted_ids = torch.empty(p_max, device=dev, dtype=torch.int32)
    block_expert = torch.empty(b_max, device=dev, dtype=torch.int32)
    num_padded = torch.empty(1, device=dev, dtype=torch.int32)
    rc = lib.vq_moe_route_launch(
        x.data_ptr(), x.stride(0), t, w.packed.data_ptr(), w.tiles, w.hidden, w.num_experts, top_k,
        logits.data_ptr(), w.counter.data_ptr(), weights.data_ptr(), ids.data_ptr(), sorted_ids.data_ptr(),
        block_expert.data_ptr(), num_padded.data_ptr(), block_m, p_max, b_max,
        debug.data_ptr() if debug is not None else None, route_warps(t), groups, int(route_split(t, groups)),
        int(route_batch_loads()), pdl_mode(dev),
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"fused_route: launch failed with CUDA error {rc}")
    return weights, ids, sorted_ids, block_expert, num_padded
