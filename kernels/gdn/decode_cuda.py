"""Gated DeltaNet's delta rule for a decode step (one token per sequence) on a persistent grid
(``csrc/gdn_decode.cu``): the outputs of :func:`~vibeqwen_kernels.gdn.recurrent.gdn_recurrent` for such a step, with
each CTA's next work unit (a sequence's value head, 32 of its state columns) already loading while it multiplies the
current one; CTAs take units from a counter, so those that start early take more.

The same operations as the Triton kernel; the fp32 sums over the state's rows run in another order, so the state and
``o`` can differ from its by fp32 rounding (a bf16 flip of ``o`` here and there).

* :func:`gdn_recurrent_decode` -- one launch.
* :func:`decode_supported` -- whether a call can run here; :func:`make_counter` -- its scratch.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_mode

__all__ = ["HEAD_DIM", "decode_enabled", "decode_supported", "gdn_recurrent_decode", "make_counter", "model_min_seqs"]

#: Dk = Dv, the head size the kernel is built for (Qwen3.6's GDN heads)
HEAD_DIM = 128
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def _library(device: torch.device):
    """The built ``csrc/gdn_decode.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    return hopper_library("gdn_decode", device, {
        "vq_gdn_recurrent_decode_grid": [],
        "vq_gdn_recurrent_decode_launch": [p, ll, ll, p, ll, ll, p, ll, ll, p, ll, p, ll, p, p, p, i, ll, ll, ll, p, i,
                                           p, p, f, p, p, i, i, i, i, i, i, p],
    })


@functools.cache
def _grid(device: torch.device) -> int:
    """CTAs of a launch on ``device`` (4 an SM), asked once per device."""
    lib = _library(device)
    if lib is None:
        return 0
    with torch.cuda.device(device):
        return int(lib.vq_gdn_recurrent_decode_grid())


def model_min_seqs() -> int:
    """The fewest sequences a decode step has for the model to run this kernel (``GatedDeltaNet``); fewer take the
    Triton kernel. ``VIBEQWEN_GDN_PERSIST_MIN_SEQS`` sets it (read at every call, so a CUDA graph keeps what it was
    captured with). The default, 32: on the H200 the step took the same time with either kernel at 1, 8 and 16 sequences
    (within 1%) and less with this one at 32 (-1.2%) and 64 (-2.9%) (bench/results/h200_notes.md).

    Raises:
        ValueError: a value that is not a positive integer.
    """
    v = os.environ.get("VIBEQWEN_GDN_PERSIST_MIN_SEQS", "32")
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"VIBEQWEN_GDN_PERSIST_MIN_SEQS must be a positive integer, got {v!r}")
    return int(v)


def decode_enabled(device: torch.device) -> bool:
    """Whether the kernel may run on ``device``: ``VIBEQWEN_GDN_PERSIST`` is not ``0`` and the library builds there
    (sm_90+, nvcc). Read at every call, so a CUDA graph keeps what it was captured with."""
    device = torch.device(device)
    return (os.environ.get("VIBEQWEN_GDN_PERSIST", "1") != "0" and device.type == "cuda"
            and _library(device) is not None)


def _rows_ok(x: torch.Tensor) -> bool:
    """bf16, last dim contiguous, every 4-element slice 8-byte aligned (element strides and offset multiples of 4)."""
    return (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.data_ptr() % 8 == 0
            and all(s % 4 == 0 for s in x.stride()[:-1]))


