"""The GPU path's model code (fused projections, the Triton kernels, fused residual norms, the device batch)
run on the CPU through Triton's interpreter, against the reference path on the same tiny weights.

This checks the wiring (splits of fused projections, slot and block bookkeeping, residual stream, the
shared expert folded into the MoE) on every CI run; the GPU tests check the same on real shapes.
Float32 throughout (the interpreter mishandles bf16), so the final hidden states differ only in summation
order: we assert 1e-4 relative (Frobenius) per pass, where any wiring error is O(1). The NVFP4 LM head
kernel rounds its input to bf16 for the tensor cores (2^-9 relative), so logits get 1e-2.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton's interpreter"),
              pytest.mark.slow]

SCRIPT = textwrap.dedent('''
    import dataclasses, os, sys, torch
    sys.path.insert(0, os.path.join(sys.argv[2], "tests", "model"))
    from seqrun import Sequences
    from vibeqwen.checkpoint.loader import load_checkpoint
    from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
    from vibeqwen.model.weights import Weights

    ckpt = load_checkpoint(sys.argv[1])
    models = {}
    for fast in ("0", "1"):
        os.environ["VIBEQWEN_FAST"] = fast
        w = Weights(ckpt.tensors, ckpt.precisions, torch.float32)
        models[fast] = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, w)
    assert models["1"].fast and not models["0"].fast
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 500, (n,), generator=g).tolist() for n in (11, 6))
    runs = {k: Sequences(m, num_seqs=3) for k, m in models.items()}
    # prefill two sequences together, then mixed decode / extend passes
    feeds = [{0: a, 2: b}, {0: [7], 2: [9]}, {2: [1, 2, 3], 0: [4]}, {0: [5], 2: [6]}]
    worst = [0.0, 0.0]
    hidden = {}
    for k, m in models.items():  # keep each pass's final hidden states as well as the logits
        orig = m.logits
        def logits(h, orig=orig, k=k):
            hidden[k] = h
            return orig(h)
        m.logits = logits
    for f in feeds:
        ref, fast = runs["0"].run(f), runs["1"].run(f)
        rel_h = ((hidden["1"] - hidden["0"]).norm() / hidden["0"].norm()).item()
        rel = ((fast - ref).norm() / ref.norm()).item()
        worst = [max(worst[0], rel_h), max(worst[1], rel)]
        assert rel_h < 1e-4 and rel < 1e-2, (f, rel_h, rel)
    # a W8A8 prompt pass (EngineConfig.fp8_prefill "w8a8"): more than FP8_DECODE_MAX_M rows, so the FP8
    # projections read E4M3 activations. The reference path emulates it (its FP8 Linears quantize their input
    # rows with quantize_rows_fp8_ref), so the two differ by fp32 summation order only: the fast path with the
    # quantization in FP8Linear (the torch quantizer on the CPU) must agree to 1e-4, where a 1% scale error
    # shows as ~3e-3. Then the fast path as on the GPU, with the norm kernels quantizing their outputs: the
    # interpreter's E4M3 conversion does not round to nearest even, so only ~1% agreement there (the codes
    # themselves are checked bit for bit on the GPU). The checkpoint is written with residual_scale 0.05: at
    # scale 1 this 4-layer model turns the rounding of a single code into percent-level logit changes.
    from vibeqwen.checkpoint.layout import Precision
    from vibeqwen.model import gdn, layers, qwen
    from vibeqwen.model.quant_linear import FP8_DECODE_MAX_M, prompt_pass, w8a8_active
    from vibeqwen_kernels.fp8 import quantize_rows_fp8_ref
    ckpt = load_checkpoint(sys.argv[3])
    calm = {}
    for fast in ("0", "1"):
        os.environ["VIBEQWEN_FAST"] = fast
        calm[fast] = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
    plain_linear = layers.Linear.__call__
    def w8a8_linear(self, x):
        if self.precision == Precision.FP8 and w8a8_active() and x.shape[0] > FP8_DECODE_MAX_M:
            q, s = quantize_rows_fp8_ref(x)
            x = q.float() * s
        return plain_linear(self, x)
    layers.Linear.__call__ = w8a8_linear
    c = torch.randint(0, 500, (FP8_DECODE_MAX_M + 6,), generator=g).tolist()
    def w8a8_pass(model):
        with prompt_pass(True):
            return Sequences(model, num_seqs=2).run({1: c})
    ref = w8a8_pass(calm["0"])
    fused_rows = qwen.w8a8_rows, gdn.w8a8_rows
    qwen.w8a8_rows = gdn.w8a8_rows = lambda *a: False
    rel_w8a8 = ((w8a8_pass(calm["1"]) - ref).norm() / ref.norm()).item()
    assert rel_w8a8 < 1e-4, rel_w8a8
    qwen.w8a8_rows, gdn.w8a8_rows = fused_rows
    rel_fused = ((w8a8_pass(calm["1"]) - ref).norm() / ref.norm()).item()
    assert rel_fused < 3e-2, rel_fused
    print("worst rel hidden %.2e logits %.2e; w8a8 prompt logits %.2e (norms quantizing: %.2e)"
          % (*worst, rel_w8a8, rel_fused))
''')


def test_fast_path_matches_reference_under_interpreter(tmp_path):
    import dataclasses

    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import ModelConfig

    # the tiny model with a small vocabulary: the interpreter runs every program of the LM head in Python
    cfg = dataclasses.replace(ModelConfig.named("tiny"), vocab_size=512, eos_token_id=None)
    path = write_checkpoint(cfg, tmp_path / "ckpt", seed=0)
    calm = write_checkpoint(cfg, tmp_path / "calm", seed=0, residual_scale=0.05)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(root), str(calm)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])


BF16_STATE_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    sys.path.insert(0, os.path.join(sys.argv[2], "tests", "model"))
    from seqrun import Sequences
    from vibeqwen.checkpoint.loader import load_checkpoint
    from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
    from vibeqwen.model.weights import Weights

    if os.environ.get("VIBEQWEN_GDN_NORM_TAIL", "1") == "1":  # every GDN pass here runs the recurrent kernel: its tail
        import vibeqwen_kernels.norm_fused as norm_fused

        def no_launch(*args, **kwargs):
            raise AssertionError("the gated RMSNorm ran as its own launch with the tail on")
        norm_fused.gated_rms_norm = no_launch
    ckpt = load_checkpoint(sys.argv[1])
    models, hidden = {}, {}
    for fast in ("0", "1"):
        os.environ["VIBEQWEN_FAST"] = fast
        m = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
        m.logits = lambda h, fast=fast: hidden.__setitem__(fast, h)  # the final hidden states are enough here
        models[fast] = m
    assert models["1"].fast and not models["0"].fast
    runs = {k: Sequences(m, num_seqs=2, state_dtype=torch.bfloat16) for k, m in models.items()}
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 500, (n,), generator=g).tolist() for n in (11, 6))
    # prefill both, decode both, a 4-token verification pass of sequence 0 (per-token states kept) next to a decode
    # of sequence 1, rolled back to 2 of its tokens, then decode both again
    feeds = [({0: a, 1: b}, set()), ({0: [7], 1: [9]}, set()), ({0: [1, 2, 3, 4], 1: [8]}, {0}),
             ({0: [5], 1: [6]}, set())]
    worst, worst_d = 0.0, 0.0
    for feed, keep in feeds:
        for k in ("0", "1"):
            runs[k].run(feed, keep)
        rel = ((hidden["1"] - hidden["0"]).norm() / hidden["0"].norm()).item()
        worst = max(worst, rel)
        assert rel < 5e-3, (feed, rel)
        for k in ("0", "1"):
            assert runs[k].cache.ssm_stacked.dtype == torch.bfloat16
        s_fast, s_ref = runs["1"].cache.ssm_stacked.float(), runs["0"].cache.ssm_stacked.float()
        ulp = torch.exp2(torch.floor(torch.log2(s_ref.abs().clamp_min(2.0 ** -126))) - 7)  # bf16 spacing
        d = ((s_fast - s_ref).abs() - 2 * ulp).max().item()  # beyond two ulps
        worst_d = max(worst_d, d)
        assert d < 1e-3, (feed, d)
        if keep:
            kept = runs["1"].last_batch.gdn_history_batched
            assert kept and all(st.dtype == torch.bfloat16 for _, _, st in kept.values())
            for k in ("0", "1"):
                runs[k].last_batch.commit_gdn_states({0: 2})
                runs[k].lens[0] -= 2
            for layer, (_, _, st) in kept.items():  # the slot holds the kept state after 2 of the 4 tokens
                assert torch.equal(runs["1"].cache.ssm[layer][0], st[1])
    print("worst rel hidden %.2e, states beyond 2 bf16 ulps %.2e" % (worst, worst_d))
''')


@pytest.mark.parametrize("norm_tail", ["0", "1"], ids=["norm-launch", "norm-tail"])
def test_fast_path_bf16_gdn_state_under_interpreter(tmp_path, norm_tail):
    """bf16 recurrent states (EngineConfig.gdn_state_dtype "bfloat16") through the GPU path's code (the recurrent
    kernel serves every GDN pass on the CPU), against the reference path with bf16 states on the same tiny
    weights: prefill, decode, and a verification pass keeping bf16 per-token states, rolled back. Both round what
    they store once, but the interpreter truncates where torch rounds to nearest: the final hidden states agree to
    5e-3 relative (observed 7e-4; a wrongly read or written state is O(1)), the states to two bf16 ulps + 1e-3. Run
    with the GDN gated RMSNorm as the recurrent kernel's tail (the default) and as its own launch
    (VIBEQWEN_GDN_NORM_TAIL=0)."""
    import dataclasses

    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.named("tiny"), vocab_size=512, eos_token_id=None)
    path = write_checkpoint(cfg, tmp_path / "ckpt", seed=0)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", VIBEQWEN_GDN_NORM_TAIL=norm_tail)
    proc = subprocess.run([sys.executable, "-c", BF16_STATE_SCRIPT, str(path), str(root)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
