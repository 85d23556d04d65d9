"""The one-launch GDN decode (``gdn_decode_gated``: delta rule + gated RMSNorm) against the two launches it replaces
(``gdn_recurrent`` + ``gated_rms_norm``), decode batches of 1-64 sequences at the real shapes, on the GPU.

Each variant is timed as replays of a CUDA graph of N calls that walk different state slots (together > 4x the L2,
so every call's state comes from HBM, as across the 30 GDN layers of a step), captured with early launch where the
decode graphs use it (up to 32 tokens). The floor is the call's bytes (state read and written, q/k/v/z/a/b read,
y written) at the copy bandwidth measured in the same run. A correctness check (the two variants' y and states) runs
first.

    python bench/kernels/bench_gdn_decode.py [--batches 1,8,32,64] [--state-dtype float32|bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_gdn import HK, HV, DK, DV, C, POOL_BYTES, inputs, log, time_graph


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
    from vibeqwen_kernels.gdn.decode_cuda import gdn_decode_gated, gdn_recurrent_decode
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
    from vibeqwen_kernels.norm_fused import gated_rms_norm
    from vibeqwen_kernels.pdl import EARLY_MAX_TOKENS, early_launch

    state_bytes = HV * DK * DV * state_dtype.itemsize
    pool = max(2 * nb, POOL_BYTES // state_bytes)
    ss = (torch.randn(pool, HV, DK, DV, device=dev) * 0.5).to(state_dtype)
    _, q, k, v, a, b = inputs(nb, dev)
    z = torch.randn(nb, HV, DV, device=dev).to(torch.bfloat16)
    A_log = torch.log(torch.rand(HV, device=dev) * 15 + 1)
    dtb = torch.rand(HV, device=dev) - 0.5
    w = (torch.rand(DV, device=dev) + 0.5).to(torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    hi = torch.ones(nb, dtype=torch.bool, device=dev)
    y = torch.empty(nb, HV * DV, device=dev, dtype=torch.bfloat16)
    o = torch.empty(nb, HV, DV, device=dev, dtype=torch.bfloat16)
    n_calls = max(1, min(64, pool // nb))
    slot_sets = [torch.arange(i * nb, (i + 1) * nb, device=dev) % pool for i in range(n_calls)]

    def chain(s):
        gdn_recurrent(q, k, v, a, b, A_log, dtb, ss, s, qsl, hi, 1, out=o)
        return gated_rms_norm(o, z, w, 1e-6)

    def fused(s):
        return gdn_decode_gated(q, k, v, a, b, A_log, dtb, ss, s, qsl, hi, z, w, 1e-6, out=y)

    def persist(s):
        gdn_recurrent_decode(q, k, v, a, b, A_log, dtb, ss, s, qsl, hi, out=o)
        return gated_rms_norm(o, z, w, 1e-6)

    def with_cluster(size):
        def run(s):
            os.environ["VIBEQWEN_GDN_DECODE_CLUSTER"] = size
            try:
                return fused(s)
            finally:
                del os.environ["VIBEQWEN_GDN_DECODE_CLUSTER"]
        return run

    # correctness: the same slots from the same states through both variants
    s0 = slot_sets[0]
    keep = ss[s0].clone()
    y_c = chain(s0).reshape(nb, HV * DV).clone()
    st_c = ss[s0].clone()
    ss[s0] = keep
    y_f = fused(s0).clone()
    st_f = ss[s0].clone()
    ss[s0] = keep
    dy = (y_f.float() - y_c.float()).abs().max().item()
    ds = ((st_f.float() - st_c.float()).norm() / st_c.float().norm()).item()
    equal = (y_f == y_c).float().mean().item()
    early = nb <= EARLY_MAX_TOKENS
    res = {"B": nb, "state": str(state_dtype).removeprefix("torch."), "early_launch": early, "y_max_abs_diff": dy,
           "y_equal_frac": equal, "state_rel_diff": ds}
    nbytes = 2 * nb * state_bytes + nb * (2 * HK * DK + 2 * HV * DV + 2 * HV) * 2 + nb * HV * DV * 2
    res["floor_us"] = nbytes / bw * 1e6
    with early_launch(early):
        for name, fn in (("chain", chain), ("fused", fused), ("cluster4", with_cluster("4")),
                         ("cluster8", with_cluster("8")), ("persist", persist)):
            res[f"{name}_us"] = time_graph([lambda s=s, fn=fn: fn(s) for s in slot_sets]) * 1e6
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    from vibeqwen_kernels.gdn.decode_cuda import gdn_decode_enabled

    if not gdn_decode_enabled(dev):
        sys.exit("the one-launch GDN decode cannot run here (VIBEQWEN_GDN_FUSED_DECODE=0, no nvcc, or before sm_90)")
    bw = copy_bandwidth(dev)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = [case(dev, int(b), getattr(torch, args.state_dtype), bw) for b in args.batches.split(",")]
    print(f"copy {bw / 1e12:.2f} TB/s; us per call (graph replays), floor = bytes at the copy rate")
    print("| B | state | chain us | persist + norm us | fused us (cluster 4 / 8) | floor us | fused / floor | "
          "chain / fused | y max diff | y equal | state rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['state']} | {r['chain_us']:.2f} | {r['persist_us']:.2f} | {r['fused_us']:.2f} "
              f"({r['cluster4_us']:.2f} / {r['cluster8_us']:.2f}) | {r['floor_us']:.2f} | "
              f"{r['fused_us'] / r['floor_us']:.2f}x | "
              f"{r['chain_us'] / r['fused_us']:.2f}x | {r['y_max_abs_diff']:.2e} | {r['y_equal_frac']:.4f} | "
              f"{r['state_rel_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_tbs": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
