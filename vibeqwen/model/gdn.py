"""Gated DeltaNet token mixer (the 3-of-4 linear-attention layers of Qwen3.6)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from vibeqwen_kernels import causal_conv1d_ref, gated_rms_norm_ref, gdn_chunk_ref, gdn_recurrent_ref

from vibeqwen.config import ModelConfig
from vibeqwen.model.quant_linear import fused_linear, gpu_linear, split_outputs, w8a8_rows
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights


class GatedDeltaNet:
    """in_proj_qkv -> causal conv1d + SiLU -> gated delta rule -> gated RMSNorm(z) -> out_proj.

    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) (DESIGN.md section 1). Prefill chunks use
    the chunked form, single-token decodes the recurrent form; both read and write the sequence's GDN
    state slot in `batch.cache`. The recurrent state is stored in the cache's state dtype (float32 or bfloat16,
    EngineConfig.gdn_state_dtype) and computed in float32: each pass upcasts the slot, keeps its running state in
    float32, and rounds only what it stores (the final state; with keep_states, each per-token state).
    """

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, layer: int):
        self.cfg, self.layer = cfg, layer
        self.fast = w.fast
        if self.fast:
            # in_proj_qkv | in_proj_z | in_proj_b | in_proj_a read the same input: one weight per precision
            # (vendor layout: qkv | z FP8, b | a BF16)
            self.in_proj, self.in_sizes = fused_linear(
                w, [prefix + n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
        else:
            self.in_proj_qkv = w.linear(prefix + "in_proj_qkv")
            self.in_proj_z = w.linear(prefix + "in_proj_z")
            self.in_proj_b = w.linear(prefix + "in_proj_b")
            self.in_proj_a = w.linear(prefix + "in_proj_a")
        self.conv_weight = w.param(prefix + "conv1d.weight").squeeze(1)  # [C, W]
        self.A_log = w.param(prefix + "A_log", torch.float32)
        self.dt_bias = w.param(prefix + "dt_bias", torch.float32)
        self.norm_weight = w.param(prefix + "norm.weight")
        self.out_proj = gpu_linear(w, prefix + "out_proj") if self.fast else w.linear(prefix + "out_proj")
        self._conv_weight_bf16 = None  # the taps as the decode projection's conv epilogue reads them (first use)
        # the persistent decode kernel's work counter (kernels/gdn/decode_cuda.py), on CUDA devices
        self.decode_counter = None
        if w.device.type == "cuda":
            from vibeqwen_kernels.gdn.decode_cuda import make_counter

            self.decode_counter = make_counter(w.device)
        # the recurrent kernel's gated-norm tail counters (kernels/gdn/recurrent.py: gdn_recurrent's gated_norm)
        self.norm_counter = None
        if self.fast:
            from vibeqwen_kernels.gdn.recurrent import norm_tail_counter

            self.norm_counter = norm_tail_counter(cfg.linear_num_value_heads, w.device)
        # ChunkPrefillGraphs shared by the GDN layers (Qwen3_5MoeForCausalLM.enable_prefill_graphs), or None
        self.chunk_graphs = None

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        if self.fast:
            return self.forward_gpu(x, batch)
        cfg = self.cfg
        t = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(t, hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [T, Hv]
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        core = torch.empty(t, hv, dv, dtype=x.dtype, device=x.device)
        conv_states, ssm_states = batch.cache.conv[self.layer], batch.cache.ssm[self.layer]
        for i, sl, ctx in batch.sequences():
            slot = batch.gdn_slots[i]
            # a sequence's first chunk starts from zero state, whatever a previous owner left in the slot
            conv0, ssm0 = (None, None) if ctx == 0 else (conv_states[slot].clone(), ssm_states[slot].clone())
            conv_out, conv_states[slot] = causal_conv1d_ref(mixed[sl], self.conv_weight, conv0)
            q, k, v = torch.split(conv_out, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
            n = q.shape[0]
            args = (q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g[sl], beta[sl], ssm0)
            if batch.keep_states[i]:
                # speculative verification: keep the state after every token so the engine can roll back, stored
                # (rounded) in the cache's state dtype as the GPU path stores it (.to: a no-op for float32)
                o, all_ssm = gdn_recurrent_ref(*args, output_all_states=True)
                all_ssm = all_ssm.to(ssm_states.dtype)
                ssm_states[slot] = all_ssm[-1]
                w = self.conv_weight.shape[-1]
                window = torch.cat([conv0 if conv0 is not None else mixed.new_zeros(mixed.shape[1], w - 1),
                                    mixed[sl].t().to(conv_states.dtype)], dim=1)  # [C, W-1+n]
                all_conv = window.unfold(1, w - 1, 1)[:, 1:].permute(1, 0, 2)  # [n, C, W-1]
                batch.gdn_history[(self.layer, i)] = (all_conv, all_ssm)
            else:  # the float32 final state, rounded to the slot's dtype by the assignment
                o, ssm_states[slot] = gdn_recurrent_ref(*args) if n == 1 else gdn_chunk_ref(*args)
            core[sl] = o
        out = gated_rms_norm_ref(core, z, self.norm_weight, cfg.rms_norm_eps)
        return self.out_proj(out.reshape(t, hv * dv))

    @property
    def input_projection(self):
        """The fused input projection (GPU path): what the layer's norm may quantize its output for."""
        return self.in_proj

    @property
    def output_projection(self):
        """The output projection (GPU path): what `forward_gpu(..., project=False)`'s result goes into."""
        return self.out_proj

    def forward_gpu(self, x: torch.Tensor, batch: ForwardBatch, xq=None, project: bool = True) -> torch.Tensor:
        """The GPU path over the whole batch: fused input projection, Triton causal conv1d, then the
        gated delta rule: fla-core's chunked kernel for prefill-sized queries, our fused recurrent kernel for
        decode and speculative verification (which also keeps the state after every token when asked; decode steps
        of 32+ sequences take its persistent CUDA version, `_cuda_decode`), the
        gated RMSNorm kernel and the output projection. x: [T, H] -> [T, H]. xq: x quantized for a W8A8
        input projection (`QuantizedRows`) or None. In a W8A8 prompt pass the gated RMSNorm kernel quantizes
        its output for the output projection (`gated_rms_norm_fp8`). project=False: returns the output
        projection's input instead ([T, Hv * Dv], or its `QuantizedRows`), for the caller to fuse what follows."""
        from vibeqwen_kernels.conv1d.causal import causal_conv1d

        cfg, meta = self.cfg, batch.device_batch()
        t = x.shape[0]
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        conv_states, ssm_states = batch.cache.conv[self.layer], batch.cache.ssm[self.layer]
        keep = any(batch.keep_states)
        decode = self._decode_projection(x, batch, meta, xq, keep)
        if decode is not None:  # a decode step: conv1d + SiLU done in the projection's epilogue
            conv_out, z, b, a, branch = decode
            return self._mix_gpu(conv_out, z.view(t, hv, dv), a, b, branch, ssm_states, batch, meta, False, None,
                                 project)
        mixed, z, b, a = split_outputs(self.in_proj, x, self.in_sizes, xq)
        z = z.view(t, hv, dv)
        bufs = None
        if keep:  # the conv state before this pass (zero for a new sequence): the start of every token's window
            bufs = batch.history_buffers.get(self.layer) if batch.history_buffers is not None else None
            if bufs is not None and t <= bufs[0].shape[0]:
                # preallocated (shared by every verification graph): no per-graph copies of 2 MiB a token
                conv0 = bufs[2][: meta.num_seqs]
                torch.index_select(conv_states, 0, meta.gdn_slots, out=conv0)
                conv0.masked_fill_(~meta.has_initial_state[:, None, None], 0)
            else:
                bufs = None
                conv0 = conv_states.index_select(0, meta.gdn_slots)
                conv0 = torch.where(meta.has_initial_state[:, None, None], conv0, torch.zeros_like(conv0))
        conv_out = causal_conv1d(mixed, self.conv_weight, conv_states, meta.gdn_slots, meta.query_start_loc,
                                 meta.has_initial_state, meta.max_query_len)
        return self._mix_gpu(conv_out, z, a, b, None, ssm_states, batch, meta, keep, (mixed, conv0, bufs) if keep else None,
                             project)

    def _decode_projection(self, x: torch.Tensor, batch: ForwardBatch, meta, xq, keep: bool):
        """A decode step's input projection in two branches, or None where it does not apply: the FP8 qkv|z GEMM
        with the causal conv1d + SiLU and the conv-state shift in its epilogue (`fp8_linear_mma_conv`, bit for
        bit the two launches), and the b|a GEMM on a side stream (`vibeqwen.model.streams`), so neither adds a
        dependent launch to the chain. Applies to passes of one token per sequence (row m = sequence m) without
        kept states, bf16 rows on the CUDA FP8 kernel (not W8A8 rows, `w8a8_rows`). Returns (conv_out [T, C], z,
        b, a, the side branch or None: join it before b or a is read)."""
        from vibeqwen.model.quant_linear import ConcatLinear, DenseLinear, FP8Linear

        t = x.shape[0]
        if (keep or xq is not None or batch.padded_prefill or not x.is_cuda or x.dtype != torch.bfloat16
                or meta.max_query_len != 1 or t != meta.num_seqs or not isinstance(self.in_proj, ConcatLinear)
                or w8a8_rows(self.in_proj, t)):
            return None
        groups = self.in_proj.groups
        if (len(groups) != 2 or not isinstance(groups[0], FP8Linear) or groups[0].mma is None
                or not isinstance(groups[1], DenseLinear)):
            return None
        c = self.cfg.gdn_conv_dim
        conv_states = batch.cache.conv[self.layer]
        if self.in_proj.group_sizes[0][0] != c or conv_states.dtype != torch.bfloat16:
            return None
        from vibeqwen_kernels.fp8.mma import fp8_conv_supported, fp8_linear_mma_conv

        fp8, dense = groups
        if not fp8_conv_supported(t, fp8.mma, c, self.conv_weight.shape[-1]):
            return None
        if self._conv_weight_bf16 is None:
            self._conv_weight_bf16 = self.conv_weight.to(torch.bfloat16).contiguous()
        from vibeqwen.model.streams import SideBranch, side_streams_enabled

        ba = torch.empty((t, dense.out_features), dtype=x.dtype, device=x.device)
        branch = None
        if side_streams_enabled():
            branch = SideBranch(x.device)
            with branch:
                dense(x, out=ba)
        else:
            dense(x, out=ba)
        out = fp8_linear_mma_conv(x, fp8.mma, self._conv_weight_bf16, conv_states, meta.gdn_slots,
                                  meta.has_initial_state)
        nb = self.in_proj.group_sizes[1][0]
        return out[:, :c], out[:, c:], ba[:, :nb], ba[:, nb:], branch

    def _mix_gpu(self, conv_out, z, a, b, branch, ssm_states, batch: ForwardBatch, meta, keep: bool, kept,
                 project: bool = True):
        """The rest of `forward_gpu` from the conv output on: the gated delta rule, the gated RMSNorm and the
        output projection (project=False: its input). branch: a side branch that wrote a / b (joined here), or
        None. kept: (mixed, conv0, history buffers) for a pass that keeps the GDN states, else None."""
        from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
        from vibeqwen_kernels.norm_fused import gated_rms_norm, gated_rms_norm_fp8, gated_rms_norm_fp8_supports

        cfg = self.cfg
        t = conv_out.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kd = cfg.gdn_key_dim
        q = conv_out[:, :kd].view(t, hk, dk)
        k = conv_out[:, kd : 2 * kd].view(t, hk, dk)
        v = conv_out[:, 2 * kd :].view(t, hv, dv)
        args = (q, k, v, a, b, self.A_log, self.dt_bias, ssm_states, meta.gdn_slots, meta.query_start_loc,
                meta.has_initial_state, meta.max_query_len)
        if branch is not None:
            branch.join()
        tail = None  # the recurrent kernel's gated_norm (the norm in its launch), where it takes one
        if batch.padded_prefill:
            # a whole-chunk prefill graph (PrefillGraphs): the real sequence's T tokens and the padding row as
            # ONE sequence of all t rows, masked on the device at n = T (exact; no host reads, so one graph
            # serves every T <= t); row 0's state slot in and out. conv1d above kept both rows apart, so row
            # 0's conv state holds its own last tokens.
            from vibeqwen_kernels.gdn.chunk_fla import gdn_chunk_padded_slot

            core = gdn_chunk_padded_slot(q, k, v, a, b, self.A_log, self.dt_bias, ssm_states, meta.gdn_slots[:1],
                                         meta.has_initial_state[:1], meta.query_start_loc[1:2])
        elif meta.max_query_len > RECURRENT_MAX_QUERY and not keep and conv_out.is_cuda and _fla_available():
            from vibeqwen_kernels.gdn.chunk_fla import gdn_chunk_prefill

            core = gdn_chunk_prefill(*args, query_start_loc_cpu=meta.query_start_loc_cpu, graphs=self.chunk_graphs)
        elif _cuda_decode(keep, meta.max_query_len, q, k, v, a, b, ssm_states, self.decode_counter):
            # a decode step: the persistent CUDA kernel (the next units' states in flight while one is multiplied)
            from vibeqwen_kernels.gdn.decode_cuda import gdn_recurrent_decode

            core = gdn_recurrent_decode(q, k, v, a, b, self.A_log, self.dt_bias, ssm_states, meta.gdn_slots,
                                        meta.query_start_loc, meta.has_initial_state, self.decode_counter)
        else:
            # speculative verification: the recurrent kernel also writes the state after every token; with
            # the conv inputs that is everything `ForwardBatch.commit_gdn_states` needs to roll back
            states = None
            if keep:
                mixed, conv0, bufs = kept
                if bufs is not None:
                    states, kept_inputs = bufs[0][:t], bufs[1][:t]
                    kept_inputs.copy_(mixed)
                else:
                    states = torch.empty(t, hv, dk, dv, dtype=ssm_states.dtype, device=conv_out.device)
                    kept_inputs = mixed
            tail = self._norm_tail(z, t, meta)
            core = gdn_recurrent(*args, intermediate_states=states, gated_norm=tail)
            if keep:
                batch.gdn_history_batched[self.layer] = (conv0, kept_inputs, states)
        if tail is not None:  # the gated RMSNorm ran as the recurrent kernel's tail: core is its output
            out = core.reshape(t, hv * dv)
        elif w8a8_rows(self.out_proj, t) and gated_rms_norm_fp8_supports(hv, dv):
            out = gated_rms_norm_fp8(core, z, self.norm_weight, cfg.rms_norm_eps)
        else:
            out = gated_rms_norm(core, z, self.norm_weight, cfg.rms_norm_eps).reshape(t, hv * dv)
        return self.out_proj(out) if project else out

    def _norm_tail(self, z, t: int, meta):
        """``gdn_recurrent``'s ``gated_norm`` for a pass of ``t`` tokens over ``meta``'s sequences (padding ones
        included: the launch's grid), or None to run the gated RMSNorm as its own launch: the tail where it is on
        (``recurrent.norm_tail``), the pass is a decode or verification step (at most RECURRENT_MAX_QUERY tokens a
        sequence: a prompt's tokens would be normed one after another by one program a head), the counter covers the
        batch and the output projection takes bf16 rows (not a W8A8 prompt pass, whose norm quantizes)."""
        from vibeqwen_kernels.gdn.recurrent import NORM_TAIL_MAX_SEQS, norm_tail

        if (self.norm_counter is None or not norm_tail() or meta.gdn_slots.shape[0] > NORM_TAIL_MAX_SEQS
                or meta.max_query_len > RECURRENT_MAX_QUERY or w8a8_rows(self.out_proj, t) or z.stride(2) != 1):
            return None
        return z, self.norm_weight, self.cfg.rms_norm_eps, self.norm_counter


