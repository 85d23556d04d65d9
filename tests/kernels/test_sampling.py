"""The fused top-k sampler (`vibeqwen_kernels.sampling.top_k_sample`) against its specification, the batched
PyTorch sampler (`candidate_probs` + `race`): the same token for the same uniforms, on logits full of ties (their
order is the keys'), NaN and -inf rows, and every sampling knob; under Triton's interpreter on the CPU, on the
device at the model's vocabulary."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels.sampling import race_sample, top_k_sample, top_p_sample

from vibeqwen.engine import sampler
from vibeqwen.sampling import SamplingParams

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Shared by the interpreter script and the GPU test: the kernel's token against the reference's, for rows whose
# race has a clear winner (the top two scores apart by more than float32 rounding of the probabilities could
# move them) and no top_p cut within rounding of a cumulative sum.
CHECK = textwrap.dedent(
    """
    import torch
    from vibeqwen.engine.sampler import candidate_probs, order_keys, race
    from vibeqwen.sampling import SamplingParams
    from vibeqwen_kernels.sampling import top_k_sample

    KNOBS = [(0.6, 20, 0.95, 0.0), (1.0, 1, 1.0, 0.0), (0.3, 128, 0.55, 0.0), (1.0, 64, 1.0, 0.05),
             (0.7, 5, 0.9, 0.0), (1.5, 20, 0.95, 0.0), (2.0, 100, 0.99, 0.01), (0.6, 33, 1.0, 0.0)]

    def compare(n, vocab, draws, device, seed):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(n, vocab, generator=g) * 4).round(decimals=1)  # ties everywhere, as a bf16 head gives
        x[3 % n, 100:200] = float("nan")
        if n > 4:
            x[4] = float("-inf")  # no mass at all: the row's argmax
            x[5, 7] = float("inf")
        x = x.to(device)
        params = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp) for t, k, tp, mp in
                  (KNOBS * n)[:n]]
        values = torch.tensor([[p.temperature for p in params], [p.top_k for p in params],
                               [p.min_p for p in params], [p.top_p for p in params]], device=device)
        checked = same = 0
        for _ in range(draws):
            u = torch.rand(n, vocab, generator=g, dtype=torch.float64).to(device)
            probs, ids = candidate_probs(x, params)
            uc = u.gather(1, ids)
            ref = ids.gather(1, race(probs, uc)[:, None])[:, 0]
            out = top_k_sample(x, values, max(p.top_k for p in params), u, x.argmax(-1))
            scores = torch.where(probs > 0, probs.double() / -uc.log(), -1.0).topk(2, dim=-1).values
            tops = torch.tensor([p.top_p for p in params], device=device)[:, None]
            near_cut = (((probs.cumsum(-1) - probs) - tops).abs() <= 1e-5).any(-1) & (tops[:, 0] < 1)
            dead = (x == float("-inf")).all(-1)
            clear = ((scores[:, 0] > scores[:, 1] * (1 + 1e-5)) & ~near_cut) | dead
            checked += int(clear.sum())
            same += int(((out == ref) & clear).sum())
        return checked, same, n * draws

    def membership(vocab, device, configs, seed):
        # Rows whose uniform is ~1 - 2^-52 at one probed id and 1e-300 elsewhere: the probed id wins exactly when
        # it is a candidate with mass (its score is ~1e16 x its probability against ~1e-3 x the others'), else the
        # most likely candidate (the first column: equal values rank by id). Probed: the ids ranked just inside
        # and just outside each row's candidate set (by the reference). Returns (rows, mismatches).
        g = torch.Generator().manual_seed(seed)
        ties = (torch.randn(vocab, generator=g) * 2).round(decimals=1)
        flat = torch.zeros(vocab)  # all equal: top_k keeps the lowest ids
        rows, expect, params = [], [], []
        for x, p in configs(ties, flat):
            probs, ids = candidate_probs(x[None], [p])
            order = torch.argsort(order_keys(x[None])[0], descending=True)
            m = int((probs[0] > 0).sum())
            mass = probs[0].cumsum(0) - probs[0]
            if p.top_p < 1 and ((mass - p.top_p).abs() < 1e-5).any():
                raise AssertionError(f"{p}: a top_p cut within rounding; pick other knobs")
            for r in sorted({m - 1, m} & set(range(vocab))):
                rows.append(x)
                params.append(p)
                expect.append((int(order[r]), int(ids[0, 0])))  # (probed id, the most likely)
        n = len(rows)
        x = torch.stack(rows).to(device)
        u = torch.full((n, vocab), 1e-300, dtype=torch.float64)
        for i, (hot, _) in enumerate(expect):
            u[i, hot] = 1 - 2**-52
        u = u.to(device)
        values = torch.tensor([[p.temperature for p in params], [p.top_k for p in params],
                               [p.min_p for p in params], [p.top_p for p in params]], device=device)
        out = top_k_sample(x, values, max(p.top_k for p in params), u, x.argmax(-1)).tolist()
        probs, ids = candidate_probs(x, params)
        ref = ids.gather(1, race(probs, u.gather(1, ids))[:, None])[:, 0].tolist()
        bad = []
        for i, (hot, top) in enumerate(expect):
            p = params[i]
            inside = bool((ids[i] == hot).any()) and float(probs[i][ids[i] == hot].max()) > 0
            want = hot if inside else top
            if out[i] != want or ref[i] != want:
                bad.append((p.top_k, p.top_p, p.min_p, hot, want, out[i], ref[i]))
        return n, bad

    def small_k(ties, flat):
        yield flat, SamplingParams(temperature=1.0, top_k=20)  # exactly ids 0-19
        yield ties, SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
        yield ties, SamplingParams(temperature=1.0, top_k=1)
        yield ties, SamplingParams(temperature=1.0, top_k=2)
        yield ties, SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
        yield ties, SamplingParams(temperature=1.0, top_k=30, min_p=0.2)

    def large_k(ties, flat):
        yield from small_k(ties, flat)  # rows with a top_k below the batch's largest
        yield flat, SamplingParams(temperature=1.0, top_k=128)
        yield ties, SamplingParams(temperature=0.3, top_k=128, top_p=0.55)
        yield ties, SamplingParams(temperature=1.0, top_k=64, min_p=0.05)
        yield ties, SamplingParams(temperature=2.0, top_k=100, top_p=0.99, min_p=0.01)
    """
)


def _run_interpreted(script: str, **env_extra: str) -> None:
    """Run `script` in a fresh Python under Triton's interpreter on the CPU (extra environment variables added);
    it must exit 0 with its last line "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **env_extra}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.slow
