"""Gated DeltaNet of a decode step in one CUDA launch (``csrc/gdn_decode.cu``): the gated delta rule on each
sequence's state slot and the gated RMSNorm of its output, for one token per sequence.

It replaces two launches of the decode path (:func:`~vibeqwen_kernels.gdn.recurrent.gdn_recurrent`, then
:func:`~vibeqwen_kernels.norm_fused.gated_rms_norm`): the same operations and roundings, the fp32 sums over the
state's rows and the output's squares in another order, so the state can differ from theirs by fp32 rounding and
``y`` by a bf16 flip here and there. A cluster of 4 or 8 CTAs owns one value head's state (each CTA 32 or 16 of its
128 columns) and sums the norm's squares through distributed shared memory, so the norm over the head's 128 outputs
needs no second launch.

* :func:`gdn_decode_gated` -- one launch.
* :func:`gdn_decode_supported` -- whether a call can run here.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_mode

__all__ = ["HEAD_DIM", "cluster_size", "decode_kernel", "gdn_decode_enabled", "gdn_decode_gated",
           "gdn_decode_supported", "gdn_recurrent_decode"]

#: Dk = Dv, the head size the kernel is built for (Qwen3.6's GDN heads)
HEAD_DIM = 128
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def _library(device: torch.device):
    """The built ``csrc/gdn_decode.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    return hopper_library("gdn_decode", device, {
        "vq_gdn_decode_launch": [p, ll, ll, p, ll, ll, p, ll, ll, p, ll, p, ll, p, p, p, i, ll, ll, ll, p, i, p, p,
                                 p, ll, ll, p, f, f, p, i, i, i, i, i, i, p],
        "vq_gdn_recurrent_decode_grid": [],
        "vq_gdn_recurrent_decode_launch": [p, ll, ll, p, ll, ll, p, ll, ll, p, ll, p, ll, p, p, p, i, ll, ll, ll, p, i,
                                           p, p, f, p, i, i, i, i, i, i, p],
    })


def cluster_size(num_seqs: int, hv: int) -> int:
    """CTAs per value head (4 or 8): 8 (16 columns each) while 4 per head would give fewer than 4 CTAs per SM of an
    H200 (132 SMs), else 4 (32 columns each); ``VIBEQWEN_GDN_DECODE_CLUSTER=4|8`` sets it (measuring: the same
    results). Read at every call.

    Raises:
        ValueError: another ``VIBEQWEN_GDN_DECODE_CLUSTER`` value.
    """
    v = os.environ.get("VIBEQWEN_GDN_DECODE_CLUSTER", "")
    if v not in ("", "4", "8"):
        raise ValueError(f"VIBEQWEN_GDN_DECODE_CLUSTER must be 4 or 8, got {v!r}")
    if v:
        return int(v)
    return 8 if num_seqs * hv * 4 < 4 * 132 else 4


def decode_kernel() -> str:
    """Which kernels run a decode step's delta rule and gated RMSNorm (``VIBEQWEN_GDN_DECODE_KERNEL``, read at every
    call): ``"triton"`` (the recurrent and norm Triton kernels), ``"fused"`` (:func:`gdn_decode_gated`) or
    ``"persist"`` (:func:`gdn_recurrent_decode`, then the norm kernel).

    Raises:
        ValueError: another value.
    """
    v = os.environ.get("VIBEQWEN_GDN_DECODE_KERNEL", "triton")
    if v not in ("triton", "fused", "persist"):
        raise ValueError(f"VIBEQWEN_GDN_DECODE_KERNEL must be triton, fused or persist, got {v!r}")
    return v


def gdn_decode_enabled(device: torch.device) -> bool:
    """Whether the CUDA GDN decode kernels may run on ``device``: the library builds there (sm_90+, nvcc)."""
    device = torch.device(device)
    return device.type == "cuda" and _library(device) is not None


def _rows_ok(x: torch.Tensor) -> bool:
    """bf16, last dim contiguous, every 4-element slice 8-byte aligned (element strides and offset multiples of 4)."""
    return (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.data_ptr() % 8 == 0
            and all(s % 4 == 0 for s in x.stride()[:-1]))