def _problem(q, k, v, a, b, ssm_states) -> str | None:
    """What keeps these tensors from the kernel (None: nothing). q, k [T, Hk, 128], v [T, Hv, 128], a, b [T, Hv]."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        return (f"q, k must be [T, Hk, {HEAD_DIM}] and v [T, Hv, {HEAD_DIM}], got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if dk != HEAD_DIM or dv != HEAD_DIM or hv % hk:
        return f"need Dk = Dv = {HEAD_DIM} and Hv a multiple of Hk (Hk={hk}, Hv={hv}, Dk={dk}, Dv={dv})"
    if not all(_rows_ok(x) for x in (q, k, v)):
        return "q, k, v must be bf16 with a contiguous last dim and strides and offsets in multiples of 4 elements"
    for name, x in (("a", a), ("b", b)):
        if x.dim() != 2 or x.shape != (t, hv) or x.dtype != torch.bfloat16 or x.stride(1) != 1:
            return f"{name} must be bf16 [{t}, {hv}] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}"
    if (ssm_states.dim() != 4 or ssm_states.shape[1:] != (hv, HEAD_DIM, HEAD_DIM)
            or ssm_states.dtype not in _STATE_DTYPES or ssm_states.stride(3) != 1
            or any(s % 4 for s in ssm_states.stride()[:3]) or ssm_states.data_ptr() % 16):
        return (f"ssm_states must be fp32 or bf16 [slots, {hv}, {HEAD_DIM}, {HEAD_DIM}] with a contiguous last dim "
                f"and 16-byte aligned rows, got {ssm_states.dtype} {tuple(ssm_states.shape)}")
    return None


def decode_supported(q, k, v, a, b, ssm_states) -> bool:
    """Whether :func:`gdn_recurrent_decode` takes these tensors on their device (:func:`decode_enabled`, the shapes,
    dtypes and layouts its Args name)."""
    return decode_enabled(q.device) and _problem(q, k, v, a, b, ssm_states) is None


def make_counter(device: torch.device) -> torch.Tensor:
    """The kernel's work counter: int32 ``[2]`` zeros, allocated once (CUDA graphs capture its address); every launch
    leaves it zero. Launches sharing one must not run concurrently (one stream)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


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
    counter: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule for one decode token per sequence; updates the state slots in place.

    Per sequence b (token ``t = query_start_loc[b]``, slot ``slots[b]``; none when ``query_start_loc[b + 1] == t``)
    this equals ``gdn_recurrent`` on that token: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``,
    q and k L2-normalised, q scaled by ``128 ** -0.5``, the state from zeros where ``has_initial_state[b]`` is false
    (Yang et al., arXiv 2412.06464; kernels/gdn/naive.py), up to fp32 summation order (module docstring).

    Args:
        q, k: bf16 ``[T, Hk, 128]``; v: bf16 ``[T, Hv, 128]``, Hv a multiple of Hk; views allowed (last dim
            contiguous, strides and offsets multiples of 4 elements).
        a, b: bf16 ``[T, Hv]`` raw gate projections (last dim contiguous).
        A_log, dt_bias: ``[Hv]`` fp32.
        ssm_states: fp32 or bf16 ``[slots, Hv, 128, 128]``, last dim contiguous, 16-byte aligned rows; read in fp32,
            the final state rounded to its dtype (to nearest even).
        slots: int32/int64 ``[B]``, distinct for the sequences with a token whose results are kept (a decode graph's
            padding sequences share one scratch slot: they start from zeros and their outputs are discarded).
        query_start_loc: contiguous int32 ``[B + 1]``, at most one token per sequence.
        has_initial_state: contiguous bool ``[B]``.
        counter: :func:`make_counter`'s tensor, on the same device; the kernel leaves it zero (a launch that finds it
            nonzero, after an aborted one, skips units).
        out: optional contiguous, 8-byte aligned bf16 ``[T, Hv, 128]``.

    Returns:
        bf16 ``[T, Hv, 128]`` (``out``); rows that belong to no sequence are not written.

    Raises:
        ValueError: shapes, dtypes, layouts or devices that do not fit.
        RuntimeError: the kernel cannot run on this device, or the launch failed.
    """
    problem = _problem(q, k, v, a, b, ssm_states)
    if problem is not None:
        raise ValueError(f"gdn_recurrent_decode: {problem}")
    t, hk, _ = q.shape
    hv = v.shape[1]
    nb = slots.shape[0] if slots.dim() == 1 else -1
    qsl = query_start_loc
    if nb < 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gdn_recurrent_decode: slots must be a non-empty 1-D int32/int64 tensor, got "
                         f"{tuple(slots.shape)}")
    if qsl.shape != (nb + 1,) or qsl.dtype != torch.int32 or not qsl.is_contiguous():
        raise ValueError(f"gdn_recurrent_decode: query_start_loc must be contiguous int32 [{nb + 1}]")
    hi = has_initial_state
    if hi.shape != (nb,) or hi.dtype != torch.bool or not hi.is_contiguous():
        raise ValueError(f"gdn_recurrent_decode: has_initial_state must be contiguous bool [{nb}]")
    if (A_log.shape != (hv,) or dt_bias.shape != (hv,) or A_log.dtype != torch.float32
            or dt_bias.dtype != torch.float32):
        raise ValueError(f"gdn_recurrent_decode: A_log and dt_bias must be fp32 [{hv}]")
    if counter.shape != (2,) or counter.dtype != torch.int32 or not counter.is_contiguous():
        raise ValueError("gdn_recurrent_decode: counter must be make_counter's int32 [2] tensor")
    dev = q.device
    tensors = (k, v, a, b, A_log, dt_bias, ssm_states, slots, qsl, has_initial_state, counter)
    if any(x.device != dev for x in tensors):
        raise ValueError(f"gdn_recurrent_decode: every tensor must be on {dev}")
    if out is None:
        out = torch.empty((t, hv, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    elif (out.shape != (t, hv, HEAD_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != dev
          or out.data_ptr() % 8):
        raise ValueError(f"gdn_recurrent_decode: out must be a contiguous, 8-byte aligned bf16 [{t}, {hv}, {HEAD_DIM}] "
                         f"tensor on {dev}")
    lib = _library(dev) if dev.type == "cuda" else None
    if lib is None:
        raise RuntimeError("gdn_recurrent_decode: the CUDA kernel cannot run on this device")
    from vibeqwen_kernels.gdn.recurrent import early_state

    A_log, dt_bias, slots = A_log.contiguous(), dt_bias.contiguous(), slots.contiguous()
    rc = lib.vq_gdn_recurrent_decode_launch(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
        A_log.data_ptr(), dt_bias.data_ptr(), ssm_states.data_ptr(), int(ssm_states.dtype == torch.bfloat16),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), slots.data_ptr(),
        int(slots.dtype == torch.int64), qsl.data_ptr(), has_initial_state.data_ptr(), HEAD_DIM**-0.5,
        out.data_ptr(), counter.data_ptr(), nb, hv, hv // hk, _grid(dev), int(early_state()), pdl_mode(dev),
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"gdn_recurrent_decode: launch failed with CUDA error {rc}")
    return out
