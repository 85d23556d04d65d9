"""The Triton side of programmatic dependent launch (see :mod:`vibeqwen_kernels.pdl`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of every kernel here (the GDN recurrent kernel under early launch: after its state loads, see
    `vibeqwen_kernels.pdl`): with PDL (``PDL`` 1 or 2, see `vibeqwen_kernels.pdl.pdl_launch`),
    wait until the previous kernel in the stream finished and its memory operations are visible (PTX
    ``griddepcontrol.wait``); with ``PDL`` 2 then let the next PDL kernel launch early
    (``griddepcontrol.launch_dependents``: once every program of this grid has passed here, the next kernel's CTAs
    may be scheduled on free SM resources and run up to their own wait)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
