"""bench/kernels/bench_split_mixer.py on the CPU: the driver end to end, its CUDA library replaced by torch stand-ins
(by raw pointer, as the library is called) that read the output projection through split_mixer.cu's fragment map,
so that its one run on a GPU does not fail on the driver or on the map; and its checks catch a launch that goes wrong
only under PDL."""

from __future__ import annotations

import sys

import pytest
import torch

from probe_fakes import RecordingLibrary, run_driver as run_probe


@pytest.fixture
def bench(bench_script):
    return bench_script("kernels/bench_split_mixer.py", "bench_split_mixer")


def fragment_map_logical(shuffled: torch.Tensor) -> torch.Tensor:
    """split_mixer.cu's reading of shuffle_fp8_mma's layout ([N/16, K/64, 2, 32, 16] uint8) back to [N, K]: lane
    l = 4g + t of half h of chunk c, byte bb -> row 16 tile + g + 8 ((bb / 2) & 1), k 64 c + 32 h + 16 (bb / 8) + 2t +
    (bb & 1) + 8 ((bb / 4) & 1)."""
    tiles, chunks = shuffled.shape[:2]
    out = torch.empty(tiles * 16, chunks * 64, dtype=torch.uint8)
    lane = torch.arange(32)[:, None]
    bb = torch.arange(16)[None, :]
    g, t = lane // 4, lane % 4
    row = g + 8 * ((bb // 2) & 1)
    col = 16 * (bb // 8) + 2 * t + (bb & 1) + 8 * ((bb // 4) & 1)
    for half in range(2):
        rows = (torch.arange(tiles)[:, None, None, None] * 16 + row).expand(tiles, chunks, 32, 16)
        cols = (torch.arange(chunks)[None, :, None, None] * 64 + 32 * half + col).expand(tiles, chunks, 32, 16)
        out[rows.reshape(-1), cols.reshape(-1)] = shuffled[:, :, half].reshape(-1)
    return out


def test_the_kernels_fragment_map_reads_shuffle_fp8_mma_back():
    from vibeqwen_kernels.fp8.mma import shuffle_fp8_mma

    w = torch.randint(0, 256, (64, 256), dtype=torch.uint8)
    back = fragment_map_logical(shuffle_fp8_mma(w))
    assert torch.equal(back, w)
    # a 32-column slice of a 16-row tile is one contiguous 512-byte half
    s = shuffle_fp8_mma(w)
    assert torch.equal(torch.sort(s[1, 2, 1].reshape(-1)).values, torch.sort(w[16:32, 160:192].reshape(-1)).values)


class FakeLibrary(RecordingLibrary):
    """split_mixer.cu's C functions over the driver's tensors in torch, as its header says (B's partials per slice,
    unscaled, with their sums of o^2; the output projection read through the fragment map). fault: "pdl_partial"
    zeroes slice 0's partial in B launches with PDL."""

    def __init__(self, mod, tensors: dict, fault: str | None = None, regs=(127, 96, 29)):
        super().__init__(tensors)
        self.mod, self.fault, self.regs = mod, fault, regs
        self.launches = {"A": 0, "B": 0, "C": 0, "S": 0}
        self.clock = 0  # ns: the fake timeline's (each stamped event 1 us after the one before)

    def _stamp(self, stamps, events):
        """The kernel's events (indices of the driver's EVENTS) one after another, earliest = latest CTA."""
        if stamps is None:
            return
        t = self.tensors[stamps]
        for e in events:
            self.clock += 1000
            t[e] = self.clock

    def vq_sm_smem(self):
        return 213392

    def vq_sm_registers(self, which):
        return self.regs[which]

    def vq_sm_qk_launch(self, w, h, qk, wscale, release_first, stamps, pdl, stream):
        t = self.tensors
        self.launches["A"] += 1
        w_t, h_t, qk_t = t[w], t[h], t[qk]

        def fn():
            self._stamp(stamps, (0, 1, 2))
            x = h_t.float()
            x = x * torch.rsqrt(x.square().mean() + 1e-6)
            qk_t.copy_(torch.nn.functional.silu(w_t[:4096].view(torch.float8_e4m3fn).float() @ x * wscale))
        return self._run(fn)

    def vq_sm_mixer_launch(self, w, wo, state, h, qk, partial, sumsq, wscale, oscale, g, beta, mode, stamps, pdl,
                           stream):
        t = self.tensors
        self.launches["B"] += 1
        w_t, wo_t, state_t, h_t, qk_t, p_t, ss_t = (t[w], t[wo], t[state], t[h], t[qk], t[partial], t[sumsq])
        silu = torch.nn.functional.silu

        def fn():
            self._stamp(stamps, range(3, 8))
            x = h_t.float()
            x = x * torch.rsqrt(x.square().mean() + 1e-6)
            y = w_t[4096:].view(torch.float8_e4m3fn).float() @ x * wscale
            v, z = silu(y[:4096].view(32, 128)), y[4096:].view(32, 128)
            q, k = qk_t[:2048].view(16, 128), qk_t[2048:].view(16, 128)
            qn = (q / q.norm(dim=-1, keepdim=True) / 128**0.5).repeat_interleave(2, 0)
            kn = (k / k.norm(dim=-1, keepdim=True)).repeat_interleave(2, 0)
            s = state_t * g
            s = s + beta * (v - torch.einsum("jik,jk->ji", s, kn))[..., None] * kn[:, None, :]
            o = torch.einsum("jik,jk->ji", s, qn)
            state_t.copy_(s)
            wo_l = fragment_map_logical(wo_t).view(torch.float8_e4m3fn).float()  # [2048, 4096]
            u = (o * silu(z)).view(128, 32)  # [b = 4j + s, 32 rows]
            p_t.copy_(torch.einsum("nbi,bi->bn", wo_l.view(2048, 128, 32), u) * oscale)
            ss_t.copy_(o.square().view(128, 32).sum(1))
            if self.fault == "pdl_partial" and pdl:
                p_t[0].zero_()
        return self._run(fn)

    def vq_sm_reduce_launch(self, partial, sumsq, h, h_out, stamps, pdl, stream):
        t = self.tensors
        self.launches["C"] += 1
        p_t, ss_t, h_t, out = t[partial], t[sumsq], t[h], t[h_out]

        def fn():
            self._stamp(stamps, (8, 9, 10))
            out.copy_((h_t.float() + self.mod.slice_partials_to_heads(p_t, ss_t).sum(0)).to(torch.bfloat16))
        return self._run(fn)

    def vq_sm_stream_launch(self, w, n16, h, h_out, sink, ctas, pdl, stream):
        t = self.tensors
        self.launches["S"] += 1
        h_t, out = t[h], t[h_out]
        return self._run(lambda: out.copy_(h_t.clone()))


def run_driver(bench, monkeypatch, tmp_path, argv=("--layers", "2"), **fake):
    """The driver's main() on the CPU (2 layers unless argv says otherwise); returns (the library, the JSON it wrote,
    its SystemExit or None)."""
    return run_probe(bench, monkeypatch, lambda tensors: FakeLibrary(bench, tensors, **fake), argv,
                     tmp_path / "split.json", modules=(bench.cl,))


def test_the_driver_checks_times_and_writes_its_figures(bench, monkeypatch, tmp_path, capsys):
    lib, result, err = run_driver(bench, monkeypatch, tmp_path)
    assert err is None
    checks = result["checks"]
    assert checks and all(v is True or (isinstance(v, list) and v[-1] is True) for v in checks.values()), checks
    assert set(result["us_a_layer"]) == {"S"} | {f"A+B+C{s}{m}" for s in ("", "+S") for m in ("", " late", " early")}
    assert all(lib.launches[k] > 0 for k in "ABCS")
    text = capsys.readouterr().out
    assert "| A+B+C in the chain (A+B+C+S - S) |" in text and "| A+B+C in the chain early (A+B+C+S early - S) |" in text
    assert "WARNING" not in text


def test_a_launch_wrong_only_under_pdl_is_caught_and_not_timed(bench, monkeypatch, tmp_path, capsys):
    """The one-layer checks launch without PDL; the chain checks must see what PDL changes."""
    _, result, err = run_driver(bench, monkeypatch, tmp_path, fault="pdl_partial")
    assert err is not None and "failed its checks" in str(err)
    assert result["checks"]["chain mode 0 == chain without PDL"] is False
    assert result["us_a_layer"] == {}


def test_kernels_that_cannot_share_an_sm_are_flagged(bench, monkeypatch, tmp_path, capsys):
    _, _, err = run_driver(bench, monkeypatch, tmp_path, regs=(168, 96, 29))
    assert err is None
    assert "WARNING: A and B need 264 registers" in capsys.readouterr().out
    run_driver(bench, monkeypatch, tmp_path, regs=(127, 100, 29))
    assert "WARNING: A, B and the stand-in S (32) need 264 registers" in capsys.readouterr().out


def test_the_timeline_is_each_event_after_the_layers_input(bench, monkeypatch, tmp_path, capsys):
    """The fake stamps each kernel's events 1 us apart in launch order (A, B, C, S unstamped): after A's wait, B's
    start is 2 us later (A end, B start), C's end 9 us; a layer (A, B, C: 11 events) every 11 us."""
    _, result, err = run_driver(bench, monkeypatch, tmp_path, argv=("--layers", "4", "--timeline"))
    assert err is None
    tl = result["timeline_us"]
    assert set(tl) == {"A+B+C", "A+B+C+S", "A+B+C late", "A+B+C+S late"}
    for name, t in tl.items():
        assert t["A start"] == [-1.0, -1.0] and t["B start"] == [2.0, 2.0] and t["C end"] == [9.0, 9.0], (name, t)
        assert t["period"] == [11.0, 11.0]
    assert "| B v|z copies landed | 3.00 | 3.00 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("--layers", "0"), ("--layers", "2", "--timeline")])
def test_too_few_layers_are_refused_before_anything_is_built(bench, monkeypatch, argv, capsys):
    def build():
        raise AssertionError("built")

    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setattr(sys, "argv", ["bench_split_mixer.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert f"--layers {argv[1]}: at least 1, and 3 with --timeline" in capsys.readouterr().err