def test_matches_the_batched_sampler_under_the_interpreter(tmp_path):
    """Tokens equal the reference's on tie-heavy logits with NaN, -inf and +inf entries, top_k 1-128 (the row in
    one chunk of the first pass, and in several), min_p and top_p cuts; a row with no mass takes its argmax."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    script = CHECK + textwrap.dedent(
        """
        import vibeqwen_kernels.sampling as K
        # random draws with the row in one program of the first pass; the candidate sets (each K bucket) with the
        # row in three (600 ids in chunks of 256)
        checked, same, total = compare(8, 600, 1, "cpu", seed=0)
        assert checked >= 0.85 * total and same == checked, (checked, same, total)
        K._CHUNK = 256
        for configs in (small_k, large_k):
            n, bad = membership(600, "cpu", configs, seed=1)
            assert n >= 10 and not bad, bad
        print("ok")
        """
    )
    _run_interpreted(script)


def test_sample_rows_takes_the_fused_path_for_top_k_rows(tmp_path):
    """sample_rows under the interpreter: rows with a top_k go through the fused top-k kernels, rows that keep
    the whole vocabulary through the race kernels and rows with a top_p but no top_k through the top-p kernels
    (and only they), and the batch's tokens (seeded rows) are those of VIBEQWEN_FUSED_SAMPLER=0; a seeded row
    draws the same token in any batch."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    script = textwrap.dedent(
        """
        import os
        import torch
        import vibeqwen.engine.sampler as S
        from vibeqwen.sampling import SamplingParams

        calls, race_calls, top_p_calls = [], [], []
        real, real_race, real_top_p = S.top_k_sample, S.race_sample, S.top_p_sample
        S.top_k_sample = lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
        S.race_sample = lambda x, *a: race_calls.append(x.shape[0]) or real_race(x, *a)
        S.top_p_sample = lambda x, *a: top_p_calls.append(x.shape[0]) or real_top_p(x, *a)
        torch.manual_seed(0)
        logits = torch.randn(7, 700) * 3
        # seeded rows: unseeded ones share the default generator's draw per group of rows, so their tokens
        # depend on how the batch is split
        params = [SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=3),
                  SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_p=0.7, seed=2),
                  SamplingParams(temperature=0.7, top_k=200, seed=4), SamplingParams(temperature=1.0, top_k=5, seed=5),
                  SamplingParams(temperature=1.2, top_k=700, min_p=0.05, seed=6)]  # top_k = V: the whole vocabulary
        gens = lambda: [S.make_generator(p) if p.seed is not None else None for p in params]
        for trial in range(2):
            torch.manual_seed(trial)
            fused = S.sample_rows(logits, params, gens())
            os.environ["VIBEQWEN_FUSED_SAMPLER"] = "0"
            torch.manual_seed(trial)
            plain = S.sample_rows(logits, params, gens())
            del os.environ["VIBEQWEN_FUSED_SAMPLER"]
            assert fused.tolist() == plain.tolist(), (fused, plain)
        assert calls == [2, 2], calls  # rows 1 and 5 (top_k 200 > MAX_TOP_K: the PyTorch path)
        # rows 2 and 6 (no top_k or top_k = V, no top_p); row 3 (top_p 0.7 without a top_k): the top-p kernels
        assert race_calls == [2, 2] and top_p_calls == [1, 1], (race_calls, top_p_calls)
        alone = S.sample_rows(logits[1:2], params[1:2], [S.make_generator(params[1])])
        assert int(alone[0]) == int(fused[1])
        print("ok")
        """
    )
    _run_interpreted(script, VIBEQWEN_FAST="1")


