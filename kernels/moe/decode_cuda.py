"""The MoE block of a decode step (1-8 tokens) in one CUDA launch (``csrc/moe_decode.cu``): router GEMM, top-k
routing, the shared expert, the routed experts' gate|up GEMM with SiLU-and-mul, the down GEMM and the weighted slot
sum, meeting at grid-wide barriers (one CTA per SM): one after the routed gate|up, and one before routing unless
:func:`tagged_logits` (the default) has the routing warps wait for each logit to carry the launch's tag.

It replaces the four launches of the decode path (:func:`~vibeqwen_kernels.moe.route_cuda.fused_route`, then
:func:`~vibeqwen_kernels.moe.fused.fused_moe`'s gate|up, down and slot-sum kernels): the same routing bit for bit
(the same logits, weights and ids), the same products, their fp32 sums in another order (a gate|up row is the sum
of four K quarters, a down row of up to three pieces with 16 warps, two with 8: :func:`decode_warps`), so ``h`` and
the output can differ from theirs by a bf16 rounding here and there. Deterministic (no atomics in any sum).

* :func:`make_workspace` -- a layer's (or a model's) persistent scratch buffers.
* :func:`moe_decode` -- one launch.
* :func:`decode_supported` -- whether a call can run here.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_mode

#: tokens per launch (one n8 column tile of the tensor-core MMAs)
MAX_T = 8
#: the shapes the kernel is built for (Qwen3.6-35B-A3B's hidden and expert intermediate sizes)
HIDDEN, INTERMEDIATE = 2048, 512
MAX_EXPERTS, MAX_TOP_K = 256, 8
#: copies of the router's logits a workspace holds (csrc/moe_decode.cu kMaxCopies; :func:`logit_copies`)
LOGIT_COPIES = 8
#: elements of a ``moe_decode(debug=)`` tensor before the per-CTA end times (``debug[DEBUG_HEAD + c]``)
DEBUG_HEAD = 32
#: the fewest routed experts per token the kernel takes (csrc/moe_decode.cu kMinTopK: its down phase needs at least 7
#: distinct experts in a launch; Qwen3.6 routes 8)
MIN_TOP_K = 7
#: tokens up to which the model (``SparseMoE``) runs its MoE block with :func:`moe_decode`: 1 by default, the only
#: count where the H200 measured it faster than the route + fused_moe chain with 8 warps (23.6 vs 26.2 us; parity at
#: 2 tokens, slower at 4 and 8: bench/results/h200_notes.md). With 16 warps an H100 ran the batch-2 decode step at
#: 2.62 / 2.61 ms with 2 against 2.64 / 2.64 with 1 (two engines each, forty-sixth session): not yet adopted (no H200
#: run, no engine GPU tests at 2). ``VIBEQWEN_MOE_FUSED_DECODE_MAX_T`` raises it (up to MAX_T);
#: ``VIBEQWEN_MOE_FUSED_DECODE=0`` turns it off.
MODEL_MAX_T = min(MAX_T, int(os.environ.get("VIBEQWEN_MOE_FUSED_DECODE_MAX_T", "1")))
#: the router CTAs load their whole weight tile into registers before the PDL wait (with early launch it streams
#: while the kernel ahead ends); ``VIBEQWEN_MOE_ROUTER_HOLD=0`` loads two k16 steps of each K range there and the
#: rest after it, as before (the same logits either way)
ROUTER_HOLD = os.environ.get("VIBEQWEN_MOE_ROUTER_HOLD", "1") != "0"


def ring_slots(t: int) -> int:
    """Chunk slots per warp in a launch of ``t`` tokens with 8 warps (csrc/moe_decode.cu ``ring_slots``; 16 warps take
    8 whatever this says): 16, or ``VIBEQWEN_MOE_DECODE_RING`` = 8, 16 or 32 (32 up to 4 tokens, else 16) for
    measuring: the same results. H200: 32 slots (every gate|up and down chunk of a warp requested before its first
    multiply) took 2.05 against 2.00 ms a decode step at batch 1. Read at every call, so a CUDA graph keeps what it
    was captured with.

    Raises:
        ValueError: another ``VIBEQWEN_MOE_DECODE_RING`` value.
    """
    v = os.environ.get("VIBEQWEN_MOE_DECODE_RING", "16")
    if v not in ("8", "16", "32"):
        raise ValueError(f"VIBEQWEN_MOE_DECODE_RING must be 8, 16 or 32, got {v!r}")
    return 16 if v == "32" and t > 4 else int(v)


def decode_warps() -> int:
    """Warps per CTA of a launch: 16, or ``VIBEQWEN_MOE_DECODE_WARPS`` = 8 or 16. 16 warps (four quads, 8 ring slots
    each: the same 80 KB of rings a CTA as 8 warps of 16 slots; 94 registers a thread against 124) run twice the
    dependent dequantize-and-multiply chains an SM, which bound the one-token launch's weight stream; their down rows
    are fp32 sums of up to three pieces instead of two, so their outputs can differ from 8 warps' by a bf16 rounding
    (the routing is the same bit for bit). H100, forty-sixth session: the kernel alone at one token 21.46 -> 19.66 us
    (routed gate|up 4.03 -> 3.10 us, down + slot sum 3.74 -> 3.39), the decode step at batch 1 2.203 / 2.207 ->
    2.122 / 2.121 ms (``bench/decode_ab.py``, one engine, interleaved). Read at every call, so a CUDA graph keeps what
    it was captured with.

    Raises:
        ValueError: another ``VIBEQWEN_MOE_DECODE_WARPS`` value.
    """
    v = os.environ.get("VIBEQWEN_MOE_DECODE_WARPS", "16")
    if v not in ("8", "16"):
        raise ValueError(f"VIBEQWEN_MOE_DECODE_WARPS must be 8 or 16, got {v!r}")
    return int(v)


def fast_list() -> bool:
    """Whether a one-token launch lists its experts from the token's own ids (sorted by rank: one CTA barrier) rather
    than through the general path's per-expert token masks (ballots over all experts, three more CTA barriers): the
    same lists, so the same results. ``VIBEQWEN_MOE_DECODE_FAST_LIST=0`` takes the general path (for measuring); read
    at every call, so a CUDA graph keeps what it was captured with."""
    return os.environ.get("VIBEQWEN_MOE_DECODE_FAST_LIST", "1") != "0"


def early_scales() -> bool:
    """Whether each gate|up tile's two global scales are requested before the tile's multiply (the default) rather
    than after its partials are added, an L2 round trip between a CTA's last gate|up piece and the grid barrier after
    it; ``VIBEQWEN_MOE_DECODE_EARLY_SCALES=0`` reads them after (for measuring; the same results). Read at every call,
    so a CUDA graph keeps what it was captured with."""
    return os.environ.get("VIBEQWEN_MOE_DECODE_EARLY_SCALES", "1") != "0"


def shared_late() -> bool:
    """Whether a one-token launch on 16 warps (with :func:`fast_list`) multiplies the shared expert's gate|up on quads
    1-3 after the first grid barrier (or where it would be), while warp 0 routes, rather than on every quad before it
    (there the CTA leaves the barrier only after its shared tiles, ~1-2 us on an H100, while the routing that follows
    keeps 15 of its 16 warps idle). The same tiles and sums either way, so the same results. It pays with
    :func:`tagged_logits` (alone it was even on an H100); on by default since the forty-eighth session,
    ``VIBEQWEN_MOE_DECODE_SHARED_LATE=0`` multiplies them before the barrier. Read at every call, so a CUDA graph
    keeps what it was captured with."""
    return os.environ.get("VIBEQWEN_MOE_DECODE_SHARED_LATE", "1") != "0"


def tagged_logits() -> bool:
    """Whether the routing warps wait for the router's logits word by word (each stored with its launch's tag, see
    :class:`DecodeWorkspace`) rather than behind a grid barrier: the barrier costs an atomic, a
    generation store and its observation before the logits' own L2 read, the tags one read after the store lands.
    The same logits either way, so the same results. On by default since the forty-eighth session (H100: the kernel
    alone at one token 19.30 -> 17.52 us with :func:`shared_late`, decode b1 2.126 -> 2.047 ms);
    ``VIBEQWEN_MOE_DECODE_TAGGED=0`` keeps the barrier. Read at every call, so a CUDA graph keeps what it was
    captured with."""
    return os.environ.get("VIBEQWEN_MOE_DECODE_TAGGED", "1") != "0"


def logit_copies() -> int:
    """Copies of the router's logits a launch stores (CTA c reads copy c % copies): 1, or
    ``VIBEQWEN_MOE_DECODE_LOGIT_COPIES`` = 1 to :data:`LOGIT_COPIES`. Every CTA reads all of a token's logits (2 KB)
    at the same moment; copies spread those reads over more L2 lines. Written when that read measured ~3800 SM
    clocks of a ~6100-clock routing phase on an H100 (forty-seventh session), before the cause was found to be loads
    issued one after another (fixed since). Measured even since, on an H100 (fifty-eighth session,
    bench/results/h200_notes.md): the launch alone at one token 17.25 / 17.23 us with 1 copy against 17.26 / 17.16
    with 8, decode b1 2.026 / 2.023 / 2.031 ms against 2.023 / 2.028 / 2.029; so 1. The same values either way. Read
    at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: a value that is not an integer in [1, LOGIT_COPIES].
    """
    raw = os.environ.get("VIBEQWEN_MOE_DECODE_LOGIT_COPIES", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= LOGIT_COPIES:
        raise ValueError(f"VIBEQWEN_MOE_DECODE_LOGIT_COPIES must be an integer from 1 to {LOGIT_COPIES}, got {raw!r}")
    return n


def decode_library(device: torch.device):
    """The built ``csrc/moe_decode.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i = ctypes.c_void_p, ctypes.c_int
    return hopper_library("moe_decode", device, {
        "vq_moe_decode_smem_bytes": [i, i, i, i],
        "vq_moe_decode_grid": [i, i, i, i],
        "vq_moe_decode_launch": [p, i, i, p, i, i, i, p, p, p, i, p, p, p, i, i, i, p, p, p, p, i, p, p, p, i, i, i, i,
                                 i, i, i, i, i, i, p],
    })


