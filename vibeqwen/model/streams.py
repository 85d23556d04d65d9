"""A side stream for independent work inside a layer: a fork/join branch of the decode CUDA graph.

Kernels of a decode step run as a chain on one stream, each waiting for the one before it. A kernel that needs
none of the chain's current outputs (GDN's b|a projection reads the layer's normed input, as the FP8 qkv|z
projection does) can instead run on a side stream next to the chain: it then costs the chain nothing where it
used to add its own launch and latency. Stream capture records the fork (the side stream waits for the main
stream's work so far) and the join (the main stream waits for the side stream) as graph edges, so a replay runs
the branch concurrently; eager passes get the same overlap.

Memory rule (the caching allocator ties a block to the stream that allocated it): a side branch writes only
tensors allocated on the main stream before the fork, and reads only tensors the caller keeps alive until after
the join; then no block is reused while the branch may still touch it. Kernels inside run without programmatic
dependent launch (`vibeqwen_kernels.pdl.without_pdl`): their dependency is the fork's event edge.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def side_streams_enabled() -> bool:
    """Whether layers fork side branches: ``VIBEQWEN_SIDE_STREAM`` not "0" (one chain, for comparison)."""
    return os.environ.get("VIBEQWEN_SIDE_STREAM", "1") != "0"


class SideBranch:
    """``with branch: ...`` runs the block on the device's side stream after everything queued so far on the current
    (main) stream; ``branch.join()`` makes the main stream's later work wait for it. Join before the tensors the
    block wrote are read, and before a CUDA-graph capture ends (an unjoined branch fails the capture).

    device: a CUDA device. Raises what torch.cuda raises for a device without CUDA."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.side = _side_stream(torch.device(device))
        self._ctx = None
        self._pdl = None

    def __enter__(self) -> "SideBranch":
        from vibeqwen_kernels.pdl import without_pdl

        self.side.wait_stream(self.main)
        self._ctx = torch.cuda.stream(self.side)
        self._ctx.__enter__()
        self._pdl = without_pdl()
        self._pdl.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._pdl.__exit__(*exc)
        self._ctx.__exit__(*exc)

    def join(self) -> None:
        self.main.wait_stream(self.side)
