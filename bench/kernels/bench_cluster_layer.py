"""Can a batch-1 GDN mixer run as one launch on thread-block clusters near its bytes' time? (GPU probe)

Batch 1 is at ~2.6x of its floor on the H100 and ~3.6x on the H200 (bench/results/h200_notes.md): a GDN layer's mixer
is five dependent launches (input RMSNorm, qkv|z GEMM + conv, delta rule + gated norm, output projection, reduce +
residual + norm: ~25 us on the H100, fiftieth session, for ~11 us of bytes), and the sixtieth session found that no
hand-off across the whole grid inside a launch beats a launch boundary. bench/kernels/cluster_layer.cu does the mixer
in one launch of 128 CTAs whose only in-launch hand-offs are within a cluster, every weight requested before the PDL
wait, then a small launch adding the clusters' partials to the residual: the 3-launch decode layer's GDN half (the
MoE launch would norm its own input). Two cluster shapes (the file says what each computes): 8 CTAs a QK head (16
clusters; an H100's uneven GPCs may not hold 16 clusters of 8 at once) and 4 CTAs a value head (32 clusters; each
QK head's q and k computed by both of its clusters, the second read hoped to hit L2).

Prints: the clusters that can be resident at once (cudaOccupancyMaxActiveClusters at the kernels' 512 threads and
~220 KB of shared memory), a check of both launches against a float32 torch reference (one layer, then a chain),
and, in CUDA graphs of 30 layers (distinct weights a layer: every byte from HBM), us a layer for each shape and

  A+B           the mixer launch + the reduce launch, a layer after another
  A+B late      the same with every weight and state request after the PDL wait (no early requests)
  A+B+S         with a 16 MB weight stream (the MoE's stand-in: 1 CTA an SM, its reads after its PDL wait) between
                layers, as in a decode step; also less the chain of S alone ("A+B in the chain")
  S             the stand-in alone

each next to its bytes' time at the copy rate measured in the same run. Prints a table last.

    python bench/kernels/bench_cluster_layer.py [--layers 30] [--clusters 8,4] [--json PATH]

Needs nvcc and an sm_90 GPU (builds cluster_layer.cu into $VIBEQWEN_CACHE/probe/).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_moe import time_graph  # noqa: E402
from h200_reference import copy_bandwidth_tbs  # noqa: E402
from probe_build import nvcc_probe  # noqa: E402

H, QK_HEADS, V_HEADS, DK = 2048, 16, 32, 128
CTAS = 128
QKVZ_ROWS, OUT_K = 12288, 4096  # q | k (16 x 128 each), v (32 x 128), z (32 x 128); the out projection's input
STREAM_BYTES = 16 << 20  # the MoE stand-in's weights a layer (~what a batch-1 MoE reads)
G, BETA, EPS = 0.9, 0.5, 1e-6
WSCALE, OSCALE = 1.0 / (0.5 * H**0.5), 0.01
DEVICE = "cuda"  # where the tensors live (the CPU test of this script runs it with a stand-in library on "cpu")


def build() -> ctypes.CDLL:
    """nvcc cluster_layer.cu into the vibeqwen cache; raises CalledProcessError on a failed build."""
    lib = nvcc_probe("cluster_layer.cu")
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.vq_cl_smem.restype = i
    lib.vq_cl_max_clusters.restype = i
    lib.vq_cl_max_clusters.argtypes = [i]
    lib.vq_cl_layer_launch.restype = i
    lib.vq_cl_layer_launch.argtypes = [p, p, p, p, p, f, f, f, f, i, i, i, i, p]
    lib.vq_cl_reduce_launch.restype = i
    lib.vq_cl_reduce_launch.argtypes = [p, i, p, p, i, p]
    lib.vq_cl_stream_launch.restype = i
    lib.vq_cl_stream_launch.argtypes = [p, ctypes.c_longlong, p, p, p, i, i, p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def e4m3_bytes(shape, std: float, gen: torch.Generator) -> torch.Tensor:
    """uint8 codes of N(0, std^2) values rounded to e4m3 (no NaN codes), on the GPU."""
    v = torch.randn(shape, generator=gen, device=DEVICE) * std
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


class Layer:
    """One layer's tensors in the kernels' layouts: w [12288, 2048] e4m3 codes (the qkv|z rows), wo_logical [2048,
    4096] codes and wo (its storage: [128 row tiles, 32 k groups, 16 rows, 128 k]), state [32 value heads, 128, 128]
    fp32, stream [16 MB]."""

    def __init__(self, gen: torch.Generator):
        self.w = e4m3_bytes((QKVZ_ROWS, H), 0.5, gen)
        self.wo_logical = e4m3_bytes((H, OUT_K), 0.5, gen)
        self.wo = self.wo_logical.view(H // 16, 16, OUT_K // DK, DK).permute(0, 2, 1, 3).contiguous()
        self.state = torch.randn(V_HEADS, DK, DK, generator=gen, device=DEVICE) * 0.1
        self.stream = torch.randint(0, 255, (STREAM_BYTES,), dtype=torch.uint8, generator=gen, device=DEVICE)


def reference_parts(layer: Layer, state: torch.Tensor, h: torch.Tensor) -> dict:
    """float32 torch reference of the mixer + reduce launches (the model's GDN layout: q, k of QK head c at rows
    128c.., 2048 + 128c..; value head j's v and z at 4096 + 128j.., 8192 + 128j..; value head j on QK head j // 2),
    its intermediate values by name: "qk" [4096] silu(q) | silu(k) before their norms, "o" and "z" [32, 128], "state"
    (the new one) [32, 128, 128], "partial" [32, 2048] each value head's out-projection partial, "h" [2048] bf16 the
    layer's output."""
    silu = torch.nn.functional.silu
    x = h.float()
    x = x * torch.rsqrt(x.square().mean() + EPS)
    y = layer.w.view(torch.float8_e4m3fn).float() @ x * WSCALE
    q, k = silu(y[:2048].view(QK_HEADS, DK)), silu(y[2048:4096].view(QK_HEADS, DK))
    v = silu(y[4096:8192].view(V_HEADS, DK))
    z = y[8192:].view(V_HEADS, DK)
    qn = (q / q.norm(dim=-1, keepdim=True) / DK**0.5).repeat_interleave(2, 0)  # [32, 128]: value head j's QK head
    kn = (k / k.norm(dim=-1, keepdim=True)).repeat_interleave(2, 0)
    s = state * G
    kv = torch.einsum("jik,jk->ji", s, kn)
    s = s + BETA * (v - kv)[..., None] * kn[:, None, :]
    o = torch.einsum("jik,jk->ji", s, qn)
    u = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + EPS) * silu(z)  # [32, 128]
    wo = layer.wo_logical.view(torch.float8_e4m3fn).float().view(H, V_HEADS, DK)
    partial = torch.einsum("njk,jk->jn", wo, u) * OSCALE
    return {"qk": torch.cat([q.flatten(), k.flatten()]), "o": o, "z": z, "state": s, "partial": partial,
            "h": (h.float() + partial.sum(0)).to(torch.bfloat16)}