RACE_CHECK = textwrap.dedent(
    """
    import torch
    from vibeqwen.engine.sampler import candidate_probs, race
    from vibeqwen.sampling import SamplingParams
    from vibeqwen_kernels.sampling import race_sample

    def values_of(params, device):
        return torch.tensor([[p.temperature for p in params], [0.0] * len(params), [p.min_p for p in params],
                             [1.0] * len(params)], device=device)

    def race_compare(n, vocab, draws, device, seed):
        # rows that keep the whole vocabulary: temperature and min_p only
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(n, vocab, generator=g) * 4).round(decimals=1)  # ties everywhere
        x[3 % n, 100:200] = float("nan")
        if n > 4:
            x[4] = float("-inf")  # no mass at all: the row's argmax
            x[5, [7, vocab - 3]] = float("inf")  # two +inf: tied at the largest float32
        if n > 6:
            x[6, 10:20] = 1e36  # overflows at temperature 1e-4: ten ids tied at the largest float32
        knobs = [(0.6, 0.0), (1.0, 0.0), (0.3, 0.1), (1.5, 0.05), (2.0, 0.0), (1.0, 0.9), (1e-4, 0.0), (5.0, 0.0)]
        params = [SamplingParams(temperature=t, min_p=mp) for t, mp in (knobs * n)[:n]]
        x = x.to(device)
        checked = same = 0
        for _ in range(draws):
            u = torch.rand(n, vocab, generator=g, dtype=torch.float64).to(device)
            probs, ids = candidate_probs(x, params)
            assert ids is None  # nothing sorted: column j is id j
            ref = race(probs, u.clone())
            out = race_sample(x, values_of(params, device), u, x.argmax(-1))
            scores = torch.where(probs > 0, probs.double() / -u.log(), -1.0).topk(2, dim=-1).values
            dead = (x == float("-inf")).all(-1)
            clear = (scores[:, 0] > scores[:, 1] * (1 + 1e-5)) | dead
            checked += int(clear.sum())
            same += int(((out == ref) & clear).sum())
        return checked, same, n * draws

    def race_membership(vocab, device):
        # Rows of logits -1e4 but id 0 (0, the peak), id 1 at T ln(min_p) + 1e-3 T (just kept: exp((x - 0) / T)
        # >= min_p) and id 2 at T ln(min_p) - 1e-3 T (just dropped), whose uniform is ~1 - 2^-52 at one probed id
        # and 1e-300 elsewhere: the probed id wins exactly when it is kept, else id 0. A cut off by a factor of
        # 1.002 in either direction moves one of them. Also: every logit equal with min_p 1 (all kept: e >= min_p,
        # not e > min_p), and min_p 0 with the last id probed. Returns (rows, mismatches).
        import math
        rows, params, probes = [], [], []
        for t, mp in ((1.0, 0.2), (0.5, 0.05), (2.0, 0.5), (0.7, 0.9), (1.0, 0.01)):
            cut = t * math.log(mp)
            x = torch.full((vocab,), -1e4)
            x[0], x[1], x[2] = 0.0, cut + 1e-3 * t, cut - 1e-3 * t
            for probe in (1, 2):
                rows.append(x)
                params.append(SamplingParams(temperature=t, min_p=mp))
                probes.append(probe)
        rows += [torch.zeros(vocab), -0.01 * torch.arange(vocab, dtype=torch.float32)]
        params += [SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=1.0, min_p=0.0)]
        probes += [vocab - 1, vocab - 1]
        n = len(params)
        u = torch.full((n, vocab), 1e-300, dtype=torch.float64)
        for i, probe in enumerate(probes):
            u[i, probe] = 1 - 2**-52
        xs = torch.stack(rows).to(device)
        u = u.to(device)
        out = race_sample(xs, values_of(params, device), u, xs.argmax(-1)).tolist()
        probs, _ = candidate_probs(xs, params)
        ref = race(probs, u.clone()).tolist()
        bad = []
        for i, (p, probe) in enumerate(zip(params, probes)):
            want = probe if bool(probs[i, probe] > 0) else 0
            if out[i] != want or ref[i] != want:
                bad.append((p.temperature, p.min_p, probe, want, out[i], ref[i]))
        return n, bad
    """
)