def _cuda_decode(keep: bool, max_query_len: int, q, k, v, a, b, ssm_states, counter) -> bool:
    """Whether a step's delta rule runs on the persistent CUDA decode kernel (`gdn_recurrent_decode`: one token per
    sequence, at least `model_min_seqs` tokens (so sequences), no kept states, CUDA tensors of the shapes it takes,
    `VIBEQWEN_GDN_PERSIST` not 0) rather than the Triton recurrent kernel."""
    if keep or max_query_len != 1 or not q.is_cuda or counter is None:
        return False
    from vibeqwen_kernels.gdn.decode_cuda import decode_supported, model_min_seqs

    return q.shape[0] >= model_min_seqs() and decode_supported(q, k, v, a, b, ssm_states)


#: Longest query the fused recurrent kernel serves (decode, speculative verification); longer -> fla chunk.
RECURRENT_MAX_QUERY = 16


@functools.lru_cache(maxsize=1)
def _fla_available() -> bool:
    """fla-core runs the chunked prefill on a GPU; without it the recurrent kernel serves prefill too (slower).
    Checked once per process."""
    from vibeqwen_kernels.gdn.chunk_fla import fla_available

    ok = fla_available()
    if not ok:
        logging.getLogger(__name__).warning("fla-core is not installed: GDN prefill runs the recurrent kernel "
                                            "(pip install fla-core for the chunked kernel)")
    return ok
