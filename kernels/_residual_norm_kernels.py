"""The residual add + RMSNorm epilogue that row-reducing kernels (the MoE slot sum, the FP8 split-K reduce) run
in place of a separate ``_rms_norm_kernel`` launch (see :class:`vibeqwen_kernels.norm_fused.ResidualNorm`).

The rounding steps are ``_rms_norm_kernel``'s with ``x`` = the reducing kernel's output row: ``delta`` = the fp32
row rounded to the activation dtype (what the reducing kernel would have stored), ``h = delta + residual`` in fp32
rounded once (torch's ``x + residual``), ``y = h * rsqrt(mean(h^2) + eps) * (1 + w)`` in fp32 (HF
``Qwen3_5MoeRMSNorm``), rounded.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_row(acc, offs, mask, res_row, h_row, w_ptr, y_row, D, eps):
    """One row: acc fp32 ``[BLOCK]`` (the whole row: BLOCK >= D; lanes past D masked), residual at ``res_row``,
    ``h`` to ``h_row`` and ``y`` to ``y_row`` (both of ``h_row``'s dtype; ``h_row`` may be ``res_row``: each
    element is read before it is written)."""
    delta = acc.to(h_row.dtype.element_ty)
    r = tl.load(res_row + offs, mask=mask, other=0.0)
    h = (delta.to(tl.float32) + r.to(tl.float32)).to(h_row.dtype.element_ty)
    tl.store(h_row + offs, h, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    var = tl.sum(hf * hf, axis=0) / D
    inv = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (hf * inv) * (1.0 + w)
    tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=mask)
