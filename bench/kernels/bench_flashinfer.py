"""FlashInfer's paged attention against ours (``kernels/attention/paged.py``) at the model's shapes on the GPU: 16 q /
2 kv heads, head_dim 256, bf16, 16-token pages, NHD layout (the engine's cache: ``k[layer], v[layer]`` of
``[blocks, 16, 2, 256]``, which FlashInfer reads as they are).

* Decode, batch x context: ours (split-KV + merge, with and without the fused sigmoid output gate) against
  ``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-graph mode, tensor-core and CUDA-core kernels). Timed as replays of
  one CUDA graph calling each path once per disjoint copy of the KV (together 134 MB or more, past the 60 MB L2: each
  call reads its K/V from HBM, as in a real step); us per call, and the K/V bytes over the copy bandwidth measured
  here (floor).
* Prefill of 1k and 8k tokens, one sequence, no earlier context: ours against ``BatchPrefillWithPagedKVCacheWrapper``
  (backends fa2 and fa3), causal; TFLOP/s.

Every FlashInfer output is first compared with ours (relative L2 difference; both are bf16 FlashAttention-style
kernels with fp32 softmax). FlashInfer compiles each kernel on first use (printed: seconds), into
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``. Needs ``flashinfer-python`` and ``apache-tvm-ffi``
(``../shared/tools/gpu-wheels.sh`` stages them) and, on a host without them, the pure-Python packages its import
reads: packaging, requests (urllib3, idna, certifi, charset-normalizer), nvidia-ml-py, tqdm, einops (bench/run_h200.sh
installs ``.whl-fi/`` when it travels). Prints a table last. H200 figures: bench/results/h200_notes.md, twenty-seventh
session.

    python bench/kernels/bench_flashinfer.py [--cases 1x1024,8x1024,32x1024,64x1024,32x8192] [--prefill 1024,8192]
        [--prefill-backends fa2,fa3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import D, HKV, HQ, PAGE, ROTATE_BYTES, _make, _time_graph  # noqa: E402
from bench_decode_attention import _copy_bandwidth  # noqa: E402

WORKSPACE_BYTES = 64 << 20


def _paged_layout(bt: torch.Tensor, sl: torch.Tensor):
    """Block tables [B, nblk] + seq_lens [B] -> FlashInfer's (indptr [B+1], indices, last_page_len [B]), int32."""
    nblk = (sl + PAGE - 1) // PAGE
    indptr = torch.zeros(sl.shape[0] + 1, dtype=torch.int32, device=sl.device)
    indptr[1:] = torch.cumsum(nblk, 0)
    cols = torch.arange(bt.shape[1], device=bt.device)[None, :] < nblk[:, None]
    indices = bt[cols].to(torch.int32).contiguous()
    last = (sl - (nblk - 1) * PAGE).to(torch.int32)
    return indptr.to(torch.int32), indices, last


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_case(fi, batch: int, ctx: int, gen, bw: float) -> dict:
    """One decode case: ``batch`` sequences of ``ctx`` cached tokens + 1 new (q bf16 [batch, 16, 256]); ``bw`` the
    copy bandwidth in bytes/s. Returns the row printed: floor / ours / FlashInfer times in us per call, FlashInfer's
    first-call (JIT) seconds and relative L2 difference from ours, or ``*_error`` where a FlashInfer kernel failed."""
    from vibeqwen_kernels.attention.paged import paged_attention

    dev = torch.device("cuda")
    kv_bytes = batch * (ctx + 1) * HKV * D * 2 * 2
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))
    qg, kc, vc, bts, sl, qsl = _make(batch, ctx, 1, copies, dev, gen)
    q = qg.contiguous()  # [B, Hq, D]
    gate = torch.randn(q.shape, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    row = {"batch": batch, "context": ctx, "floor_us": round(kv_bytes / bw * 1e6, 2)}

    def ours(g=None):
        for bt in bts:
            paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, 1, out=out, gate=g)

    paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, 1, out=out)
    ref = out.clone()
    row["ours_us"] = round(_time_graph(ours) / copies * 1e6, 2)
    row["ours_gate_us"] = round(_time_graph(lambda: ours(gate)) / copies * 1e6, 2)
    for tc in (True, False):
        name = "fi_tc" if tc else "fi_cc"
        wrappers = []
        t0 = time.time()
        # one float workspace (split-KV partials) for every wrapper: their runs are sequential on one stream
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        try:
            for bt in bts:
                indptr, indices, last = _paged_layout(bt, sl)
                w = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True,
                    use_tensor_cores=tc, paged_kv_indptr_buffer=indptr.clone(),
                    paged_kv_indices_buffer=indices.clone(), paged_kv_last_page_len_buffer=last.clone())
                w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16, sm_scale=D**-0.5)
                wrappers.append(w)
            fo = torch.empty_like(q)
            wrappers[0].run(q, (kc, vc), out=fo)
            torch.cuda.synchronize()
            row[name + "_first_s"] = round(time.time() - t0, 1)
            row[name + "_rel_diff"] = float(f"{_rel(fo, ref):.2e}")

            def fi_run():
                for w in wrappers:
                    w.run(q, (kc, vc), out=fo)

            row[name + "_us"] = round(_time_graph(fi_run) / copies * 1e6, 2)
        except Exception as e:  # report and go on: one kernel's failure should not hide the others
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del wrappers
    print(json.dumps(row), flush=True)
    return row


