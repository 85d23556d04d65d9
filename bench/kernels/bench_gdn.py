"""Gated DeltaNet kernels on the GPU: conv1d and recurrent decode (bytes/s vs 4.3 TB/s), fla chunk prefill.

* causal_conv1d at decode B in {1, 8, 32, 64} (q_len 1) and 1k- and 8k-token prefills;
* gdn_recurrent at decode B in {1, 8, 32, 64}, every (BLOCK_V, num_warps) candidate (the table shows
  the default pick and the best; update ``pick_block_v`` from it), and q_len 4 (speculative verify, with
  per-token states) at B 8;
* gdn_chunk_prefill (fla-core) for one sequence of 1k and of 8k tokens (fla autotunes on its first
  call, ~45 s).

Decode kernels are timed as replays of a CUDA graph whose calls walk different state slots (together
> 4x the 60 MB L2, so states come from HBM, as across the 30 GDN layers of a step). Bytes = state read +
write + activations read/written once. A correctness check at the real shapes runs first.

The recurrent state (slots, per-token states) is stored in ``--state-dtype`` (EngineConfig.gdn_state_dtype:
float32, the default, or bfloat16; the kernels compute in float32 either way); run once per dtype to compare.

    python bench/kernels/bench_gdn.py [--json PATH] [--no-fla] [--state-dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HK, HV, DK, DV, W = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV
PEAK = 4.3e12  # bytes/s a device-to-device copy reaches on an H200
POOL_BYTES = 256 << 20
BS = [1, 8, 32, 64]
REC_CANDIDATES = [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8)]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_graph(calls, reps: int = 10) -> float:
    """Median seconds per call over replays of one CUDA graph that runs `calls` (closures) in order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    return statistics.median(times)


def time_eager(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def inputs(t: int, dev):
    mixed = torch.randn(t, C, device=dev).to(torch.bfloat16)
    q = mixed[:, : HK * DK].view(t, HK, DK)
    k = mixed[:, HK * DK : 2 * HK * DK].view(t, HK, DK)
    v = mixed[:, 2 * HK * DK :].view(t, HV, DV)
    a = torch.randn(t, HV, device=dev).to(torch.bfloat16)
    b = torch.randn(t, HV, device=dev).to(torch.bfloat16)
    return mixed, q, k, v, a, b


def check(dev, use_fla: bool, state_dtype: torch.dtype = torch.float32) -> dict:
    """Real shapes, mixed batch, against the references (fp32 math from the stored initial state; a bf16 final
    state adds one rounding, 2^-9 relative); raises on a mismatch."""
    from vibeqwen_kernels import causal_conv1d_ref, gdn_chunk_ref, gdn_recurrent_ref
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    lens, init = [1, 5, 0, 9, 1], [True, False, True, True, True]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots = torch.tensor([3, 0, 6, 2, 5], dtype=torch.int32, device=dev)
    hi = torch.tensor(init, device=dev)
    mixed, q, k, v, a, b = inputs(int(qsl[-1]), dev)
    w = (torch.randn(C, W, device=dev) * 0.5).to(torch.bfloat16)
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    dtb = torch.rand(HV, device=dev) - 0.5
    cs = torch.randn(8, C, W - 1, device=dev).to(torch.bfloat16)
    ss = (torch.randn(8, HV, DK, DV, device=dev) * 0.5).to(state_dtype)
    cs0, ss0 = cs.clone(), ss.clone()
    y = causal_conv1d(mixed, w, cs, slots, qsl, hi, max(lens))
    o = gdn_recurrent(q, k, v, a, b, A_log, dtb, ss, slots, qsl, hi, max(lens))
    g = -A_log.exp() * F.softplus(a.float() + dtb)
    beta = torch.sigmoid(b.float())
    worst = {"conv": 0.0, "recurrent": 0.0}
    for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
        if e == s:
            assert torch.equal(cs[sl], cs0[sl]) and torch.equal(ss[sl], ss0[sl])
            continue
        yr, sr = causal_conv1d_ref(mixed[s:e].float(), w.float(), cs0[sl].float() if init[i] else None)
        assert torch.equal(cs[sl], sr.to(cs.dtype)), "conv state mismatch"
        orf, st = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ss0[sl] if init[i] else None)
        worst["conv"] = max(worst["conv"], rel(y[s:e], yr))
        worst["recurrent"] = max(worst["recurrent"], rel(o[s:e], orf), rel(ss[sl], st))
    assert worst["conv"] < 4e-3 and worst["recurrent"] < 4e-3, worst
    if use_fla:
        from vibeqwen_kernels.gdn.chunk_fla import gdn_chunk_prefill

        t = 1024
        _, q, k, v, a, b = inputs(t, dev)
        qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
        one = torch.zeros(1, dtype=torch.int32, device=dev)
        hi = torch.ones(1, dtype=torch.bool, device=dev)
        ss = (torch.randn(1, HV, DK, DV, device=dev) * 0.5).to(state_dtype)
        s0 = ss[0].clone()
        log("fla: first call (autotuning, ~45 s) ...")
        o = gdn_chunk_prefill(q, k, v, a, b, A_log, dtb, ss, one, qsl, hi, t)
        g = -A_log.exp() * F.softplus(a.float() + dtb)
        orf, st = gdn_chunk_ref(q, k, v, g, torch.sigmoid(b.float()), s0)
        worst["fla_o"], worst["fla_state"] = rel(o, orf), rel(ss[0], st)
        assert worst["fla_o"] < 1.5e-2 and worst["fla_state"] < 1e-2, worst
    return worst


