"""Programmatic dependent launch (PDL) for this package's kernels (Hopper and later).

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has finished, so the
launch work of one kernel overlaps the tail of the previous one (also between the nodes of a CUDA graph captured
from such launches). It must then wait (PTX ``griddepcontrol.wait``) before it touches memory the previous
kernel writes or reads. Here every Triton kernel takes a ``PDL`` constexpr and calls :func:`pdl_wait` as its
first statement (one exception under early launch, below), every launch passes ``**pdl_launch(device)``, and the
CUDA MoE kernels wait first thing when launched with it (``vq_moe_mma_launch``'s ``pdl``). The wait is transitive:
a kernel that waited for its predecessor finishes after it, so waiting for the previous kernel alone orders a kernel
after all earlier ones.
Inside :func:`early_launch` (the decode CUDA graphs of up to :data:`EARLY_MAX_TOKENS` tokens) a kernel also lets
its own dependent launch right after its wait (``griddepcontrol.launch_dependents``; ``PDL`` 2 for the Triton
kernels, ``pdl`` 2 for the CUDA launchers): once all its programs have passed that point, the next PDL kernel's
CTAs may occupy free SM resources and run up to their wait, so they start the moment it ends; the CUDA FP8, bf16
and router GEMMs then also request their constant weights before their wait (only then: outside the decode graphs
the previous kernel may be the one that wrote them, at load time), and the GDN recurrent kernel its state slices and
the graph's metadata: in a decode or verification graph the kernel just ahead of it (the input projection, a copy or
the conv1d) writes neither; the state was last written two or more launches back (this kernel in an earlier pass,
or the eager commit / prefill kernels before the replay), the metadata by host copies before the replay
(``VIBEQWEN_GDN_EARLY_STATE=0`` waits first; tests/kernels/test_pdl.py checks what it reads early). The same holds
for its persistent CUDA version for decode steps (``csrc/gdn_decode.cu``): its first state slices and the metadata.
The trigger needs every CTA of the grid
to be resident or finished, so the early CTAs never keep the previous kernel's from running. Measured on the
H200 (thirteenth session, decode step at 1k context): batch 1 / 8 / 32 / 64 2.57 / 4.25 / 8.61 / 12.63 ms without,
2.40 / 4.10 / 8.53 / 12.90 with early launch in every kernel: it pays for small batches, not at 64 tokens (early
CTAs take whatever SMs are free, not an even spread), hence the token bound.
Kernels that are not ours (cuBLAS, fla-core, PyTorch's) launch as before and are fully ordered; the runtime only
ever overlaps a kernel with a preceding kernel (memcpy, memset and event nodes stay fully ordered).
The Triton helper :func:`pdl_wait` lives in ``vibeqwen_kernels._pdl_kernels`` (imported by the kernel modules
only), so this module, and the package, import without Triton.

Measured on the H200 (tenth session, CUDA graph of 400 dependent small kernels): 0.93 -> 0.69 us per kernel.
``VIBEQWEN_PDL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

#: decode graphs of up to this many tokens (batch x tokens per sequence) are captured with early launch
EARLY_MAX_TOKENS = 32
_early = False  # inside early_launch(True); a process global: only the engine's thread launches GPU work
_off = False  # inside without_pdl()


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA device of sm_90+, not under Triton's interpreter, and
    ``VIBEQWEN_PDL`` not "0". Decided once per device and process."""
    if os.environ.get("VIBEQWEN_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_mode(device: torch.device) -> int:
    """The launch mode on ``device``: 0 without PDL, 1 with it, 2 with it and early launch of the next kernel
    (inside :func:`early_launch`). The CUDA launchers' ``pdl`` argument."""
    if _off or not pdl_enabled(device):
        return 0
    return 2 if _early else 1


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch on ``device``: ``{"PDL": 1 or 2, "launch_pdl": True}`` where
    :func:`pdl_enabled` (:func:`pdl_mode`), else ``{"PDL": False}`` (the kernel's constexpr, so its wait compiles
    away; 2 compiles the early trigger in)."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": False}


@contextlib.contextmanager
def early_launch(enabled: bool = True):
    """Launches made inside (from this process; CUDA-graph capture included) let the next kernel launch early where
    PDL is on (:func:`pdl_mode` 2). ``VIBEQWEN_PDL_EARLY=0`` makes this a no-op (for comparison)."""
    global _early
    prev = _early
    _early = bool(enabled) and os.environ.get("VIBEQWEN_PDL_EARLY", "1") != "0"
    try:
        yield
    finally:
        _early = prev


@contextlib.contextmanager
def without_pdl():
    """Launches made inside use no PDL at all (:func:`pdl_mode` 0): fully ordered after everything they depend on.
    For kernels on a side stream of a CUDA graph (``vibeqwen.model.streams``), whose dependencies come through an
    event, not from the kernel ahead of them in their own stream."""
    global _off
    prev, _off = _off, True
    try:
        yield
    finally:
        _off = prev
