"""What do a decode step's dependent weight streams cost as one launch a link against one persistent launch? (GPU)

The premise of a whole-step persistent decode kernel, measured without the model's arithmetic (batch 1 is at
~2.6x of its floor on the H100, ~3.6x on the H200; bench/results/h200_notes.md). A chain of phases, each reading its
own weight (distinct buffers, so every byte comes from HBM) and the whole output of the phase before
(bench/kernels/persistent_chain.cu says exactly what is computed), runs eight ways:

  launch        one kernel a phase, programmatic dependent launch between them, each requesting its weights before
                its PDL wait (early launch, as the decode graphs' FP8 GEMMs do), all in one CUDA graph
  launch late   the same with each kernel's weights requested after its PDL wait
  persistent    one kernel for the chain (every CTA resident), a grid barrier between phases
  persist+pf    the same, each warp requesting its first rows of the next phase before it arrives at the barrier
  counter+pf    persist+pf with a cheaper barrier: a counter that only grows (one release reduction a CTA, every
                CTA polling it), where the others' barrier has the last CTA bump a generation word after a fence
  tagged+pf     the persistent grid with no barrier: every output word carries its phase's tag and a CTA polls the
                words it stages until they carry the one it waits for (the tagged logits of csrc/moe_decode.cu)
  ring 128K     tagged, one CTA an SM, whose weights (its contiguous rows of every phase) one producer thread streams
  ring 208K     ahead into a shared-memory ring of 16 KB bulk copies (8 or 13 slots), across phase boundaries: the
                weight stream never waits for the chain's data, only for a free slot (the whole-step kernel's design
                with its weights decoupled from its dependencies); depth does not apply

Chains (``--chains``):

  decode_b1     40 layers x 6 phases shaped like a batch-1 decode step's streams (the GDN qkv|z 12288 x 2048 bytes,
                a 4 MB state-sized read, the output projection 2048 x 4096, the router 256 x 4096, the experts'
                gate|up 5120 x 2048 and down 2048 x 2560): ~2.2 GB, about the step's bytes
  small         240 phases of 0.5 MB (1024 x 512): what a link costs when it moves almost nothing

For each: us for the chain, its ratio to the bytes' time at the copy rate measured in the same run, and the time a
link adds above its bytes ((chain - bytes / copy rate) / phases). The eight modes' last outputs must be the same
bits (each row's sum in the same order), which checks the grid barrier. Prints a table last.

    python bench/kernels/bench_persistent_chain.py [--chains decode_b1,small] [--depths 1,2] [--json PATH]

Needs nvcc and an sm_90 GPU (builds persistent_chain.cu into $VIBEQWEN_CACHE/probe/).
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

# (rows, bytes a row) of one decode_b1 layer's phases
LAYER = [(12288, 2048), (1024, 4096), (2048, 4096), (256, 4096), (5120, 2048), (2048, 2560)]
CHAINS = {"decode_b1": LAYER * 40, "small": [(1024, 512)] * 240}


def build() -> ctypes.CDLL:
    """nvcc persistent_chain.cu (csrc/ on the include path) into the vibeqwen cache; raises CalledProcessError on a
    failed build."""
    lib = nvcc_probe("persistent_chain.cu", include_csrc=True)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.vq_chain_phase_launch.restype = i
    lib.vq_chain_phase_launch.argtypes = [p, i, i, p, i, p, i, i, p]
    lib.vq_chain_grid.restype = i
    lib.vq_chain_grid.argtypes = [i, i]
    lib.vq_chain_tagged_launch.restype = i
    lib.vq_chain_tagged_launch.argtypes = [p, p, p, i, p, i, p, p, i, i, i, p]
    lib.vq_chain_persistent_launch.restype = i
    lib.vq_chain_persistent_launch.argtypes = [p, p, p, i, p, i, p, p, p, i, i, i, i, p]
    lib.vq_chain_ring_launch.restype = i
    lib.vq_chain_ring_launch.argtypes = [p, p, p, i, p, i, p, p, i, i, p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def run_chain(lib: ctypes.CDLL, phases: list[tuple[int, int]], depths: list[int], copy_tbs: float) -> list[dict]:
    """Time one chain (`phases`: (rows, bytes a row) each, bytes a multiple of 512) in every mode at each depth (rows a
    warp requests at once: 1, 2 or 4). Returns a row a depth: us per chain for each mode, the bytes and their time at
    `copy_tbs` (TB/s), the CTAs of the persistent grids, and whether every mode's last output is the same bits.

    Raises:
        RuntimeError: a launch failed (its CUDA error code), or no persistent grid size could be read."""
    dev = torch.device("cuda")
    ws = [torch.randint(-2**31, 2**31 - 1, (r * k // 4,), dtype=torch.int32, device=dev) for r, k in phases]
    total = sum(r * k for r, k in phases)
    floor_us = total / (copy_tbs * 1e12) * 1e6
    rows_max = max(r for r, _ in phases)
    y0 = torch.rand(rows_max, device=dev) + 0.5
    rows0 = phases[-1][0]
    table = {
        "w": torch.tensor([w.data_ptr() for w in ws], dtype=torch.int64, device=dev),
        "rows": torch.tensor([r for r, _ in phases], dtype=torch.int32, device=dev),
        "kvec": torch.tensor([k // 16 for _, k in phases], dtype=torch.int32, device=dev),
    }
    sync = torch.zeros(3, dtype=torch.int32, device=dev)
    results = []
    for depth in depths:
        outs = {}

        def launch_chain(pdl: int, depth=depth):
            st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            if f"launch{pdl}" not in outs:  # allocated on the first (eager) call, before the capture
                outs[f"launch{pdl}"] = [torch.empty(rows_max, device=dev) for _ in range(2)]
            ys = outs[f"launch{pdl}"]
            prev, rows_prev = y0, rows0
            for p, ((r, k), w) in enumerate(zip(phases, ws)):
                y = ys[p % 2]
                _check(lib.vq_chain_phase_launch(w.data_ptr(), r, k // 16, prev.data_ptr(), rows_prev, y.data_ptr(),
                                                 depth, pdl, st), "phase launch")
                prev, rows_prev = y, r

        ctas, tctas = lib.vq_chain_grid(depth, 0), lib.vq_chain_grid(depth, 1)
        if min(ctas, tctas) < 1:
            raise RuntimeError("vq_chain_grid failed")
        # the tagged chain's words: y0 with tag 0 (the float's bits in the low half)
        y0t = y0.view(torch.int32).to(torch.int64) & 0xFFFFFFFF

        def tagged(prefetch: int, depth=depth, ctas=tctas):
            key = f"tagged{prefetch}"
            if key not in outs:
                outs[key] = [torch.empty(rows_max, dtype=torch.int64, device=dev) for _ in range(2)]
            ys = outs[key]
            for y in ys:
                y.zero_()  # tag 0: never awaited past phase 0 (memset nodes in the graph)
            st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            _check(lib.vq_chain_tagged_launch(table["w"].data_ptr(), table["rows"].data_ptr(),
                                              table["kvec"].data_ptr(), len(phases), y0t.data_ptr(), rows0,
                                              ys[0].data_ptr(), ys[1].data_ptr(), depth, ctas, prefetch, st),
                   "tagged launch")

        def ring(slots: int):
            key = f"ring{slots}"
            if key not in outs:
                outs[key] = [torch.empty(rows_max, dtype=torch.int64, device=dev) for _ in range(2)]
            ys = outs[key]
            for y in ys:
                y.zero_()
            st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count  # one CTA an SM, all resident
            _check(lib.vq_chain_ring_launch(table["w"].data_ptr(), table["rows"].data_ptr(), table["kvec"].data_ptr(),
                                            len(phases), y0t.data_ptr(), rows0, ys[0].data_ptr(), ys[1].data_ptr(),
                                            slots, sms, st), "ring launch")

        def persistent(prefetch: int, barrier: int = 0, depth=depth, ctas=ctas):
            key = f"persistent{prefetch}{barrier}"
            if barrier == 1:
                sync[2].zero_()  # the growing counter starts at 0 every launch (a memset node in the graph)
            if key not in outs:
                outs[key] = [torch.empty(rows_max, device=dev) for _ in range(2)]
            ys = outs[key]
            st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            _check(lib.vq_chain_persistent_launch(table["w"].data_ptr(), table["rows"].data_ptr(),
                                                  table["kvec"].data_ptr(), len(phases), y0.data_ptr(), rows0,
                                                  ys[0].data_ptr(), ys[1].data_ptr(), sync.data_ptr(), depth, ctas,
                                                  prefetch, barrier, st), "persistent launch")

        row = {"depth": depth, "ctas": ctas, "tagged_ctas": tctas, "bytes": total, "floor_us": floor_us,
               "phases": len(phases)}
        modes = [("launch", lambda: launch_chain(2)), ("launch late", lambda: launch_chain(1)),
                 ("persistent", lambda: persistent(0)), ("persist+pf", lambda: persistent(1)),
                 ("counter+pf", lambda: persistent(1, 1)), ("tagged+pf", lambda: tagged(1))]
        if depth == depths[0]:  # the ring has no depth: timed once, with the first depth's row
            modes += [("ring 128K", lambda: ring(8)), ("ring 208K", lambda: ring(13))]
        for name, fn in modes:
            us = time_graph([fn], reps=10) * 1e6
            row[name] = us
            print(f"  depth {depth}: {name}: {us:.1f} us, {us / floor_us:.2f}x the bytes' time, "
                  f"{(us - floor_us) / len(phases):.2f} us a link above the bytes", flush=True)
        last = (len(phases) - 1) % 2
        n_last = phases[-1][0]
        ref = outs["launch2"][last][:n_last]
        same = [torch.equal(outs[k][last][:n_last], ref) for k in ("launch1", "persistent00", "persistent10",
                                                                     "persistent11")]
        for key in ("tagged1", "ring8", "ring13"):
            if key not in outs:
                continue
            word = outs[key][last][:n_last]
            low = (word & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
            # and every word of the last phase's tag (the phase count): written by the last phase itself
            same += [torch.equal(low, ref), bool(((word >> 32) == len(phases)).all())]
        row["same_bits"] = all(same) and bool(torch.isfinite(ref).all())
        if not row["same_bits"]:
            print("  MISMATCH: the persistent chain's last output differs from the launched chain's", flush=True)
        results.append(row)
    ws.clear()
    torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", default="decode_b1,small")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = args.chains.split(",")
    bad = [n for n in names if n not in CHAINS]
    if bad:
        raise SystemExit(f"unknown chain(s) {bad}; choose from {sorted(CHAINS)}")
    depths = [int(d) for d in args.depths.split(",")]
    if any(d not in (1, 2, 4) for d in depths):
        raise SystemExit("--depths: each 1, 2 or 4")
    lib = build()
    copy_tbs = copy_bandwidth_tbs("cuda")
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy {copy_tbs:.2f} TB/s", flush=True)
    out = {"gpu": gpu, "copy_tbs": copy_tbs, "chains": {}}
    for name in names:
        print(f"{name}:", flush=True)
        out["chains"][name] = run_chain(lib, CHAINS[name], depths, copy_tbs)
    modes = ("launch", "launch late", "persistent", "persist+pf", "counter+pf", "tagged+pf", "ring 128K", "ring 208K")
    print("\n| chain | depth | CTAs (persistent; ring: one an SM) | bytes' time us | "
          + " | ".join(f"{m} us (x)" for m in modes)
          + " | us a link above the bytes (" + " / ".join(modes) + ") | same bits |")
    print("|---" * (len(modes) + 6) + "|")
    for name, rows in out["chains"].items():
        for r in rows:
            f, n = r["floor_us"], r["phases"]
            cells = " | ".join(f"{r[m]:.1f} ({r[m] / f:.2f}x)" if m in r else "" for m in modes)
            links = " / ".join(f"{(r[m] - f) / n:.2f}" if m in r else "-" for m in modes)
            print(f"| {name} | {r['depth']} | {r['ctas']} | {f:.1f} | {cells} | {links} | {r['same_bits']} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
