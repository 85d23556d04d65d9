"""Per-sequence model state for the reference path: attention KV and Gated DeltaNet states.

The engine-core issue replaces this with a paged KV cache and a pool of GDN state slots behind the same
`ForwardBatch` interface; the model only reads and appends through these methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceState:
    """Everything one sequence carries between forward passes.

    kv[layer] = (K [T, Hkv, D], V [T, Hkv, D]) for attention layers, in the compute dtype.
    conv[layer] = [C, W-1] conv inputs; ssm[layer] = [Hv, Dk, Dv] float32 recurrent state, for GDN layers.
    num_tokens: tokens already processed (the position of the next token).
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [T, Hkv, D] to the layer's cache; return the whole (K, V) including them."""
        if layer in self.kv:
            k0, v0 = self.kv[layer]
            k, v = torch.cat([k0, k]), torch.cat([v0, v])
        self.kv[layer] = (k, v)
        return k, v


@dataclass
class ForwardBatch:
    """A flattened batch: sequence i owns tokens [starts[i], starts[i] + query_lens[i]) of the inputs."""

    states: list[SequenceState]
    query_lens: list[int]

    @property
    def starts(self) -> list[int]:
        out, acc = [], 0
        for n in self.query_lens:
            out.append(acc)
            acc += n
        return out

    def slices(self):
        """Yield (state, slice into the flattened tokens) per sequence."""
        for state, start, n in zip(self.states, self.starts, self.query_lens):
            yield state, slice(start, start + n)
