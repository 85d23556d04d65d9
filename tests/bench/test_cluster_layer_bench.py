"""bench/kernels/bench_cluster_layer.py on the CPU: the driver end to end, its CUDA library replaced by the torch
reference (by raw pointer, as the library is called), so that its one run on a GPU does not fail on the driver; and
its checks catch a launch that goes wrong only under PDL."""

from __future__ import annotations

import types

import pytest
import torch

from probe_fakes import RecordingLibrary, run_driver as run_probe


@pytest.fixture
def bench(bench_script):
    return bench_script("kernels/bench_cluster_layer.py", "bench_cluster_layer")


class FakeLibrary(RecordingLibrary):
    """cluster_layer.cu's C functions over the driver's tensors, computed by its torch reference. fault: "pdl_partial"
    zeroes cluster 0's partial in mixer launches with PDL (a race the checks must catch)."""

    def __init__(self, mod, tensors: dict, fault: str | None = None, clusters: int = 16):
        super().__init__(tensors)
        self.mod, self.fault, self.clusters = mod, fault, clusters
        self.launches = {"mixer": 0, "reduce": 0, "stream": 0}

    def vq_cl_smem(self):
        return 224544

    def vq_cl_max_clusters(self, cluster):
        return {8: self.clusters}.get(cluster, 128 // cluster)

    def vq_cl_layer_launch(self, w, wo, state, h, partial, wscale, oscale, g, beta, late, cluster, ctas, pdl,
                           stream):
        t = self.tensors
        self.launches["mixer"] += 1
        wo_t = t[wo]
        layer = types.SimpleNamespace(w=t[w], wo_logical=wo_t.permute(0, 2, 1, 3).reshape(2048, 4096))
        state_t, h_t, partial_t = t[state], t[h], t[partial]

        def fn():
            _, s, p = self.mod.reference_layer(layer, state_t.clone(), h_t)
            state_t.copy_(s)
            parts = 128 // cluster
            partial_t[:parts] = p.view(parts, 32 // parts, 2048).sum(1)
            if self.fault == "pdl_partial" and pdl:
                partial_t[0].zero_()
        return self._run(fn)

    def vq_cl_reduce_launch(self, partial, parts, h, h_out, pdl, stream):
        t = self.tensors
        self.launches["reduce"] += 1
        p, h_t, out = t[partial], t[h], t[h_out]
        return self._run(lambda: out.copy_((h_t.float() + p[:parts].sum(0)).to(torch.bfloat16)))

    def vq_cl_stream_launch(self, w, n16, h, h_out, sink, ctas, pdl, stream):
        t = self.tensors
        self.launches["stream"] += 1
        h_t, out = t[h], t[h_out]
        return self._run(lambda: out.copy_(h_t.clone()))


def run_driver(bench, monkeypatch, tmp_path, fault=None, clusters=16):
    """The driver's main() on the CPU with 2 layers; returns (the library, the JSON it wrote, its SystemExit or
    None)."""
    return run_probe(bench, monkeypatch, lambda tensors: FakeLibrary(bench, tensors, fault, clusters),
                     ("--layers", "2"), tmp_path / "cluster.json")


def test_the_driver_runs_both_shapes_and_writes_its_figures(bench, monkeypatch, tmp_path, capsys):
    lib, result, err = run_driver(bench, monkeypatch, tmp_path)
    assert err is None
    checks = result["checks"]
    assert set(checks) == {"cluster 8", "cluster 4"}
    for c in checks.values():
        assert all(v is True or (isinstance(v, list) and v[-1] is True) for v in c.values()), c
    assert {k for k in result["us_a_layer"]} == {"S"} | {f"cluster {c}: {m}" for c in (8, 4)
                                                         for m in ("A+B", "A+B late", "A+B+S", "A+B+S late")}
    assert lib.launches["mixer"] > 0 and lib.launches["stream"] > 0
    text = capsys.readouterr().out
    assert "| 8 | A+B in the chain (A+B+S - S) |" in text and "WARNING" not in text


def test_a_launch_wrong_only_under_pdl_is_caught_and_not_timed(bench, monkeypatch, tmp_path, capsys):
    """The one-layer checks launch without PDL; the chain checks must see what PDL changes."""
    _, result, err = run_driver(bench, monkeypatch, tmp_path, fault="pdl_partial")
    assert err is not None and "failed its checks" in str(err)
    c8 = result["checks"]["cluster 8"]
    assert c8["chain PDL == chain without PDL"] is False
    assert not any(k.startswith("cluster 8:") for k in result["us_a_layer"])
    assert "checks failed: not timed" in capsys.readouterr().out


def test_clusters_that_cannot_all_be_resident_are_flagged_and_timed_one_wave(bench, monkeypatch, tmp_path, capsys):
    _, result, err = run_driver(bench, monkeypatch, tmp_path, clusters=15)
    assert err is None
    text = capsys.readouterr().out
    assert "WARNING: only 15 clusters of 8 fit at once" in text
    assert "| 8 (WARNING: only 15 clusters of 8" in text
    assert "| 8 | A+B+S one wave (120 of 128 CTAs: part of the layer) |" in text
    timed = result["us_a_layer"]
    assert "cluster 8: A+B+S late one wave" in timed and "cluster 4: A+B one wave" not in timed