def _problem(q, k, v, a, b, z, ssm_states) -> str | None:
    """What keeps these tensors from the kernel (None: nothing). q, k [T, Hk, 128], v, z [T, Hv, 128], a, b [T, Hv]."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or z.shape != v.shape or v.shape[0] != q.shape[0]:
        return (f"q, k must be [T, Hk, {HEAD_DIM}] and v, z [T, Hv, {HEAD_DIM}], got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(z.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if dk != HEAD_DIM or dv != HEAD_DIM or hv % hk:
        return f"need Dk = Dv = {HEAD_DIM} and Hv a multiple of Hk (Hk={hk}, Hv={hv}, Dk={dk}, Dv={dv})"
    if not all(_rows_ok(x) for x in (q, k, v, z)):
        return "q, k, v, z must be bf16 with a contiguous last dim and strides and offsets in multiples of 4 elements"
    for name, x in (("a", a), ("b", b)):
        if x.dim() != 2 or x.shape != (t, hv) or x.dtype != torch.bfloat16 or x.stride(1) != 1:
            return f"{name} must be bf16 [{t}, {hv}] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}"
    if (ssm_states.dim() != 4 or ssm_states.shape[1:] != (hv, HEAD_DIM, HEAD_DIM)
            or ssm_states.dtype not in _STATE_DTYPES or ssm_states.stride(3) != 1
            or any(s % 4 for s in ssm_states.stride()[:3]) or ssm_states.data_ptr() % 16):
        return (f"ssm_states must be fp32 or bf16 [slots, {hv}, {HEAD_DIM}, {HEAD_DIM}] with a contiguous last dim "
                f"and 16-byte aligned rows, got {ssm_states.dtype} {tuple(ssm_states.shape)}")
    return None


def gdn_decode_supported(q, k, v, a, b, z, ssm_states) -> bool:
    """Whether :func:`gdn_decode_gated` takes these tensors on their device (:func:`gdn_decode_enabled`, the shapes,
    dtypes and layouts its Args name)."""
    return gdn_decode_enabled(q.device) and _problem(q, k, v, a, b, z, ssm_states) is None


def gdn_decode_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence: the gated delta rule, then ``y = gated_rms_norm(o, z, norm_weight, eps)``, in
    one launch; the state slots are updated in place.

    Per sequence b (token ``t = query_start_loc[b]``, slot ``slots[b]``; none when ``query_start_loc[b + 1] == t``)
    and value head h this equals ``gdn_recurrent`` on that token (``g = -exp(A_log) * softplus(a + dt_bias)``,
    ``beta = sigmoid(b)``, q and k L2-normalised, q scaled by ``128 ** -0.5``, the state from zeros where
    ``has_initial_state[b]`` is false) followed by ``gated_rms_norm`` of the bf16 output (Yang et al., arXiv
    2412.06464; HF ``Qwen3_5MoeRMSNormGated``), up to fp32 summation order (module docstring).

    Args:
        q, k: bf16 ``[T, Hk, 128]``; v, z: bf16 ``[T, Hv, 128]``, Hv a multiple of Hk; views allowed (last dim
            contiguous, strides and offsets multiples of 4 elements).
        a, b: bf16 ``[T, Hv]`` raw gate projections (last dim contiguous).
        A_log, dt_bias: ``[Hv]`` (used as fp32).
        ssm_states: fp32 or bf16 ``[slots, Hv, 128, 128]``, last dim contiguous, 16-byte aligned rows.
        slots: int32/int64 ``[B]`` (distinct for sequences with a token).
        query_start_loc: int32 ``[B + 1]``, at most one token per sequence.
        has_initial_state: bool ``[B]``.
        norm_weight: ``[128]`` (rounded to bf16, as ``gated_rms_norm`` does).
        eps: the norm's variance epsilon.
        out: optional contiguous bf16 ``[T, Hv * 128]``.

    Returns:
        bf16 ``[T, Hv * 128]`` (``out``); rows of sequences without a token are not written.

    Raises:
        ValueError: shapes, dtypes, layouts or devices that do not fit.
        RuntimeError: the kernel cannot run on this device, or the launch failed.
    """
    problem = _problem(q, k, v, a, b, z, ssm_states)
    if problem is not None:
        raise ValueError(f"gdn_decode_gated: {problem}")
    t, hk, _ = q.shape
    hv = v.shape[1]
    nb = slots.shape[0] if slots.dim() == 1 else -1
    if nb < 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gdn_decode_gated: slots must be a non-empty 1-D int32/int64 tensor, got "
                         f"{tuple(slots.shape)}")
    qsl = query_start_loc
    if qsl.shape != (nb + 1,) or qsl.dtype != torch.int32 or not qsl.is_contiguous():
        raise ValueError(f"gdn_decode_gated: query_start_loc must be contiguous int32 [{nb + 1}]")
    if has_initial_state.shape != (nb,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"gdn_decode_gated: has_initial_state must be bool [{nb}]")
    if A_log.shape != (hv,) or dt_bias.shape != (hv,) or norm_weight.shape != (HEAD_DIM,):
        raise ValueError(f"gdn_decode_gated: A_log and dt_bias must be [{hv}], norm_weight [{HEAD_DIM}]")
    dev = q.device
    tensors = (k, v, a, b, z, A_log, dt_bias, ssm_states, slots, query_start_loc, has_initial_state, norm_weight)
    if any(x.device != dev for x in tensors):
        raise ValueError(f"gdn_decode_gated: every tensor must be on {dev}")
    if out is None:
        out = torch.empty((t, hv * HEAD_DIM), dtype=torch.bfloat16, device=dev)
    elif out.shape != (t, hv * HEAD_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"gdn_decode_gated: out must be a contiguous bf16 [{t}, {hv * HEAD_DIM}] tensor on {dev}")
    lib = _library(dev) if dev.type == "cuda" else None
    if lib is None:
        raise RuntimeError("gdn_decode_gated: the CUDA kernel cannot run on this device")
    from vibeqwen_kernels.gdn.recurrent import early_state

    A_log, dt_bias = A_log.float().contiguous(), dt_bias.float().contiguous()
    norm_weight = norm_weight.to(torch.bfloat16).contiguous()
    slots = slots.contiguous()
    rc = lib.vq_gdn_decode_launch(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
        A_log.data_ptr(), dt_bias.data_ptr(), ssm_states.data_ptr(), int(ssm_states.dtype == torch.bfloat16),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), slots.data_ptr(),
        int(slots.dtype == torch.int64), query_start_loc.data_ptr(), has_initial_state.data_ptr(),
        z.data_ptr(), z.stride(0), z.stride(1), norm_weight.data_ptr(), float(eps), HEAD_DIM**-0.5,
        out.data_ptr(), nb, hv, hv // hk, cluster_size(nb, hv), int(early_state()), pdl_mode(dev),
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"gdn_decode_gated: launch failed with CUDA error {rc}")
    return out