def test_race_sample_matches_the_batched_sampler_under_the_interpreter():
    """Rows without a top_k or a top_p (temperature, min_p): tokens equal the reference's on tie-heavy logits with
    NaN, -inf and +inf entries, the row in one chunk and in several; a row with no mass takes its argmax; the
    min_p cut keeps exactly the reference's ids."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    script = RACE_CHECK + textwrap.dedent(
        """
        import vibeqwen_kernels.sampling as K
        checked, same, total = race_compare(8, 600, 2, "cpu", seed=0)
        assert checked >= 0.85 * total and same == checked, (checked, same, total)
        K._CHUNK = 256  # the row in three chunks
        checked, same, total = race_compare(8, 600, 2, "cpu", seed=1)
        assert checked >= 0.85 * total and same == checked, (checked, same, total)
        checked, same, total = race_compare(3, 5, 2, "cpu", seed=2)  # a vocabulary below one chunk
        assert same == checked, (checked, same, total)
        n, bad = race_membership(40, "cpu")
        assert n >= 12 and not bad, bad
        print("ok")
        """
    )
    _run_interpreted(script)


def test_check_race_turns_a_wrong_kernel_off():
    """Start-up's check (`check_race`) passes the real kernels under the interpreter, and turns off kernels whose
    tokens disagree with the PyTorch path (here: every row's id 0), after which sample_rows draws those rows with
    PyTorch ops."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    script = textwrap.dedent(
        """
        import torch
        import vibeqwen.engine.sampler as S
        from vibeqwen.sampling import SamplingParams

        assert S.check_race(3000, torch.device("cpu")) and not S._race_failed
        calls = []
        S.race_sample = lambda x, v, u, fb: calls.append(x.shape[0]) or torch.zeros_like(fb)
        assert not S.check_race(3000, torch.device("cpu")) and S._race_failed
        torch.manual_seed(0)
        params = [SamplingParams(temperature=1.0, seed=1)]
        out = S.sample_rows(torch.randn(1, 3000) * 3, params, [S.make_generator(params[0])])
        assert calls == [8] and int(out[0]) != 0  # not drawn by the wrong kernel any more
        print("ok")
        """
    )
    _run_interpreted(script)


