"""The Triton side of programmatic dependent launch (see :mod:`vibeqwen_kernels.pdl`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of every kernel here: with PDL, wait until the previous kernel in the stream finished
    and its memory operations are visible (PTX ``griddepcontrol.wait``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