def prefill_case(fi, t: int, gen, backends=("fa2", "fa3")) -> dict:
    """One causal prefill of ``t`` tokens (q bf16 [t, 16, 256], no earlier context). Returns the row printed: ms per
    call and TFLOP/s (causal FLOPs 2 * 2 * Hq * D * t (t + 1) / 2) of ours and of each FlashInfer backend, its
    first-call seconds and relative L2 difference from ours, or ``<backend>_error`` where it failed."""
    from vibeqwen_kernels.attention.paged import paged_attention

    dev = torch.device("cuda")
    qg, kc, vc, bts, sl, qsl = _make(1, 0, t, 1, dev, gen)
    q = qg.contiguous()
    out = torch.empty_like(q)
    flops = 2 * 2 * HQ * D * t * (t + 1) / 2
    paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, t, out=out)
    ref = out.clone()
    sec = _time_graph(lambda: paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, t, out=out), reps=10)
    row = {"tokens": t, "ours_ms": round(sec * 1e3, 3), "ours_tflops": round(flops / sec / 1e12, 1)}
    indptr, indices, last = _paged_layout(bts[0], sl)
    for backend in backends:
        t0 = time.time()
        try:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES * 4, dtype=torch.uint8, device=dev),
                                                       "NHD", backend=backend)
            w.plan(qsl, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, sm_scale=D**-0.5,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            fo = torch.empty_like(q)
            w.run(q, (kc, vc), out=fo)
            torch.cuda.synchronize()
            row[backend + "_first_s"] = round(time.time() - t0, 1)
            row[backend + "_rel_diff"] = float(f"{_rel(fo, ref):.2e}")
            sec = _time_graph(lambda: w.run(q, (kc, vc), out=fo), reps=10)
            row[backend + "_ms"] = round(sec * 1e3, 3)
            row[backend + "_tflops"] = round(flops / sec / 1e12, 1)
        except Exception as e:
            row[backend + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description="FlashInfer's paged decode / prefill against ours (model shapes)")
    ap.add_argument("--cases", default="1x1024,8x1024,32x1024,64x1024,32x8192")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--prefill-backends", default="fa2,fa3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        import flashinfer as fi
    except ImportError as e:
        sys.exit(f"flashinfer is not importable here: {e}")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = _copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: flashinfer {fi.__version__}, copy {bw / 1e12:.2f} TB/s", flush=True)
    dec = [decode_case(fi, *map(int, c.split("x")), gen, bw) for c in args.cases.split(",") if c]
    pre = [prefill_case(fi, int(t), gen, args.prefill_backends.split(",")) for t in args.prefill.split(",") if t]
    print("| batch x ctx | floor us | ours us | ours + gate us | FlashInfer TC us | FlashInfer CUDA-core us |")
    print("|---|---|---|---|---|---|")
    for r in dec:
        print(f"| {r['batch']} x {r['context']} | {r['floor_us']} | {r['ours_us']} | {r['ours_gate_us']} | "
              f"{r.get('fi_tc_us', 'error')} | {r.get('fi_cc_us', 'error')} |")
    print("| prefill tokens | ours ms | FlashInfer fa2 ms | FlashInfer fa3 ms |")
    print("|---|---|---|---|")
    for r in pre:
        print(f"| {r['tokens']} | {r['ours_ms']} | {r.get('fa2_ms', 'error')} | {r.get('fa3_ms', 'error')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "flashinfer": fi.__version__,
                       "copy_tbs": round(bw / 1e12, 3), "decode": dec, "prefill": pre}, f, indent=1)


if __name__ == "__main__":
    main()