def test_a_failing_kernel_falls_back_once(monkeypatch, caplog):
    """Where the kernels cannot be built (an older Triton), sample_rows warns once and draws with PyTorch ops."""
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no tl.topk here")

    monkeypatch.setattr(sampler, "top_k_sample_available", lambda device, vocab: True)
    monkeypatch.setattr(sampler, "top_k_sample", broken)
    monkeypatch.setattr(sampler, "_fused_failed", False)
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.6, top_k=20, seed=9)] * 3
    gens = [sampler.make_generator(p) for p in params]
    with caplog.at_level("WARNING"):
        first = sampler.sample_rows(logits, params, gens)
        again = sampler.sample_rows(logits, params, gens)
    assert calls == [1] and "fused top-k sampler failed" in caplog.text
    assert first.shape == again.shape == (3,) and all(0 <= int(t) < 50 for t in first)


def test_warm_up_builds_each_bucket(monkeypatch):
    """Engine start-up draws once per K bucket (so no request waits for a build), and stops at a failure; then it
    checks the whole-vocabulary and the top-p kernels (each unless it failed before)."""
    seen = []
    monkeypatch.setattr(sampler, "top_k_sample_available", lambda device, vocab: True)
    monkeypatch.setattr(sampler, "top_k_sample", lambda x, values, k, u, fb: seen.append(k) or fb)
    monkeypatch.setattr(sampler, "check_race", lambda vocab, device: seen.append(("race", vocab)))
    monkeypatch.setattr(sampler, "check_top_p", lambda vocab, device: seen.append(("top_p", vocab)))
    monkeypatch.setattr(sampler, "_fused_failed", False)
    monkeypatch.setattr(sampler, "_race_failed", False)
    monkeypatch.setattr(sampler, "_top_p_failed", False)
    sampler.warm_up(300, torch.device("cpu"))
    assert seen == [32, 128, ("race", 300), ("top_p", 300)]
    monkeypatch.setattr(sampler, "top_k_sample", lambda *a: seen.append("x") or 1 / 0)
    sampler.warm_up(300, torch.device("cpu"))
    assert seen[4:] == ["x", ("race", 300), ("top_p", 300)] and sampler._fused_failed
    monkeypatch.setattr(sampler, "_race_failed", True)
    monkeypatch.setattr(sampler, "_top_p_failed", True)
    sampler.warm_up(300, torch.device("cpu"))
    assert seen[7:] == []  # all failed before: nothing is built


