"""A decode step's attention block on the GPU (model shapes: 16 q / 2 kv heads, head_dim 256, rotary 64, bf16,
16-token pages): ``qk_norm_rope_store`` + ``paged_attention`` (three launches: norm/RoPE/store, split-KV, merge)
against ``fused_decode_attention`` (two: the norm, RoPE and store inside the split-KV kernel, then the merge).

Timed as replays of one CUDA graph calling the block once per disjoint copy of the KV cache (together > 4x the
60 MB L2, so each call reads its K/V from HBM, as in a real step); us per call. Bytes = the K + V read
(B * ctx * Hkv * D * 2 * 2) plus the raw q/k/v rows; the ratio to them at the measured copy bandwidth is printed as
floor (us) and x floor. Each case is first checked: the fused output against the three launches' (bf16 merge-order
tolerance) and the cache rows both write.

    python bench/kernels/bench_decode_attention.py [--cases 1x1024,8x1024,32x1024,1x8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import D, HKV, HQ, PAGE, ROTATE_BYTES, _make, _time_graph  # noqa: E402


def _copy_bandwidth(dev) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        b.copy_(a)
    t1.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 5 / (t0.elapsed_time(t1) / 1e3)


def bench_case(batch: int, ctx: int, gen, bw: float) -> dict:
    from vibeqwen_kernels.attention.decode_fused import fused_decode_attention
    from vibeqwen_kernels.attention.paged import paged_attention
    from vibeqwen_kernels.attention.rope_norm import qk_norm_rope_store

    dev = torch.device("cuda")
    kv_bytes = batch * (ctx + 1) * HKV * D * 2 * 2
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))
    _, kc, vc, bts, sl, qsl = _make(batch, ctx, 1, copies, dev, gen)
    qg = torch.randn(batch, HQ, 2 * D, device=dev, generator=gen).to(torch.bfloat16)
    kv = torch.randn(batch, 2 * HKV, D, device=dev, generator=gen).to(torch.bfloat16)
    k, v = kv[:, :HKV], kv[:, HKV:]
    qw = (torch.randn(D, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    kw = (torch.randn(D, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    pos = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
    slots = [(bt[:, ctx // PAGE].long() * PAGE + ctx % PAGE).contiguous() for bt in bts]
    out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=dev)
    norm = (qg, k, v, qw, kw, 1e-6, pos, 64, 1e7)

    def three(i, kc_, vc_, o):
        q = qk_norm_rope_store(*norm, kc_, vc_, slots[i])
        paged_attention(q, kc_, vc_, bts[i], sl, qsl, D**-0.5, 1, out=o, gate=qg[..., D:])

    def fused(i, kc_, vc_, o):
        fused_decode_attention(*norm, kc_, vc_, slots[i], bts[i], sl, qsl, D**-0.5, 1, out=o, gate=qg[..., D:])

    # check on copy 0
    kc2, vc2, out2 = kc.clone(), vc.clone(), torch.empty_like(out)
    three(0, kc, vc, out)
    fused(0, kc2, vc2, out2)
    ref = out.float()
    err = ((out2.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"fused_decode_attention mismatch: {err:.2e}"
    assert torch.equal(vc, vc2), "v cache rows differ"
    kdiff = (kc.float() - kc2.float()).abs().max().item()
    del kc2, vc2
    from vibeqwen_kernels.attention import decode_fused as DF
    from vibeqwen_kernels.attention import paged as P

    # each path with each of its candidate configs (the first of each list is what the model runs)
    times = {}
    for name, f, table, key in (("three", three, P._CONFIGS, "split_small"), ("fused", fused, DF.CONFIGS, "small")):
        saved = list(table[key])
        for cfg in saved:
            table[key] = [cfg]
            P._chosen.clear()
            label = f"{cfg['BLOCK_N']}/{cfg['num_warps']}/{cfg['num_stages']}"
            times[(name, label)] = _time_graph(lambda f=f: [f(i, kc, vc, out) for i in range(copies)]) / copies
        table[key] = saved
        P._chosen.clear()
    best = {n: min((t, lab) for (m, lab), t in times.items() if m == n) for n in ("three", "fused")}
    first = {n: next(t for (m, _), t in times.items() if m == n) for n in ("three", "fused")}
    print(f"B={batch} ctx={ctx}: " + ", ".join(f"{m} {lab} {t * 1e6:.2f}" for (m, lab), t in times.items()), flush=True)
    nbytes = kv_bytes + batch * (HQ * 2 * D + 2 * HKV * D) * 2
    floor = nbytes / bw
    return {"batch": batch, "ctx": ctx, "three_us": first["three"] * 1e6, "fused_us": first["fused"] * 1e6,
            "three_best": [best["three"][0] * 1e6, best["three"][1]],
            "fused_best": [best["fused"][0] * 1e6, best["fused"][1]],
            "floor_us": floor * 1e6, "max_rel_err": err, "k_cache_max_diff": kdiff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1x1024,8x1024,32x1024,1x8192,32x8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention: needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = _copy_bandwidth(dev)
    rows = []
    for case in args.cases.split(","):
        b, c = (int(x) for x in case.split("x"))
        rows.append(bench_case(b, c, gen, bw))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| batch | ctx | three launches us (best config) | fused us (best config) | floor us | fused / floor | "
          "max rel err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ctx']} | {r['three_us']:.2f} ({r['three_best'][0]:.2f} {r['three_best'][1]}) | "
              f"{r['fused_us']:.2f} ({r['fused_best'][0]:.2f} {r['fused_best'][1]}) | {r['floor_us']:.2f} | "
              f"{r['fused_us'] / r['floor_us']:.2f}x | {r['max_rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "copy_tbps": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