@dataclass(frozen=True)
class DecodeWorkspace:
    """Scratch of :func:`moe_decode`, allocated once (CUDA graphs capture its addresses).

    Attributes:
        logits: int64 ``[LOGIT_COPIES, MAX_T, 16 * tiles]``, zero: the router's bf16-rounded logits, each one 64-bit
            word of its fp32 bits (low half) and its launch's tag (high half: the generation of ``sync`` at the
            launch's start, plus one), so that the routing can wait for the logits themselves
            (:func:`tagged_logits`); :func:`logit_copies` copies of them, CTA c reading copy c % copies. Zeroed
            together with ``sync`` or not at all (a zeroed word carries no launch's tag).
        h: bf16 ``[MAX_T * (top_k + 1), I]``: silu(gate) * up per (token, slot) pair (written before it is read
            in every launch).
        sync: int32 ``[2]``, zero: the grid barrier's arrival counter (back to 0 after every launch) and generation.
            Launches sharing a workspace must not run concurrently (one stream).
    """

    logits: torch.Tensor
    h: torch.Tensor
    sync: torch.Tensor


def make_workspace(router_tiles: int, top_k: int, intermediate: int, device: torch.device) -> DecodeWorkspace:
    """A :class:`DecodeWorkspace` for a router of ``router_tiles`` 16-row tiles (``RouterWeight.tiles``)."""
    return DecodeWorkspace(
        logits=torch.zeros((LOGIT_COPIES, MAX_T, 16 * router_tiles), dtype=torch.int64, device=device),
        h=torch.empty((MAX_T * (top_k + 1), intermediate), dtype=torch.bfloat16, device=device),
        sync=torch.zeros(2, dtype=torch.int32, device=device),
    )