def test_rejects_bad_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 64)
    values = torch.tensor([[1.0, 1.0], [5.0, 5.0], [0.0, 0.0], [1.0, 1.0]])
    u = torch.rand(2, 64, dtype=torch.float64)
    fb = x.argmax(-1)
    with pytest.raises(ValueError, match="CUDA"):
        top_k_sample(x, values, 5, u, fb)  # the CPU outside the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for args, what in (((x.double(), values, 5, u, fb), "logits"), ((x, values[:3], 5, u, fb), "params"),
                       ((x, values, 0, u, fb), "max_top_k"), ((x, values, 129, u, fb), "max_top_k"),
                       ((x, values, 5, u.float(), fb), "uniform"), ((x, values, 5, u, fb.int()), "fallback"),
                       ((torch.randn(2, 1 << 20), values, 5, u, fb), "vocabulary")):
        with pytest.raises(ValueError, match=what):
            top_k_sample(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")
def test_gpu_matches_the_batched_sampler_at_the_model_vocabulary():
    """At 248320 ids, batches of 1-64 rows: the kernel's tokens are the reference's for the same uniforms, and its
    candidate sets are exactly the reference's (probed one id at a time, both K buckets)."""
    scope: dict = {}
    exec(CHECK, scope)
    for n in (1, 8, 32, 64):
        checked, same, total = scope["compare"](n, 248320, 2, "cuda", seed=n)
        assert checked >= 0.9 * total and same == checked, (n, checked, same, total)
    for configs in (scope["small_k"], scope["large_k"]):
        n, bad = scope["membership"](248320, "cuda", configs, seed=1)
        assert n >= 10 and not bad, bad
    # the engine's path: warmed up without falling back
    sampler.warm_up(248320, torch.device("cuda"))
    assert not sampler._fused_failed


@pytest.mark.parametrize(("draw", "top_p"), [(race_sample, 1.0), (top_p_sample, 0.9)], ids=["race", "top_p"])
def test_whole_vocabulary_draws_reject_bad_inputs(monkeypatch, draw, top_p):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 64)
    values = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [top_p, top_p]])
    u = torch.rand(2, 64, dtype=torch.float64)
    fb = x.argmax(-1)
    with pytest.raises(ValueError, match="CUDA"):
        draw(x, values, u, fb)  # the CPU outside the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for args, what in (((x.double(), values, u, fb), "logits"), ((x, values[:3], u, fb), "params"),
                       ((x, values, u.float(), fb), "uniform"), ((x, values, u[:, :10], fb), "uniform"),
                       ((x, values, u, fb.int()), "fallback"), ((x[:, :0], values, u[:, :0], fb), "vocabulary")):
        with pytest.raises(ValueError, match=what):
            draw(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")
def test_gpu_race_sample_matches_the_batched_sampler_at_the_model_vocabulary():
    """At 248320 ids, batches of 1-64 rows without a top_k or a top_p: the kernels' tokens are the reference's for
    the same uniforms, the min_p cut keeps the reference's ids, and start-up's check passes."""
    scope: dict = {}
    exec(RACE_CHECK, scope)  # noqa: S102 - the interpreter test's helpers, run here on the device
    for n in (1, 8, 32, 64):
        checked, same, total = scope["race_compare"](n, 248320, 2, "cuda", seed=n)
        assert checked >= 0.9 * total and same == checked, (n, checked, same, total)
    n, bad = scope["race_membership"](248320, "cuda")
    assert n >= 12 and not bad, bad
    assert sampler.check_race(248320, torch.device("cuda")) and not sampler._race_failed


TOP_P_CHECK = textwrap.dedent(
    """
    import torch
    from vibeqwen.engine.sampler import candidate_probs, mass_before, race, row_cumsum
    from vibeqwen.sampling import SamplingParams
    from vibeqwen_kernels.sampling import top_p_sample

    def top_p_values(params, device):
        return torch.tensor([[p.temperature for p in params], [0.0] * len(params), [p.min_p for p in params],
                             [p.top_p for p in params]], device=device)

    def top_p_compare(n, vocab, draws, device, seed):
        # rows with a top_p and no top_k, on logits full of ties (a cut inside a run of equal values)
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(n, vocab, generator=g) * 4).round(decimals=1)
        x[3 % n, 100:200] = float("nan")
        if n > 4:
            x[4] = float("-inf")  # no mass at all: the row's argmax
            x[5, [7, vocab - 3]] = float("inf")  # two +inf: tied at the largest float32
        knobs = [(0.6, 0.95, 0.0), (1.0, 0.5, 0.0), (0.3, 0.9, 0.1), (1.5, 0.99, 0.05), (2.0, 0.3, 0.0),
                 (1.0, 0.7, 0.0), (1.0, 1e-40, 0.0), (5.0, 0.999, 0.0)]
        params = [SamplingParams(temperature=t, top_p=tp, min_p=mp) for t, tp, mp in (knobs * n)[:n]]
        x = x.to(device)
        checked = same = 0
        for _ in range(draws):
            u = torch.rand(n, vocab, generator=g, dtype=torch.float64).to(device)
            probs, ids = candidate_probs(x, params)
            uc = u.gather(1, ids)
            ref = ids.gather(1, race(probs, uc)[:, None])[:, 0]
            out = top_p_sample(x, top_p_values(params, device), u, x.argmax(-1))
            scores = torch.where(probs > 0, probs.double() / -uc.log(), -1.0).topk(2, dim=-1).values
            tops = torch.tensor([p.top_p for p in params], device=device)[:, None]
            near_cut = ((mass_before(x, params, ids) - tops).abs() <= 1e-5).any(-1)  # (the mass before the cut)
            dead = (x == float("-inf")).all(-1)
            clear = ((scores[:, 0] > scores[:, 1] * (1 + 1e-5)) & ~near_cut) | dead
            checked += int(clear.sum())
            same += int(((out == ref) & clear).sum())
        return checked, same, n * draws

    def top_p_membership(vocab, device, seed):
        # Rows whose uniform is ~1 - 2^-52 at one probed id and 1e-300 elsewhere: the probed id wins exactly when
        # the cut keeps it, else the most likely id. Probed: the last id the reference keeps and the next one, in
        # (value descending, id ascending) order, on tie-heavy rows, a row of equal logits (the cut inside one
        # run of ties: by id) and rows with min_p too. Returns (rows, mismatches).
        g = torch.Generator().manual_seed(seed)
        ties = (torch.randn(vocab, generator=g) * 2).round(decimals=1)
        flat = torch.zeros(vocab)
        half = vocab // 2
        configs = [(ties, SamplingParams(temperature=0.6, top_p=0.9)),
                   (ties, SamplingParams(temperature=1.3, top_p=0.97, min_p=0.02)),
                   (flat, SamplingParams(temperature=1.0, top_p=(half + 0.3) / vocab)),
                   (flat, SamplingParams(temperature=0.7, top_p=7.6 / vocab))]
        rows, params, expect = [], [], []
        for x, p in configs:
            probs, ids = candidate_probs(x[None], [p])
            mass = row_cumsum(probs)[0] - probs[0]
            if ((mass - p.top_p).abs() < 1e-5).any():
                raise AssertionError(f"{p}: a top_p cut within rounding; pick other knobs")
            m = int((probs[0] > 0).sum())
            for r in (m - 1, m):
                if r < vocab:
                    rows.append(x)
                    params.append(p)
                    expect.append((int(ids[0, r]), int(ids[0, 0])))  # (probed id, the most likely)
        n = len(rows)
        xs = torch.stack(rows).to(device)
        u = torch.full((n, vocab), 1e-300, dtype=torch.float64)
        for i, (hot, _) in enumerate(expect):
            u[i, hot] = 1 - 2**-52
        out = top_p_sample(xs, top_p_values(params, device), u.to(device), xs.argmax(-1)).tolist()
        probs, ids = candidate_probs(xs, params)
        bad = []
        for i, (hot, top) in enumerate(expect):
            kept = bool(((ids[i] == hot) & (probs[i] > 0)).any())
            want = hot if kept else top
            if out[i] != want:
                bad.append((params[i].top_p, params[i].min_p, hot, want, out[i]))
        return n, bad
    """
)


@pytest.mark.slow
def test_top_p_sample_matches_the_batched_sampler_under_the_interpreter():
    """Rows with a top_p but no top_k: tokens equal the reference's on tie-heavy logits with NaN, -inf and +inf
    entries and min_p, the row in one chunk and in several; the cut keeps exactly the reference's ids (probed at
    its last id and the next, inside runs of equal values too); start-up's check passes the kernels and turns off
    kernels that disagree (then those rows draw with PyTorch ops)."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    script = TOP_P_CHECK + textwrap.dedent(
        """
        import vibeqwen_kernels.sampling as K
        import vibeqwen.engine.sampler as S
        K._CHUNK = 512  # the row in two chunks: the ranks of tied ids carry across chunks
        checked, same, total = top_p_compare(6, 600, 1, "cpu", seed=0)
        assert checked >= 0.75 * total and same == checked, (checked, same, total)
        n, bad = top_p_membership(600, "cpu", seed=1)
        assert n >= 7 and not bad, bad
        checked, same, total = top_p_compare(3, 5, 1, "cpu", seed=4)  # a vocabulary below one chunk
        assert same == checked, (checked, same, total)
        assert S.check_top_p(600, torch.device("cpu")) and not S._top_p_failed
        calls = []
        S.top_p_sample = lambda x, v, u, fb: calls.append(x.shape[0]) or torch.zeros_like(fb)
        assert not S.check_top_p(600, torch.device("cpu")) and S._top_p_failed and not S._race_failed
        params = [SamplingParams(temperature=1.0, top_p=0.8, seed=1)]
        torch.manual_seed(0)
        out = S.sample_rows(torch.randn(1, 600) * 3, params, [S.make_generator(params[0])])
        assert calls == [9] and int(out[0]) != 0  # not drawn by the wrong kernel any more
        print("ok")
        """
    )
    _run_interpreted(script)


@pytest.mark.parametrize("kernel,top_p,warning,stays_on", [
    ("race_sample", 1.0, "whole-vocabulary sampler failed", ["_fused_failed"]),
    ("top_p_sample", 0.9, "top-p sampler failed", ["_race_failed", "_fused_failed"]),
])
def test_a_failing_whole_vocabulary_kernel_falls_back_once(monkeypatch, caplog, kernel, top_p, warning, stays_on):
    """Where the whole-vocabulary kernels (race_sample: rows without a top_k or top_p; top_p_sample: rows with a top_p
    only) cannot be built, sample_rows warns once and draws those rows with PyTorch ops; the other fused kernels
    stay on."""
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(sampler, "top_k_sample_available", lambda device, vocab: True)
    monkeypatch.setattr(sampler, kernel, broken)
    for flag in ("_top_p_failed", "_race_failed", "_fused_failed"):
        monkeypatch.setattr(sampler, flag, False)
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.8, top_p=top_p, seed=9)] * 2
    gens = [sampler.make_generator(p) for p in params]
    with caplog.at_level("WARNING"):
        first = sampler.sample_rows(logits, params, gens)
        again = sampler.sample_rows(logits, params, gens)
    assert calls == [1] and warning in caplog.text
    assert not any(getattr(sampler, flag) for flag in stays_on)
    assert first.shape == again.shape == (2,) and all(0 <= int(t) < 50 for t in first)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")
def test_gpu_top_p_sample_matches_the_batched_sampler_at_the_model_vocabulary():
    """At 248320 ids, batches of 1-64 rows with a top_p but no top_k: the kernels' tokens are the reference's for
    the same uniforms, the cut keeps the reference's ids, and start-up's check passes."""
    scope: dict = {}
    exec(TOP_P_CHECK, scope)  # noqa: S102 - the interpreter test's helpers, run here on the device
    draws = 2
    for n in (1, 8, 32, 64):
        checked, same, total = scope["top_p_compare"](n, 248320, draws, "cuda", seed=n)
        # rows no draw can judge at this vocabulary: row 5's two +inf (a tie), and every row of top_p 1e-40 (the
        # mass before the first id, 0, is within 1e-5 of it) or of temperature 5 (probabilities of ~4e-6: some id's
        # mass before it always lies within 1e-5 of top_p); the first GPU run judged 10 of 16 draws at 8 rows
        unjudged = draws * sum(1 for i in range(n) if (i == 5 and n > 4) or i % 8 in (6, 7))
        assert checked >= 0.75 * (total - unjudged) and same == checked, (n, checked, same, total, unjudged)
    # the membership probes at 20,000 ids (5 chunks): a row of equal logits at 248,320 ids has a mass step of 4e-6,
    # under the helper's 1e-5 guard against cuts within rounding, so no top_p there is clear of every step
    n, bad = scope["top_p_membership"](20000, "cuda", seed=1)
    assert n >= 7 and not bad, bad
    assert sampler.check_top_p(248320, torch.device("cuda")) and not sampler._top_p_failed
