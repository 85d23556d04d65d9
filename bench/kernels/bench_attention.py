"""Paged attention on the GPU (model shapes: 16 q heads, 2 kv heads, head_dim 256, bf16, block_size 16).

* decode, batch {1, 8, 32, 64} x context {1k, 8k} (split-KV kernel): timed as replays of a CUDA graph that
  calls `paged_attention` over several disjoint copies of the KV (together 134 MB or more, past the 60 MB L2, so
  each call reads its K/V from HBM, as in a real step). Bytes = K + V read (B * ctx * Hkv * D * 2 * 2); fraction
  of 4.3 TB/s (H200 HBM3e peak).
* verify, batch {8, 64} x q_len 4 x context 8k (split-KV kernel, speculative verification).
* prefill of 1k and 8k tokens, one sequence, no prior context (prefill kernel): causal FLOPs =
  2 * 2 * Hq * D * sum over queries of keys seen; TFLOP/s and fraction of 989 (H200 dense bf16 peak).

Every case is first checked against `attention_ref` (per sequence, fp32) on a smaller instance. With
--tune, each path's candidate configs are timed and the best printed (copy it to `_CONFIGS` in
kernels/attention/paged.py). Finishes in well under 2 minutes without --tune.

    python bench/kernels/bench_attention.py [--tune] [--json PATH]
    python bench/kernels/bench_attention.py --sweep-splits 4,8,16,32   # decode at each split count against the rule
"""

from __future__ import annotations

import argparse
import json
import math

import torch

HQ, HKV, D, PAGE = 16, 2, 256, 16
HBM_BPS = 4.3e12
PEAK_FLOPS = 989e12
ROTATE_BYTES = 256 << 20


