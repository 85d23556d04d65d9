"""Programmatic dependent launch (PDL) for this package's kernels (Hopper and later).

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has finished, so the
launch work of one kernel overlaps the tail of the previous one (also between the nodes of a CUDA graph captured
from such launches). It must then wait (PTX ``griddepcontrol.wait``) before it touches memory the previous
kernel writes or reads. Here every Triton kernel takes a ``PDL`` constexpr and calls :func:`pdl_wait` as its
first statement, every launch passes ``**pdl_launch(device)``, and the CUDA MoE kernels wait first thing when
launched with it (``vq_moe_mma_launch``'s ``pdl``). The wait is transitive: a kernel that waited for its
predecessor finishes after it, so waiting for the previous kernel alone orders a kernel after all earlier ones.
Right after its wait every kernel here also lets its own dependent launch (``griddepcontrol.launch_dependents``):
once all its programs have passed that point, the next PDL kernel's CTAs may occupy free SM resources and run up
to their wait; the CUDA FP8 kernels use that time to request their (constant) weights. The trigger needs every
CTA of the grid to be resident or finished, so the early CTAs never keep the previous kernel's from running.
Kernels that are not ours (cuBLAS, fla-core, PyTorch's) launch as before and are fully ordered; the runtime only
ever overlaps a kernel with a preceding kernel (memcpy, memset and event nodes stay fully ordered).
The Triton helper :func:`pdl_wait` lives in ``vibeqwen_kernels._pdl_kernels`` (imported by the kernel modules
only), so this module, and the package, import without Triton.

Measured on the H200 (tenth session, CUDA graph of 400 dependent small kernels): 0.93 -> 0.69 us per kernel.
``VIBEQWEN_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA device of sm_90+, not under Triton's interpreter, and
    ``VIBEQWEN_PDL`` not "0". Decided once per device and process."""
    if os.environ.get("VIBEQWEN_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch on ``device``: ``{"PDL": True, "launch_pdl": True}`` where
    :func:`pdl_enabled`, else ``{"PDL": False}`` (the kernel's constexpr, so its wait compiles away)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}