@functools.cache
def _grid(device: torch.device, t: int, top_k: int, ring: int = 16, warps: int = 8) -> int:
    """CTAs of a launch on ``device`` (one per SM), 0 where the kernel cannot run (too few SMs, too little shared
    memory). Asked once per device, shape, ring (:func:`ring_slots`) and warps (:func:`decode_warps`)."""
    lib = decode_library(device)
    if lib is None:
        return 0
    with torch.cuda.device(device):
        return int(lib.vq_moe_decode_grid(t, top_k, ring, warps))


def decode_enabled(device: torch.device) -> bool:
    """Whether the one-launch MoE may run on ``device``: ``VIBEQWEN_MOE_FUSED_DECODE`` is not ``0`` and the library
    builds there (sm_90+, nvcc)."""
    return os.environ.get("VIBEQWEN_MOE_FUSED_DECODE", "1") != "0" and decode_library(device) is not None


def _weights_problem(route, experts, top_k: int) -> str | None:
    """What keeps :func:`moe_decode` from running these weights with this top_k (None: nothing)."""
    if not MIN_TOP_K <= top_k <= min(MAX_TOP_K, route.num_experts):
        return f"need {MIN_TOP_K} <= top_k <= {min(MAX_TOP_K, route.num_experts)}, got {top_k}"
    if route.hidden != HIDDEN or route.num_experts > MAX_EXPERTS:
        return f"the router must be [E <= {MAX_EXPERTS}, {HIDDEN}], got [{route.num_experts}, {route.hidden}]"
    mma13, mma2 = getattr(experts, "w13_mma", None), getattr(experts, "w2_mma", None)
    if (mma13 is None or mma2 is None or not mma13.halves_interleaved or experts.hidden != HIDDEN
            or experts.intermediate != INTERMEDIATE or experts.num_experts != route.num_experts + 1):
        return (f"need E + 1 = {route.num_experts + 1} experts of H {HIDDEN}, I {INTERMEDIATE} with their CUDA copies "
                "(gate|up interleaved)")
    return None


