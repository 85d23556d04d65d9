"""The speculative rollback of the GDN state (`ForwardBatch.commit_gdn_states`, stacked fast path) at the full
model's shapes, without a checkpoint: wall time per call between device syncs and, under torch.profiler, its host
ops and kernels. Batches 1 and 8, 8-token verification passes (history buffers of 128 tokens), 3 tokens kept.

    python bench/kernels/bench_gdn_rollback.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_gdn_rollback: needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from vibeqwen.config import ModelConfig
    from vibeqwen.model.cache import ModelCache
    from vibeqwen.model.state import ForwardBatch, GDNHistoryBuffers

    dev = torch.device("cuda")
    cfg = ModelConfig.named("full")
    cache = ModelCache(cfg, 64, 16, 16, dtype=torch.bfloat16, device=dev)
    hb = GDNHistoryBuffers(cfg, cache.gdn_layers, 128, torch.bfloat16, dev)
    for nseq in (1, 8):
        q = 8
        batch = ForwardBatch(cache, [q] * nseq, [100] * nseq, [[0]] * nseq, list(range(nseq)), [True] * nseq)
        batch.history_buffers = hb
        batch.gdn_history_batched = {layer: (hb.conv0[j][:nseq], hb.inputs[j][: q * nseq], hb.states[j][: q * nseq])
                                     for j, layer in enumerate(cache.gdn_layers)}
        assert hb.holds(batch.gdn_history_batched)
        kept = {i: 3 for i in range(nseq)}
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            batch.commit_gdn_states(kept)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                batch.commit_gdn_states(kept)
            torch.cuda.synchronize()
        print(f"batch {nseq}: commit_gdn_states {statistics.median(times):.3f} ms (median of 20, synced)")
        ev = prof.key_averages()
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"   host {e.self_cpu_time_total / 5:8.1f} us/call x{e.count // 5:<3} {e.key[:70]}")
        for e in sorted(ev, key=lambda e: -e.device_time_total)[:8]:
            if e.device_time_total > 0:
                print(f"   cuda {e.device_time_total / 5:8.1f} us/call x{e.count // 5:<3} {e.key[:70]}")


if __name__ == "__main__":
    main()