def bench_conv(dev, nb: int, t_per_seq: int = 1) -> dict:
    from vibeqwen_kernels.conv1d.causal import causal_conv1d

    state_bytes = C * (W - 1) * 2
    pool = max(2 * nb, POOL_BYTES // state_bytes)
    cs = torch.randn(pool, C, W - 1, device=dev).to(torch.bfloat16)
    w = (torch.randn(C, W, device=dev) * 0.5).to(torch.bfloat16)
    t = nb * t_per_seq
    x = torch.randn(t, C, device=dev).to(torch.bfloat16)
    out = torch.empty_like(x)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32) * t_per_seq
    hi = torch.ones(nb, dtype=torch.bool, device=dev)
    n_calls = max(1, min(1024 if t_per_seq == 1 else 8, pool // nb))
    slot_sets = [
        torch.arange(i * nb, (i + 1) * nb, device=dev, dtype=torch.int32) % pool for i in range(n_calls)
    ]
    calls = [lambda s=s: causal_conv1d(x, w, cs, s, qsl, hi, t_per_seq, out=out) for s in slot_sets]
    sec = time_graph(calls)
    nbytes = 2 * t * C * 2 + 2 * nb * state_bytes + C * W * 2
    return {
        "B": nb,
        "q_len": t_per_seq,
        "us": sec * 1e6,
        "GB/s": nbytes / sec / 1e9,
        "of_peak": nbytes / sec / PEAK,
    }


def bench_recurrent(dev, nb: int, q_len: int, block_v: int | None, warps: int | None, inter: bool,
                    state_dtype: torch.dtype = torch.float32) -> dict:
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    state_bytes = HV * DK * DV * state_dtype.itemsize
    pool = max(2 * nb, POOL_BYTES // state_bytes)
    ss = torch.zeros(pool, HV, DK, DV, device=dev, dtype=state_dtype)
    t = nb * q_len
    _, q, k, v, a, b = inputs(t, dev)
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    dtb = torch.rand(HV, device=dev) - 0.5
    out = torch.empty(t, HV, DV, device=dev, dtype=torch.bfloat16)
    inter_t = torch.empty(t, HV, DK, DV, device=dev, dtype=state_dtype) if inter else None
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32) * q_len
    hi = torch.ones(nb, dtype=torch.bool, device=dev)
    n_calls = max(1, min(64, pool // nb))
    slot_sets = [
        torch.arange(i * nb, (i + 1) * nb, device=dev, dtype=torch.int32) % pool for i in range(n_calls)
    ]
    calls = [
        lambda s=s: gdn_recurrent(
            q,
            k,
            v,
            a,
            b,
            A_log,
            dtb,
            ss,
            s,
            qsl,
            hi,
            q_len,
            inter_t,
            out=out,
            block_v=block_v,
            num_warps=warps,
        )
        for s in slot_sets
    ]
    sec = time_graph(calls)
    nbytes = 2 * nb * state_bytes + t * (2 * HK * DK + 2 * HV * DV + 2 * HV) * 2
    if inter:
        nbytes += t * state_bytes
    return {
        "B": nb,
        "q_len": q_len,
        "block_v": block_v,
        "warps": warps,
        "us": sec * 1e6,
        "GB/s": nbytes / sec / 1e9,
        "of_peak": nbytes / sec / PEAK,
    }


def bench_fla(dev, t: int, state_dtype: torch.dtype = torch.float32) -> dict:
    from vibeqwen_kernels.gdn.chunk_fla import gdn_chunk_prefill

    _, q, k, v, a, b = inputs(t, dev)
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    dtb = torch.rand(HV, device=dev) - 0.5
    ss = torch.zeros(2, HV, DK, DV, device=dev, dtype=state_dtype)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
    slots = torch.ones(1, dtype=torch.int32, device=dev)
    hi = torch.zeros(1, dtype=torch.bool, device=dev)
    sec = time_eager(lambda: gdn_chunk_prefill(q, k, v, a, b, A_log, dtb, ss, slots, qsl, hi, t))
    return {"T": t, "ms": sec * 1e3, "Mtok/s": t / sec / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-fla", action="store_true", help="skip the fla-core prefill")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="storage dtype of the recurrent state (EngineConfig.gdn_state_dtype)")
    args = ap.parse_args()
    sdt = getattr(torch, args.state_dtype)
    if not torch.cuda.is_available():
        sys.exit("bench_gdn: needs a CUDA GPU")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    from vibeqwen_kernels.gdn.chunk_fla import fla_available
    from vibeqwen_kernels.gdn.recurrent import pick_block_v

    use_fla = not args.no_fla and fla_available()
    res: dict = {"device": torch.cuda.get_device_name(), "state_dtype": args.state_dtype,
                 "check": check(dev, use_fla, sdt)}
    log("correctness:", res["check"])

    res["conv"] = [bench_conv(dev, nb) for nb in BS] + [bench_conv(dev, 1, 1024), bench_conv(dev, 1, 8192)]
    rec = []
    for nb in BS:
        default = pick_block_v(nb, HV, DV)
        rows = [bench_recurrent(dev, nb, 1, bv, wp, False, sdt) for bv, wp in REC_CANDIDATES]
        best = min(rows, key=lambda r: r["us"])
        dflt = next(r for r in rows if (r["block_v"], r["warps"]) == default)
        rec.append({"default": dflt, "best": best, "all": rows})
        log(
            f"recurrent B={nb}: default {default} {dflt['us']:.1f} us, best "
            f"({best['block_v']}, {best['warps']}) {best['us']:.1f} us"
        )
    res["recurrent"] = rec
    res["recurrent_verify"] = bench_recurrent(dev, 8, 4, None, None, True, sdt)
    res["fla"] = [bench_fla(dev, t, sdt) for t in (1024, 8192)] if use_fla else []

    print(f"recurrent state: {args.state_dtype}\n")
    print("| op | shape | time | GB/s | of 4.3 TB/s |\n|---|---|---|---|---|")
    for r in res["conv"]:
        print(
            f"| conv1d | B={r['B']} q_len={r['q_len']} | {r['us']:.1f} us | {r['GB/s']:.0f} | {r['of_peak']:.0%} |"
        )
    for r in rec:
        for tag in ("default", "best"):
            x = r[tag]
            print(
                f"| recurrent ({tag} BV={x['block_v']} w={x['warps']}) | B={x['B']} q_len=1 | "
                f"{x['us']:.1f} us | {x['GB/s']:.0f} | {x['of_peak']:.0%} |"
            )
    x = res["recurrent_verify"]
    print(
        f"| recurrent + all states | B=8 q_len=4 | {x['us']:.1f} us | {x['GB/s']:.0f} | {x['of_peak']:.0%} |"
    )
    for r in res["fla"]:
        print(f"| fla chunk prefill | T={r['T']} | {r['ms']:.2f} ms ({r['Mtok/s']:.2f} Mtok/s) | - | - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