@functools.cache
def _persist_grid(device: torch.device) -> int:
    lib = _library(device)
    if lib is None:
        return 0
    with torch.cuda.device(device):
        return int(lib.vq_gdn_recurrent_decode_grid())


def gdn_recurrent_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The delta rule alone for one decode token per sequence on a persistent grid (csrc/gdn_decode.cu,
    ``gdn_recurrent_persist_kernel``): ``gdn_recurrent``'s outputs (o in bf16, the state slots updated in place), its
    fp32 sums in another order. Args as :func:`gdn_decode_gated` without z and the norm; ``out``: optional contiguous
    bf16 ``[T, Hv, 128]``.

    Returns:
        bf16 ``[T, Hv, 128]``; rows of sequences without a token are not written.

    Raises:
        ValueError: shapes, dtypes, layouts or devices that do not fit.
        RuntimeError: the kernel cannot run on this device, or the launch failed.
    """
    problem = _problem(q, k, v, a, b, v, ssm_states)
    if problem is not None:
        raise ValueError(f"gdn_recurrent_decode: {problem}")
    t, hk, _ = q.shape
    hv = v.shape[1]
    nb = slots.shape[0] if slots.dim() == 1 else -1
    qsl = query_start_loc
    if (nb < 1 or slots.dtype not in (torch.int32, torch.int64) or qsl.shape != (nb + 1,)
            or qsl.dtype != torch.int32 or not qsl.is_contiguous() or has_initial_state.shape != (nb,)
            or has_initial_state.dtype != torch.bool or A_log.shape != (hv,) or dt_bias.shape != (hv,)):
        raise ValueError("gdn_recurrent_decode: slots [B] int32/int64, query_start_loc contiguous int32 [B + 1], "
                         f"has_initial_state bool [B], A_log and dt_bias [{hv}] expected")
    dev = q.device
    if out is None:
        out = torch.empty((t, hv, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    elif out.shape != (t, hv, HEAD_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"gdn_recurrent_decode: out must be a contiguous bf16 [{t}, {hv}, {HEAD_DIM}] tensor")
    lib = _library(dev) if dev.type == "cuda" else None
    if lib is None:
        raise RuntimeError("gdn_recurrent_decode: the CUDA kernel cannot run on this device")
    from vibeqwen_kernels.gdn.recurrent import early_state

    A_log, dt_bias, slots = A_log.float().contiguous(), dt_bias.float().contiguous(), slots.contiguous()
    rc = lib.vq_gdn_recurrent_decode_launch(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
        A_log.data_ptr(), dt_bias.data_ptr(), ssm_states.data_ptr(), int(ssm_states.dtype == torch.bfloat16),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), slots.data_ptr(),
        int(slots.dtype == torch.int64), qsl.data_ptr(), has_initial_state.data_ptr(), HEAD_DIM**-0.5,
        out.data_ptr(), nb, hv, hv // hk, _persist_grid(dev), int(early_state()), pdl_mode(dev),
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"gdn_recurrent_decode: launch failed with CUDA error {rc}")
    return out
