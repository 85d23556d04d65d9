"""Does a batch-1 GDN mixer in three launches, the first two overlapping, run near its bytes' time? (GPU probe)

A GDN layer's batch-1 mixer is five dependent launches today (~25 us on the H100 for ~12.5 us of bytes), and one
launch on thread-block clusters (bench_cluster_layer.py) runs in two waves on an H100. bench/kernels/split_mixer.cu
splits the mixer so that only launch boundaries hand results between CTAs (its header says what each launch does):

  A  q | k rows (8.4 MB) into global memory, releasing B right after its PDL wait
  B  per value head and 32-row slice (128 CTAs): the v and z rows, state rows and output-projection columns copied
     into shared memory and v, z multiplied BEFORE B's PDL wait (they need only h), then the delta rule and the
     out-projection partial with the slice's sum of o^2 (the gated norm's scale is a per-head factor)
  C  the partials times those factors + the residual

so that B's 29 MB stream runs beside A's 8.4 MB instead of after it.

Prints each kernel's registers (A and B must fit one SM together), a check against bench_cluster_layer.py's float32
reference (one layer, then the chain with PDL in each mode and as a graph replay bit for bit the chain without PDL),
and in CUDA graphs of 30 layers (distinct weights a layer) us a layer for

  A+B+C           the three launches, a layer after another (mode 0: B's copies and v | z product before its wait)
  A+B+C late      B's copies and its v | z product after its PDL wait (mode 1: 3 serial launches)
  A+B+C early     B's copies before its wait, its product after, A releasing B before A's own wait (mode 2: the
                  copies overlap the launch before A, the MoE in a decode step)
  ...+S           each with the 16 MB stream standing in for the MoE between layers; also less S alone ("in the
                  chain")
  S               the stand-in alone

each next to its bytes' time at the copy rate measured in the same run, and a table last.

    python bench/kernels/bench_split_mixer.py [--layers 30] [--json PATH]

Needs nvcc and an sm_90 GPU (builds split_mixer.cu into $VIBEQWEN_CACHE/probe/).
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
import bench_cluster_layer as cl  # noqa: E402
from bench_moe import time_graph  # noqa: E402
from h200_reference import copy_bandwidth_tbs  # noqa: E402
from probe_build import nvcc_probe  # noqa: E402

H, V_HEADS, DK, SLICES = cl.H, cl.V_HEADS, cl.DK, 4
CTAS = V_HEADS * SLICES  # B's CTAs: one (value head, slice) each
QK_ROWS = 4096
DEVICE = "cuda"  # where the tensors live (the CPU test of this script runs it with a stand-in library on "cpu")
STREAM_BYTES = cl.STREAM_BYTES
#: B's modes by the suffix of their rows (split_mixer.cu's MixerParams.mode)
MODES = {"": 0, " late": 1, " early": 2}
#: the kernels' timeline events (split_mixer.cu's kEv*), each stamped by the earliest and the latest CTA
EVENTS = ("A start", "A wait returned", "A end", "B start", "B v|z copies landed", "B wait returned",
          "B state + out-proj copies landed", "B end", "C start", "C wait returned", "C end")


def base(name: str) -> str:
    """A row's name without its mode: the key of its bytes' time."""
    for suffix in (" late", " early"):
        name = name.removesuffix(suffix)
    return name


def build() -> ctypes.CDLL:
    """nvcc split_mixer.cu into the vibeqwen cache; raises CalledProcessError on a failed build."""
    lib = nvcc_probe("split_mixer.cu")
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.vq_sm_smem.restype = i
    lib.vq_sm_registers.restype = i
    lib.vq_sm_registers.argtypes = [i]
    lib.vq_sm_qk_launch.restype = i
    lib.vq_sm_qk_launch.argtypes = [p, p, p, f, i, p, i, p]
    lib.vq_sm_mixer_launch.restype = i
    lib.vq_sm_mixer_launch.argtypes = [p, p, p, p, p, p, p, f, f, f, f, i, p, i, p]
    lib.vq_sm_reduce_launch.restype = i
    lib.vq_sm_reduce_launch.argtypes = [p, p, p, p, p, i, p]
    lib.vq_sm_stream_launch.restype = i
    lib.vq_sm_stream_launch.argtypes = [p, ctypes.c_longlong, p, p, p, i, i, p]
    return lib


def shuffled_out_projection(wo_logical: torch.Tensor) -> torch.Tensor:
    """The output projection's e4m3 codes (uint8 [2048, 4096]) in the FP8 MMA kernel's layout (uint8 [128, 64, 2, 32,
    16], split_mixer.cu's header). Raises ValueError for a shape shuffle_fp8_mma does not take."""
    from vibeqwen_kernels.fp8.mma import shuffle_fp8_mma

    return shuffle_fp8_mma(wo_logical)


def slice_partials_to_heads(partial: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor:
    """B's outputs as the reference's per value head partials: float32 partial [128, 2048] (P_b, b = 4 j + s) and sumsq
    [128] -> [32, 2048] = (sum_s P_{4j+s}) / sqrt(sum_s sumsq_{4j+s} / 128 + 1e-6) (split_mixer.cu's header)."""
    inv = torch.rsqrt(sumsq.view(V_HEADS, SLICES).sum(1) / DK + cl.EPS)
    return partial.view(V_HEADS, SLICES, H).sum(1) * inv[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeline", action="store_true",
                    help="also stamp each kernel's events (earliest / latest CTA) in a graph replay of each chain")
    args = ap.parse_args()
    if args.layers < (3 if args.timeline else 1):
        ap.error(f"--layers {args.layers}: at least 1, and 3 with --timeline (its means leave out the first and the "
                 "last layer)")
    cl.DEVICE = DEVICE
    lib = build()
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_tbs = copy_bandwidth_tbs(DEVICE)
    regs = {name: lib.vq_sm_registers(i) for i, name in enumerate(("A", "B", "C"))}
    print(f"{gpu}: {sms} SMs, copy {copy_tbs:.2f} TB/s, B's shared memory {lib.vq_sm_smem()} B, registers a thread "
          + ", ".join(f"{k} {v}" for k, v in regs.items()), flush=True)
    alloc = {k: -(-v // 8) * 8 for k, v in regs.items()}  # allocated in multiples of 8 a thread
    if alloc["A"] + alloc["B"] > 256:
        print(f"WARNING: A and B need {alloc['A'] + alloc['B']} registers a thread pair (256 threads each): one of "
              "each does not fit an SM, B cannot start next to A", flush=True)
    elif alloc["A"] + alloc["B"] + 32 > 256:
        print(f"WARNING: A, B and the stand-in S (32) need {alloc['A'] + alloc['B'] + 32} registers a thread: in mode "
              "2 B cannot start next to A and S", flush=True)

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layers = [cl.Layer(gen) for _ in range(args.layers)]
    wos = [shuffled_out_projection(layer.wo_logical) for layer in layers]
    h0 = (torch.randn(H, generator=gen, device=DEVICE)).to(torch.bfloat16)
    hs = [torch.empty(H, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    qk = torch.empty(QK_ROWS, device=DEVICE)
    partial = torch.empty(CTAS, H, device=DEVICE)
    sumsq = torch.empty(CTAS, device=DEVICE)
    sink = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    stamps = torch.zeros(len(layers), len(EVENTS), 2, dtype=torch.int64, device=DEVICE)  # ns; [..., 0] min, 1 max
    stamping = [False]  # chain() passes each layer's stamps while set (a timeline capture), else null

    def stamp_ptr(i: int):
        return stamps[i].data_ptr() if stamping[0] else None

    def st():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def launch_a(i, h_in, mode, pdl):
        check(lib.vq_sm_qk_launch(layers[i].w.data_ptr(), h_in.data_ptr(), qk.data_ptr(), cl.WSCALE, int(mode == 2),
                                  stamp_ptr(i), pdl, st()), "A launch")

    def launch_b(i, h_in, mode, pdl):
        layer = layers[i]
        check(lib.vq_sm_mixer_launch(layer.w.data_ptr(), wos[i].data_ptr(), layer.state.data_ptr(), h_in.data_ptr(),
                                     qk.data_ptr(), partial.data_ptr(), sumsq.data_ptr(), cl.WSCALE, cl.OSCALE, cl.G,
                                     cl.BETA, mode, stamp_ptr(i), pdl, st()), "B launch")

    def launch_c(i, h_in, h_out, pdl):
        check(lib.vq_sm_reduce_launch(partial.data_ptr(), sumsq.data_ptr(), h_in.data_ptr(), h_out.data_ptr(),
                                      stamp_ptr(i), pdl, st()), "C launch")

    def launch_s(i, h_in, h_out, pdl):
        check(lib.vq_sm_stream_launch(layers[i].stream.data_ptr(), STREAM_BYTES // 16, h_in.data_ptr(),
                                      h_out.data_ptr(), sink.data_ptr(), sms, pdl, st()), "S launch")

    def chain(mode: int, with_stream: bool, mixer_on: bool = True, pdl_on: bool = True):
        """h0 through every layer: A, B, C (+ S), B in `mode` (0, 1, 2: MODES); the result in hs[0] with S, else
        hs[len(layers) % 2]. The first launch after the copy of h0 goes without PDL (every launch with pdl_on
        False)."""
        hs[0].copy_(h0)
        for i in range(len(layers)):
            pdl, rest = int(i > 0 and pdl_on), int(pdl_on)
            if with_stream:  # A, B: hs0 -> partials, C: hs0 -> hs1, S: hs1 -> hs0
                if mixer_on:
                    launch_a(i, hs[0], mode, pdl)
                    launch_b(i, hs[0], mode, rest)
                    launch_c(i, hs[0], hs[1], rest)
                    launch_s(i, hs[1], hs[0], rest)
                else:
                    launch_s(i, hs[0], hs[0], pdl)
            else:
                launch_a(i, hs[i % 2], mode, pdl)
                launch_b(i, hs[i % 2], mode, rest)
                launch_c(i, hs[i % 2], hs[(i + 1) % 2], rest)

    saved = [layer.state.clone() for layer in layers]

    def restore():
        for layer, s0 in zip(layers, saved):
            layer.state.copy_(s0)

    def outputs():
        torch.cuda.synchronize()
        return hs[0].clone(), [layer.state.clone() for layer in layers]

    def same(x, y) -> bool:
        return torch.equal(x[0], y[0]) and all(torch.equal(a, b) for a, b in zip(x[1], y[1]))

    ref = cl.reference_parts(layers[0], saved[0], h0)

    def checks() -> tuple[bool, dict]:
        """One layer against the reference (NaN-filled outputs, without PDL, each mode), then the chain with PDL in
        each mode and as one graph replay against the chain without PDL (deterministic kernels: the same bits), and
        that chain against the reference."""
        res, ok = {}, True
        want_ss = ref["o"].square().sum(-1)  # [32]: the slices' sums, added
        for mode in MODES.values():
            restore()
            hs[0].copy_(h0)
            for t in (hs[1], qk, partial, sumsq):
                t.fill_(float("nan"))
            launch_a(0, hs[0], mode, 0)
            launch_b(0, hs[0], mode, 0)
            launch_c(0, hs[0], hs[1], 0)
            torch.cuda.synchronize()
            err_qk = ((qk - ref["qk"]).abs().max() / ref["qk"].abs().max()).item()
            err_ss = ((sumsq.view(V_HEADS, SLICES).sum(1) - want_ss).abs() / want_ss).max().item()
            heads = slice_partials_to_heads(partial, sumsq)
            err_p = ((heads - ref["partial"]).abs().max() / ref["partial"].abs().max()).item()
            err_s = (layers[0].state - ref["state"]).abs().max().item()
            expect = h0.float() + heads.sum(0)  # C: h + the factored partials, rounded once (within 1 bf16 ulp)
            err_h = ((hs[1].float() - expect).abs() / expect.abs().clamp_min(1e-3)).max().item()
            errs = (err_qk, err_ss, err_p, err_s, err_h)
            good = all(e <= 1e-4 for e in errs[:4]) and err_h <= 2**-7  # NaN compares False: not good
            res[f"one layer mode={mode}: qk, sumsq, partial rel err, state err, h rel err, ok"] = (*errs, good)
            print(f"one layer, mode {mode}: q|k rel err {err_qk:.3g}, sumsq rel err {err_ss:.3g}, partial (per head) "
                  f"rel err {err_p:.3g}, state max err {err_s:.3g}, h against its partials {err_h:.3g} (<= 1 bf16 ulp "
                  f"{2**-7:.3g}): {'ok' if good else 'MISMATCH'}", flush=True)
            ok &= good
        restore()
        chain(0, True, pdl_on=False)
        plain = outputs()
        runs = {}
        for mode in MODES.values():
            restore()
            chain(mode, True)
            runs[f"mode {mode}"] = same(outputs(), plain)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(0, True)
        restore()
        g.replay()
        runs["one graph replay (mode 0)"] = same(outputs(), plain)
        del g
        for name, equal in runs.items():
            res[f"chain {name} == chain without PDL"] = equal
            print(f"chain of {len(layers)} (A+B+C+S), PDL, {name}: the same bits as without PDL: {equal}", flush=True)
            ok &= equal
        h_ref = h0
        for layer, s0 in zip(layers, saved):
            h_ref = cl.reference_layer(layer, s0, h_ref)[0]
        err = (plain[0].float() - h_ref.float()).abs().max().item()
        scale = h_ref.float().abs().max().item()
        good = err <= 0.05 * max(1.0, scale)
        res["chain max |h err| against the reference, ok"] = (err, good)
        print(f"chain without PDL: max |h - ref| {err:.3g} (max |h| {scale:.3g}): {'ok' if good else 'MISMATCH'}",
              flush=True)
        restore()
        return ok and good, res

    def timeline(mode: int, with_stream: bool) -> dict:
        """One graph replay of the chain with every layer's stamps: per event, the earliest and the latest CTA's
        time in us after the layer's A wait returned (its last CTA: the layer's input ready), averaged over the
        middle layers (not the first, whose launch has no PDL, nor the last); "period": the next layer's."""
        stamping[0] = True
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(mode, with_stream)
        finally:
            stamping[0] = False
        restore()
        g.replay()  # warm
        stamps[..., 0].fill_(2**63 - 1)
        stamps[..., 1].zero_()
        restore()
        g.replay()
        torch.cuda.synchronize()
        del g
        t = stamps.double()
        ref = t[:, EVENTS.index("A wait returned"), 1]  # [layers]
        mid = slice(1, len(layers) - 1)
        rel = (t[mid] - ref[mid, None, None]) / 1e3  # [layers - 2, events, 2] us
        res = {ev: [rel[:, e, 0].mean().item(), rel[:, e, 1].mean().item()] for e, ev in enumerate(EVENTS)}
        per = (ref[2:] - ref[1:-1]) / 1e3
        res["period"] = [per.mean().item(), per.max().item()]
        return res

    n = len(layers)
    mixer_bytes = cl.QKVZ_ROWS * H + H * cl.OUT_K + 2 * layers[0].state.numel() * 4  # weights, state in + out
    floor_us = {k: b / (copy_tbs * 1e12) * 1e6 for k, b in
                {"A+B+C": mixer_bytes, "S": STREAM_BYTES, "A+B+C+S": mixer_bytes + STREAM_BYTES}.items()}
    out = {"gpu": gpu, "copy_tbs": copy_tbs, "registers": regs, "layers": n, "mixer_bytes": mixer_bytes,
           "us_a_layer": {}, "checks": {}}
    us = out["us_a_layer"]
    passed, out["checks"] = checks()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if not passed:
        raise SystemExit("the split mixer failed its checks (above): not timed")
    us["S"] = time_graph([lambda: chain(0, True, mixer_on=False)], reps=10) * 1e6 / n
    print(f"  S: {us['S']:.2f} us a layer, {us['S'] / floor_us['S']:.2f}x its bytes' time", flush=True)
    for suffix, mode in MODES.items():
        for with_stream in (False, True):
            name = ("A+B+C+S" if with_stream else "A+B+C") + suffix
            us[name] = time_graph([lambda m=mode, w=with_stream: chain(m, w)], reps=10) * 1e6 / n
            f = floor_us[base(name)]
            print(f"  {name}: {us[name]:.2f} us a layer, {us[name] / f:.2f}x its bytes' time ({f:.2f} us)",
                  flush=True)
    restore()
    if args.timeline:
        out["timeline_us"] = {}
        for mode in (0, 1):
            for with_stream in (False, True):
                name = ("A+B+C+S" if with_stream else "A+B+C") + ("" if mode == 0 else " late")
                out["timeline_us"][name] = timeline(mode, with_stream)
        restore()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{gpu}, copy {copy_tbs:.2f} TB/s; registers A {regs['A']}, B {regs['B']}, C {regs['C']}; {n} layers; "
          f"mixer bytes {mixer_bytes / 1e6:.1f} MB ({floor_us['A+B+C']:.2f} us)")
    print("| mode | us a layer | x its bytes' time |")
    print("|---|---|---|")
    for name in us:
        print(f"| {name} | {us[name]:.2f} | {us[name] / floor_us[base(name)]:.2f} |")
    for suffix in MODES:
        v = us[f"A+B+C+S{suffix}"] - us["S"]
        print(f"| A+B+C in the chain{suffix} (A+B+C+S{suffix} - S) | {v:.2f} | {v / floor_us['A+B+C']:.2f} |")
    for name, tl in out.get("timeline_us", {}).items():
        print(f"\ntimeline of a layer, {name} (us after A's last wait returned, mean over layers 2..{n - 1}; "
              f"earliest / latest CTA):")
        print("| event | earliest | latest |")
        print("|---|---|---|")
        for ev in EVENTS:
            print(f"| {ev} | {tl[ev][0]:.2f} | {tl[ev][1]:.2f} |")
        print(f"| the period: the next layer's A wait returned (mean / max over layers) | {tl['period'][0]:.2f} | "
              f"{tl['period'][1]:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
