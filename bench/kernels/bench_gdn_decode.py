"""The persistent GDN decode kernel (``gdn_recurrent_decode``) against the Triton recurrent kernel (``gdn_recurrent``)
at decode batches of 1-64 sequences (one token each), the real shapes, on the GPU.

Each variant is timed as replays of a CUDA graph of N calls that walk different state slots (together > 4x the L2,
so every call's state comes from HBM, as across the 30 GDN layers of a step), captured with early launch where the
decode graphs use it (up to 32 tokens). The floor is a call's bytes (state read and written, q/k/v/a/b read, o
written) at the copy bandwidth measured in the same run. A correctness check (the two kernels' o and states from the
same slots) runs first.

    python bench/kernels/bench_gdn_decode.py [--batches 1,8,32,64] [--state-dtype float32|bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_gdn import DK, DV, HK, HV, POOL_BYTES, inputs, log, time_graph


def copy_bandwidth(dev) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the median of 10."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return 2 * src.numel() * 2 / times[len(times) // 2]


def case(dev, nb: int, state_dtype: torch.dtype, bw: float) -> dict:
    from vibeqwen_kernels.gdn.decode_cuda import gdn_recurrent_decode, make_counter
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
    from vibeqwen_kernels.pdl import EARLY_MAX_TOKENS, early_launch

    state_bytes = HV * DK * DV * state_dtype.itemsize
    pool = max(2 * nb, POOL_BYTES // state_bytes)
    ss = (torch.randn(pool, HV, DK, DV, device=dev) * 0.5).to(state_dtype)
    _, q, k, v, a, b = inputs(nb, dev)
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    dtb = torch.rand(HV, device=dev) - 0.5
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    hi = torch.ones(nb, dtype=torch.bool, device=dev)
    o = torch.empty(nb, HV, DV, device=dev, dtype=torch.bfloat16)
    counter = make_counter(dev)
    n_calls = max(1, min(64, pool // nb))
    slot_sets = [torch.arange(i * nb, (i + 1) * nb, device=dev) % pool for i in range(n_calls)]

    def triton(s):
        return gdn_recurrent(q, k, v, a, b, A_log, dtb, ss, s, qsl, hi, 1, out=o)

    def persist(s):
        return gdn_recurrent_decode(q, k, v, a, b, A_log, dtb, ss, s, qsl, hi, counter, out=o)

    # correctness: the same slots from the same states through both kernels
    s0 = slot_sets[0]
    keep = ss[s0].clone()
    o_t = triton(s0).clone()
    st_t = ss[s0].clone()
    ss[s0] = keep
    o_p = persist(s0).clone()
    st_p = ss[s0].clone()
    ss[s0] = keep
    early = nb <= EARLY_MAX_TOKENS
    res = {"B": nb, "state": str(state_dtype).removeprefix("torch."), "early_launch": early,
           "o_max_abs_diff": (o_p.float() - o_t.float()).abs().max().item(),
           "o_equal_frac": (o_p == o_t).float().mean().item(),
           "state_rel_diff": ((st_p.float() - st_t.float()).norm() / st_t.float().norm()).item()}
    nbytes = 2 * nb * state_bytes + nb * (2 * HK * DK + HV * DV + 2 * HV) * 2 + nb * HV * DV * 2
    res["floor_us"] = nbytes / bw * 1e6
    with early_launch(early):
        for name, fn in (("triton", triton), ("persist", persist)):
            res[f"{name}_us"] = time_graph([lambda s=s, fn=fn: fn(s) for s in slot_sets]) * 1e6
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    from vibeqwen_kernels.gdn.decode_cuda import decode_enabled

    if not decode_enabled(dev):
        sys.exit("the persistent GDN decode kernel cannot run here (VIBEQWEN_GDN_PERSIST=0, no nvcc, or before sm_90)")
    bw = copy_bandwidth(dev)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = [case(dev, int(b), getattr(torch, args.state_dtype), bw) for b in args.batches.split(",")]
    print(f"copy {bw / 1e12:.2f} TB/s; us per call (graph replays), floor = bytes at the copy rate")
    print("| B | state | Triton us | persistent us | floor us | persistent / floor | Triton / persistent | o max diff | "
          "o equal | state rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['state']} | {r['triton_us']:.2f} | {r['persist_us']:.2f} | {r['floor_us']:.2f} | "
              f"{r['persist_us'] / r['floor_us']:.2f}x | {r['triton_us'] / r['persist_us']:.2f}x | "
              f"{r['o_max_abs_diff']:.2e} | {r['o_equal_frac']:.4f} | {r['state_rel_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_tbs": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
