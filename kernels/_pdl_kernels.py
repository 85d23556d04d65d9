"""The Triton side of programmatic dependent launch (see :mod:`vibeqwen_kernels.pdl`)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: whether pdl_wait lets the next kernel launch early (``VIBEQWEN_PDL_EARLY=0``: only when this grid ends; read
#: once, at import; for comparison)
PDL_EARLY: tl.constexpr = tl.constexpr(os.environ.get("VIBEQWEN_PDL_EARLY", "1") != "0")


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of every kernel here: with PDL, wait until the previous kernel in the stream finished
    and its memory operations are visible (PTX ``griddepcontrol.wait``), then let the next PDL kernel launch
    (``griddepcontrol.launch_dependents``: once every program of this grid has passed here, the next kernel's
    CTAs may be scheduled on free SM resources and run up to their own wait; the CUDA FP8 kernels request their
    weights before it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