def reference_layer(layer: Layer, state: torch.Tensor, h: torch.Tensor):
    """:func:`reference_parts` as (h_out [2048] bf16, the new state [32, 128, 128], each value head's partial [32,
    2048])."""
    r = reference_parts(layer, state, h)
    return r["h"], r["state"], r["partial"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--clusters", default="8,4", help="cluster shapes to check and time: 8 and / or 4")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    lib = build()
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_tbs = copy_bandwidth_tbs(DEVICE)
    print(f"{gpu}: {sms} SMs, copy {copy_tbs:.2f} TB/s, mixer smem {lib.vq_cl_smem()} B", flush=True)
    clusters = {c: lib.vq_cl_max_clusters(c) for c in (2, 4, 8, 16)}
    print("max active clusters (size: clusters): " + ", ".join(f"{c}: {n}" for c, n in clusters.items())
          + f" (the launches need {CTAS // 8} of 8 or {CTAS // 4} of 4)", flush=True)
    shapes = [int(c) for c in args.clusters.split(",")]
    if not shapes or any(c not in (4, 8) for c in shapes):
        raise SystemExit(f"--clusters: 8 and / or 4, got {args.clusters!r}")
    waves = {c: "" if clusters[c] >= CTAS // c else f" (WARNING: only {clusters[c]} clusters of {c} fit at once: "
             "the mixer runs in waves)" for c in shapes}
    for c in shapes:
        if waves[c]:
            print(waves[c].strip(" ()"), flush=True)

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    h0 = (torch.randn(H, generator=gen, device=DEVICE)).to(torch.bfloat16)
    hs = [torch.empty(H, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    partial = torch.empty(V_HEADS, H, device=DEVICE)
    sink = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def st():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def mixer(layer, h_in, late, cluster, pdl, ctas=0):
        _check(lib.vq_cl_layer_launch(layer.w.data_ptr(), layer.wo.data_ptr(), layer.state.data_ptr(),
                                      h_in.data_ptr(), partial.data_ptr(), WSCALE, OSCALE, G, BETA, late, cluster,
                                      ctas, pdl, st()), "mixer launch")

    def reduce(h_in, h_out, cluster, pdl):
        _check(lib.vq_cl_reduce_launch(partial.data_ptr(), CTAS // cluster, h_in.data_ptr(), h_out.data_ptr(), pdl,
                                       st()), "reduce launch")

    def stream(layer, h_in, h_out, pdl):
        _check(lib.vq_cl_stream_launch(layer.stream.data_ptr(), STREAM_BYTES // 16, h_in.data_ptr(),
                                       h_out.data_ptr(), sink.data_ptr(), sms, pdl, st()), "stream launch")

    def chain(late: int, cluster: int, with_stream: bool, mixer_on: bool = True, pdl_on: bool = True, ctas: int = 0):
        """h0 through every layer: A (+ B) (+ S); the result in hs[0] with S, else hs[len(layers) % 2]. The first
        launch after the copy of h0 goes without PDL (every launch with pdl_on False). ctas: the mixer's grid (0:
        the whole layer; fewer: one wave of resident clusters, part of the layer's work, for timing only)."""
        hs[0].copy_(h0)
        for i, layer in enumerate(layers):
            pdl, rest = int(i > 0 and pdl_on), int(pdl_on)
            if with_stream:  # A: hs0 -> partial, B: hs0 -> hs1, S: hs1 -> hs0
                if mixer_on:
                    mixer(layer, hs[0], late, cluster, pdl, ctas)
                    reduce(hs[0], hs[1], cluster, rest)
                    stream(layer, hs[1], hs[0], rest)
                else:
                    stream(layer, hs[0], hs[0], pdl)
            else:
                mixer(layer, hs[i % 2], late, cluster, pdl, ctas)
                reduce(hs[i % 2], hs[(i + 1) % 2], cluster, rest)

    saved = [layer.state.clone() for layer in layers]

    def restore():
        for layer, s0 in zip(layers, saved):
            layer.state.copy_(s0)

    def outputs():
        torch.cuda.synchronize()
        return hs[0].clone(), [layer.state.clone() for layer in layers]

    def same(x, y) -> bool:
        return torch.equal(x[0], y[0]) and all(torch.equal(a, b) for a, b in zip(x[1], y[1]))

    def check(cluster: int) -> tuple[bool, dict]:
        """The cluster-`cluster` launches against the reference (one layer, NaN-filled outputs), then the chain with
        PDL, with late requests and as one graph replay against the chain without PDL (the kernels are
        deterministic: the same bits), and that chain against the reference."""
        parts = CTAS // cluster
        # the launch's partials: one a value head (cluster 4) or the sum of the QK head's two (cluster 8)
        want = ref_p.view(parts, V_HEADS // parts, H).sum(1)
        res = {}
        ok = True
        for late in (0, 1):
            restore()
            hs[0].copy_(h0)
            hs[1].fill_(float("nan"))
            partial.fill_(float("nan"))
            mixer(layers[0], hs[0], late, cluster, 0)
            reduce(hs[0], hs[1], cluster, 1)
            torch.cuda.synchronize()
            err_p = ((partial[:parts] - want).abs().max() / want.abs().max()).item()
            err_s = (layers[0].state - ref_s).abs().max().item()
            # the reduce launch: h + the partials' sum, rounded once (its order against torch's: within 1 bf16 ulp)
            expect = h0.float() + partial[:parts].sum(0)
            err_h = ((hs[1].float() - expect).abs() / expect.abs().clamp_min(1e-3)).max().item()
            good = err_p <= 1e-4 and err_s <= 1e-4 and err_h <= 2**-7
            res[f"one layer late={late}: partial rel err, state err, h rel err, ok"] = (err_p, err_s, err_h, good)
            print(f"cluster {cluster}, one layer, late {late}: partial max rel err {err_p:.3g}, state max err "
                  f"{err_s:.3g}, h against its partials {err_h:.3g} (<= 1 bf16 ulp {2**-7:.3g}): "
                  f"{'ok' if good else 'MISMATCH'}", flush=True)
            ok &= good
        restore()
        chain(0, cluster, True, pdl_on=False)
        plain = outputs()
        runs = {}
        for name, late in (("PDL", 0), ("PDL, late requests", 1)):
            restore()
            chain(late, cluster, True)
            runs[name] = same(outputs(), plain)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(0, cluster, True)
        restore()
        g.replay()
        runs["one graph replay"] = same(outputs(), plain)
        del g
        for name, equal in runs.items():
            res[f"chain {name} == chain without PDL"] = equal
            print(f"cluster {cluster}, chain of {len(layers)} (A+B+S), {name}: the same bits as without PDL: {equal}",
                  flush=True)
            ok &= equal
        h_ref = h0
        for layer, s0 in zip(layers, saved):
            h_ref = reference_layer(layer, s0, h_ref)[0]
        err = (plain[0].float() - h_ref.float()).abs().max().item()
        scale = h_ref.float().abs().max().item()
        good = err <= 0.05 * max(1.0, scale)
        res["chain max |h err| against the reference, ok"] = (err, good)
        print(f"cluster {cluster}, chain without PDL: max |h - ref| {err:.3g} (max |h| {scale:.3g}): "
              f"{'ok' if good else 'MISMATCH'}", flush=True)
        return ok and good, res

    ref_h, ref_s, ref_p = reference_layer(layers[0], saved[0], h0)
    n = len(layers)
    mixer_bytes = QKVZ_ROWS * H + H * OUT_K + 2 * layers[0].state.numel() * 4  # weights, state in + out
    floor_us = {k: b / (copy_tbs * 1e12) * 1e6 for k, b in
                {"A+B": mixer_bytes, "S": STREAM_BYTES, "A+B+S": mixer_bytes + STREAM_BYTES}.items()}
    us = {"S": time_graph([lambda: chain(0, 8, True, mixer_on=False)], reps=10) * 1e6 / n}
    print(f"  S: {us['S']:.2f} us a layer, {us['S'] / floor_us['S']:.2f}x its bytes' time", flush=True)
    one_wave: dict[int, int] = {}  # cluster shape -> the CTAs of one wave, where the shape runs in waves

    def wave_floor(name: str, wave: int) -> float:
        """The bytes' time of a one-wave row: the mixer's bytes scaled by its share of the CTAs (+ the stand-in's)."""
        s_us = floor_us["S"] if "+S" in name else 0.0
        return floor_us["A+B"] * wave / CTAS + s_us

    out = {"gpu": gpu, "copy_tbs": copy_tbs, "max_active_clusters": clusters, "layers": n,
           "mixer_bytes": mixer_bytes, "us_a_layer": us, "checks": {}}
    passed = {}
    for cluster in shapes:  # each shape checked, then timed; a shape that fails its checks is not timed
        passed[cluster], out["checks"][f"cluster {cluster}"] = check(cluster)
        if passed[cluster]:
            for name, late, with_stream in (("A+B", 0, False), ("A+B late", 1, False), ("A+B+S", 0, True),
                                            ("A+B+S late", 1, True)):
                key = f"cluster {cluster}: {name}"
                us[key] = time_graph([lambda late=late, c=cluster, w=with_stream: chain(late, c, w)], reps=10) * 1e6 / n
                f = floor_us[name.replace(" late", "")]
                print(f"  {key}: {us[key]:.2f} us a layer, {us[key] / f:.2f}x its bytes' time ({f:.2f} us)",
                      flush=True)
            wave = clusters[cluster] * cluster
            if 0 < wave < CTAS:  # the clusters that fit at once: their share of the work in one wave
                one_wave[cluster] = wave
                for name, late, with_stream in (("A+B one wave", 0, False), ("A+B+S one wave", 0, True),
                                                ("A+B+S late one wave", 1, True)):
                    key = f"cluster {cluster}: {name}"
                    us[key] = time_graph([lambda late=late, c=cluster, w=with_stream: chain(late, c, w, ctas=wave)],
                                         reps=10) * 1e6 / n
                    f = wave_floor(name, wave)
                    print(f"  {key} ({wave} of {CTAS} CTAs): {us[key]:.2f} us a layer, {us[key] / f:.2f}x its "
                          f"bytes' time ({f:.2f} us)", flush=True)
        else:
            print(f"cluster {cluster}: MISMATCH, not timed", flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{gpu}, copy {copy_tbs:.2f} TB/s; max active clusters (size: n) "
          + ", ".join(f"{c}: {k}" for c, k in clusters.items())
          + f"; {n} layers; mixer bytes {mixer_bytes / 1e6:.1f} MB ({floor_us['A+B']:.2f} us)")
    print("| cluster | mode | us a layer | x its bytes' time |")
    print("|---|---|---|---|")
    print(f"| - | S | {us['S']:.2f} | {us['S'] / floor_us['S']:.2f} |")
    for cluster in shapes:
        if not passed[cluster]:
            print(f"| {cluster} | checks failed: not timed | | |")
            continue
        for name in ("A+B", "A+B late", "A+B+S", "A+B+S late"):
            v = us[f"cluster {cluster}: {name}"]
            print(f"| {cluster}{waves[cluster]} | {name} | {v:.2f} | {v / floor_us[name.replace(' late', '')]:.2f} |")
        for late in ("", " late"):
            v = us[f"cluster {cluster}: A+B+S{late}"] - us["S"]
            print(f"| {cluster} | A+B in the chain{late} (A+B+S{late} - S) | {v:.2f} | {v / floor_us['A+B']:.2f} |")
        if cluster in one_wave:
            wave = one_wave[cluster]
            for name in ("A+B one wave", "A+B+S one wave", "A+B+S late one wave"):
                v = us[f"cluster {cluster}: {name}"]
                print(f"| {cluster} | {name} ({wave} of {CTAS} CTAs: part of the layer) | {v:.2f} | "
                      f"{v / wave_floor(name, wave):.2f} |")
            for late in ("", " late"):
                v = us[f"cluster {cluster}: A+B+S{late} one wave"] - us["S"]
                print(f"| {cluster} | A+B in the chain{late}, one wave | {v:.2f} | "
                      f"{v / (floor_us['A+B'] * wave / CTAS):.2f} |")
    if not all(passed.values()):
        raise SystemExit("a cluster shape failed its checks (above)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