def _make(batch, ctx, qlen, copies, dev, gen):
    """Cache with `copies` disjoint sets of block tables, each batch x (ctx + qlen) tokens."""
    seq = ctx + qlen
    nblk = -(-seq // PAGE)
    total = copies * batch * nblk
    kc = torch.randn(total, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(total, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(total, device=dev, generator=gen).int()
    bts = [
        perm[r * batch * nblk : (r + 1) * batch * nblk].view(batch, nblk).contiguous() for r in range(copies)
    ]
    q = torch.randn(batch * qlen, HQ, 2 * D, device=dev, dtype=torch.bfloat16, generator=gen)[:, :, :D]
    sl = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, batch * qlen + 1, qlen, dtype=torch.int32, device=dev)
    return q, kc, vc, bts, sl, qsl


def _check(q, kc, vc, bt, sl, qsl, out):
    from vibeqwen_kernels import attention_ref

    worst = 0.0
    for b in range(sl.shape[0]):
        pos = torch.arange(int(sl[b]), device=q.device)
        blocks = bt[b, pos // PAGE].long()
        r0, r1 = int(qsl[b]), int(qsl[b + 1])
        ref = attention_ref(
            q[r0:r1].float(), kc[blocks, pos % PAGE].float(), vc[blocks, pos % PAGE].float(), D**-0.5
        )
        rel = ((out[r0:r1].float() - ref).norm() / ref.norm()).item()
        worst = max(worst, rel)
    assert worst < 8e-3, f"paged_attention mismatch: relative error {worst:.2e}"
    return worst


def _time_graph(fn, reps: int = 20) -> float:
    """Seconds per fn() call, fn captured once in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / 1e3 / reps


def bench_split(batch, ctx, qlen, gen, check=True, num_splits=None):
    from vibeqwen_kernels.attention.paged import paged_attention

    dev = torch.device("cuda")
    kv_bytes = batch * (ctx + qlen) * HKV * D * 2 * 2
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))
    q, kc, vc, bts, sl, qsl = _make(batch, ctx, qlen, copies, dev, gen)
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    if check:  # a few sequences of the real case
        paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, qlen, out=out)
        nb = min(batch, 4)
        _check(q[: nb * qlen], kc, vc, bts[0][:nb], sl[:nb], qsl[: nb + 1], out[: nb * qlen])

    def fn():
        for bt in bts:
            paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5, qlen, out=out, num_splits=num_splits)

    sec = _time_graph(fn) / copies
    return sec, kv_bytes


def bench_prefill(t, gen, check=True):
    from vibeqwen_kernels.attention.paged import paged_attention

    dev = torch.device("cuda")
    q, kc, vc, bts, sl, qsl = _make(1, 0, t, 1, dev, gen)
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, t, out=out)
    if check:
        _check(q, kc, vc, bts[0], sl, qsl, out)
    sec = _time_graph(lambda: paged_attention(q, kc, vc, bts[0], sl, qsl, D**-0.5, t, out=out), reps=10)
    flops = 2 * 2 * HQ * D * t * (t + 1) / 2
    return sec, flops


TUNE = {
    "split_small": [
        {"BLOCK_N": bn, "num_warps": w, "num_stages": s}
        for bn, w, s in [
            (64, 4, 3),
            (64, 4, 2),
            (32, 4, 3),
            (32, 4, 4),
            (128, 4, 2),
            (64, 8, 2),
            (32, 2, 3),
            (16, 4, 4),
        ]
    ],
    "split_large": [
        {"BLOCK_N": bn, "num_warps": w, "num_stages": s}
        for bn, w, s in [(64, 8, 2), (32, 8, 2), (32, 8, 3), (64, 4, 2), (16, 8, 3)]
    ],
    "prefill": [
        {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
        for bm, bn, w, s in [
            (128, 64, 8, 2),
            (128, 32, 8, 2),
            (128, 64, 8, 3),
            (128, 32, 8, 3),
            (128, 128, 8, 2),
            (64, 64, 4, 2),
            (64, 32, 4, 3),
            (64, 64, 4, 3),
            (128, 64, 4, 2),
        ]
    ],
}


def tune(gen):
    from triton.runtime.errors import OutOfResources
    from vibeqwen_kernels.attention import paged

    saved = {k: list(v) for k, v in paged._CONFIGS.items()}
    cases = {
        "split_small": [
            lambda: bench_split(1, 8192, 1, gen, False)[0],
            lambda: bench_split(64, 8192, 1, gen, False)[0],
            lambda: bench_split(8, 1024, 1, gen, False)[0],
        ],
        "split_large": [
            lambda: bench_split(64, 8192, 8, gen, False)[0],
            lambda: bench_split(8, 8192, 8, gen, False)[0],
        ],
        "prefill": [lambda: bench_prefill(8192, gen, False)[0], lambda: bench_prefill(1024, gen, False)[0]],
    }
    best = {}
    for kind, cands in TUNE.items():
        results = []
        for cfg in cands:
            paged._CONFIGS[kind] = [cfg]
            paged._chosen.clear()
            try:
                times = [f() for f in cases[kind]]
            except OutOfResources:
                print(f"  {kind} {cfg}: out of resources")
                continue
            score = math.exp(sum(math.log(x) for x in times) / len(times))
            print(f"  {kind} {cfg}: " + " ".join(f"{x * 1e6:.1f}us" for x in times))
            results.append((score, cfg))
        results.sort(key=lambda r: r[0])
        best[kind] = [c for _, c in results]
        print(f"best {kind}: {results[0][1]}")
    paged._CONFIGS.update(saved)
    paged._chosen.clear()
    # use the tuned order for the table below (this process only)
    for kind, order in best.items():
        if order:
            paged._CONFIGS[kind] = order + [c for c in saved[kind] if c not in order]
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep-splits", default=None, metavar="S1,S2,..",
                    help="only time the decode cases (context 1k and 8k) at each of these num_splits, against the "
                         "default_num_splits rule")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sweep_splits:
        from vibeqwen_kernels.attention.paged import default_num_splits

        for batch in (1, 8, 16, 32, 64):
            for ctx in (1024, 8192):
                rule = default_num_splits(batch, HKV, torch.device("cuda"))
                cells = [f"rule ({rule}) {bench_split(batch, ctx, 1, gen, False)[0] * 1e6:.1f}"]
                for ns in (int(v) for v in args.sweep_splits.split(",")):
                    cells.append(f"{ns}: {bench_split(batch, ctx, 1, gen, False, ns)[0] * 1e6:.1f}")
                print(f"B={batch} ctx={ctx} us: " + ", ".join(cells), flush=True)
        return
    rows = []
    tuned = tune(gen) if args.tune else None
    for batch in (1, 8, 32, 64):
        for ctx in (1024, 8192):
            sec, nbytes = bench_split(batch, ctx, 1, gen)
            rows.append(
                {
                    "case": f"decode B={batch} ctx={ctx}",
                    "us": sec * 1e6,
                    "kv_mb": nbytes / 1e6,
                    "tbps": nbytes / sec / 1e12,
                    "frac": nbytes / sec / HBM_BPS,
                }
            )
    for batch in (8, 64):
        sec, nbytes = bench_split(batch, 8192, 4, gen)
        rows.append(
            {
                "case": f"verify B={batch} q=4 ctx=8192",
                "us": sec * 1e6,
                "kv_mb": nbytes / 1e6,
                "tbps": nbytes / sec / 1e12,
                "frac": nbytes / sec / HBM_BPS,
            }
        )
    for t in (1024, 8192):
        sec, flops = bench_prefill(t, gen)
        rows.append(
            {
                "case": f"prefill T={t}",
                "us": sec * 1e6,
                "tflops": flops / sec / 1e12,
                "frac": flops / sec / PEAK_FLOPS,
            }
        )
    print("| case | us | KV MB | TB/s | TFLOP/s | fraction of peak |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['us']:.1f} | {r.get('kv_mb', float('nan')):.1f} | {r.get('tbps', float('nan')):.2f} "
            f"| {r.get('tflops', float('nan')):.0f} | {r['frac']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "tuned": tuned}, f, indent=1)


if __name__ == "__main__":
    main()