def decode_supported(route, experts, t: int, top_k: int, device: torch.device) -> bool:
    """Whether :func:`moe_decode` runs ``t`` tokens of these weights on ``device``: 1 <= t <= MAX_T, H = 2048, I = 512,
    E <= 256 routed experts plus the shared one, 7 <= top_k <= 8, the experts' CUDA copies with gate|up interleaved,
    :func:`decode_enabled`, and a grid of at least 100 co-resident CTAs (csrc/moe_decode.cu kMinGrid)."""
    device = torch.device(device)
    return (1 <= t <= MAX_T and _weights_problem(route, experts, top_k) is None and device.type == "cuda"
            and decode_enabled(device) and _grid(device, t, top_k, ring_slots(t), decode_warps()) > 0)


def moe_decode(x: torch.Tensor, route, experts, top_k: int, ws: DecodeWorkspace, *, out: torch.Tensor | None = None,
               topk: tuple | None = None, debug: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse MoE block for 1-8 tokens in one launch: ``out[t] = sum_s w[t, s] * expert_{id[t, s]}(x[t])`` over
    the top_k routed experts and the sigmoid-gated shared expert (slot top_k), as ``fused_route`` + ``fused_moe``
    compute it (the routing bit for bit; fp32 sums in another order, see the module docstring).

    Args:
        x: bf16 ``[T, 2048]`` on the weights' device, 1 <= T <= 8 (last dim contiguous, rows 16-byte aligned; else
            copied).
        route: :class:`~vibeqwen_kernels.moe.route_cuda.RouterWeight` (E <= 256 routed experts).
        experts: :class:`~vibeqwen_kernels.moe.fused.MoEWeights` with E + 1 experts and their CUDA copies.
        top_k: routed experts per token, :data:`MIN_TOP_K` (7) to 8.
        ws: :class:`DecodeWorkspace` (:func:`make_workspace` for this router and top_k).
        out: optional bf16 ``[T, 2048]`` output with a contiguous last dim.
        topk: optional ``(weights float32 [T, top_k + 1], ids int32 [T, top_k + 1])`` (contiguous) that receive the
            routing, as ``fused_route`` returns it.
        debug: optional int64 ``[32 + grid]`` (profiling): CTA 0's %globaltimer (ns) at the phases (``[0]`` start,
            ``[1]`` after the PDL wait, ``[2]`` phase 0 done, ``[3]`` after the first barrier (:func:`tagged_logits`:
            right after ``[2]``, there is no such barrier), ``[8]`` routed (one token with :func:`fast_list`: and
            listed), ``[9]`` lists made, ``[10]`` stream listed, ``[4]`` stream started (the first weight requests
            issued), ``[5]`` gate|up done, ``[6]`` after the second barrier, ``[7]`` end); CTA 0's %clock64 (SM
            clocks) in ``[16 + i]``: with one token and :func:`fast_list`, its routing warp's ``[17]`` routing start,
            ``[18]`` logits loaded into keys, ``[19]`` keys sorted, ``[20]`` top_k chosen, ``[21]`` softmax sums,
            ``[22]`` listed (``[29]``: scratch), and on every path ``[23]`` after the CTA barrier that ends routing;
            each CTA's end (%globaltimer) in ``[32 + c]``.

    Returns:
        bf16 ``[T, 2048]``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
        RuntimeError: the kernel cannot run on this device, or the launch failed.
    """
    t = x.shape[0] if x.dim() == 2 else 0
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != HIDDEN or not 1 <= t <= MAX_T:
        raise ValueError(f"moe_decode: x must be bf16 [1..{MAX_T}, {HIDDEN}], got {x.dtype} {tuple(x.shape)}")
    problem = _weights_problem(route, experts, top_k)
    if problem is not None:
        raise ValueError(f"moe_decode: {problem}")
    mma13, mma2 = experts.w13_mma, experts.w2_mma
    dev = x.device
    if dev != route.packed.device or dev != experts.device:
        raise ValueError(f"moe_decode: x is on {dev}, the weights on {route.packed.device} / {experts.device}")
    kp = top_k + 1
    if (tuple(ws.logits.shape) != (LOGIT_COPIES, MAX_T, 16 * route.tiles) or ws.logits.dtype != torch.int64
            or not ws.logits.is_contiguous()
            or tuple(ws.h.shape) != (MAX_T * kp, INTERMEDIATE) or ws.h.dtype != torch.bfloat16
            or not ws.h.is_contiguous() or ws.h.device != dev or ws.sync.numel() != 2 or ws.logits.device != dev):
        raise ValueError("moe_decode: the workspace was made for another router, top_k or device (make_workspace)")
    if out is None:
        out = torch.empty((t, HIDDEN), dtype=torch.bfloat16, device=dev)
    elif (tuple(out.shape) != (t, HIDDEN) or out.dtype != torch.bfloat16 or out.stride(1) != 1
          or out.device != dev):
        raise ValueError(f"moe_decode: out must be bf16 [{t}, {HIDDEN}] on {dev} with a contiguous last dim")
    tw_ptr = ti_ptr = None
    if topk is not None:
        tw, ti = topk
        if (tuple(tw.shape) != (t, kp) or tuple(ti.shape) != (t, kp) or tw.dtype != torch.float32
                or ti.dtype != torch.int32 or not tw.is_contiguous() or not ti.is_contiguous()):
            raise ValueError(f"moe_decode: topk must be contiguous float32 / int32 [{t}, {kp}] tensors")
        tw_ptr, ti_ptr = tw.data_ptr(), ti.data_ptr()
    ring, warps = ring_slots(t), decode_warps()
    grid = _grid(dev, t, top_k, ring, warps) if dev.type == "cuda" else 0
    if debug is not None and (debug.dtype != torch.int64 or debug.numel() < DEBUG_HEAD + grid
                              or not debug.is_contiguous() or debug.device != dev):
        raise ValueError(f"moe_decode: debug must be a contiguous int64 tensor of >= {DEBUG_HEAD + grid} elements "
                         f"on {dev}")
    lib = decode_library(dev)
    if lib is None or grid == 0:
        raise RuntimeError("moe_decode: the CUDA kernel cannot run on this device")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.stride(0) < HIDDEN or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    rc = lib.vq_moe_decode_launch(
        x.data_ptr(), x.stride(0), t, route.packed.data_ptr(), route.tiles, route.num_experts, top_k,
        mma13.codes.data_ptr(), mma13.scales.data_ptr(), experts.w13_gscale.data_ptr(), experts.w13_gscale.stride(0),
        mma2.codes.data_ptr(), mma2.scales.data_ptr(), experts.w2_gscale.data_ptr(), experts.w2_gscale.stride(0),
        HIDDEN, INTERMEDIATE, ws.logits.data_ptr(), ws.h.data_ptr(), ws.sync.data_ptr(), out.data_ptr(),
        out.stride(0), tw_ptr, ti_ptr, debug.data_ptr() if debug is not None else None, int(ROUTER_HOLD), ring,
        warps, grid, int(fast_list()), int(early_scales()), int(shared_late()), int(tagged_logits()), logit_copies(),
        pdl_mode(dev),
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"moe_decode: launch failed with CUDA error {rc}")
    return out
