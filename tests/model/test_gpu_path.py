"""The GPU path (Triton kernels, fused layers, CUDA graphs) against the HF oracle, on a GPU.

Model: the full model's shapes (hidden 2048, 256 experts, 16/2 attention heads of 256, 16/32 GDN heads of
128, the real vocabulary) cut to 4 layers (3 GDN + 1 attention) plus the MTP layer, written in the vendor
NVFP4 layout on the GPU. Every kernel runs at its real shapes.

Tolerance. The GPU path computes in bf16 (activations rounded to 8 significant bits after every op, fp32
accumulation inside kernels), the oracle in fp32 on the same dequantized weights. Each of the ~12 roundings
per layer adds ~2^-9 relative error, so over 4 layers we expect ~1% relative (Frobenius) error on the
logits; we assert <= 3% and that greedy tokens agree wherever the oracle's top-2 gap exceeds 10% of the
logits' standard deviation (a real bug moves logits by tens of percent).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import hf_model

from vibeqwen.model.prefill_graphs import min_bucket

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REL_FRO = 3e-2
TIE = 0.1
#: With EngineConfig.fp8_prefill "w8a8" a prompt's FP8 projections (3 per layer) read E4M3 activations: ~2.4%
#: rms relative rounding per value, so each of their outputs carries ~2.5% relative noise on top of the bf16
#: roundings. With residual_scale 0.05 the 4 layers' contributions are small: on the H200 the logits' error was
#: 5.3-5.4e-3 under W8A8 against 5.3-5.5e-3 under W8A16, so 2e-2 leaves the noise room and still catches a
#: plumbing error; greedy tokens may part at slightly larger gaps than bf16 rounding alone moves.
REL_FRO_W8A8 = 2e-2
TIE_W8A8 = 0.25


@pytest.fixture(scope="module")
def mini_checkpoint(tmp_path_factory):
    from vibeqwen.checkpoint.writer import write_checkpoint
    from vibeqwen.config import ModelConfig

    full = ModelConfig.named("full")
    cfg = dataclasses.replace(full, num_hidden_layers=4, layer_types=tuple(full.layer_types[:4]))
    path = tmp_path_factory.mktemp("mini") / "mini"
    # residual_scale 0.05: greedy output stable under bf16 rounding (bench/bf16_depth.py), so token-level
    # comparisons test the code, not the chaos of random weights
    return write_checkpoint(cfg, path, seed=0, device="cuda", residual_scale=0.05)


def _engine(path, **kw):
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine

    # no prefix caching unless a test asks: tests rerun prompts in one engine and compare the runs' logits, which a
    # cache hit would compute from another split of the prefill (test_prefix_cache_hits_match_full_prefill)
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048, gpu_memory_utilization=0.5,
               dtype="bfloat16", device="cuda", enable_prefix_caching=False)
    cfg.update(kw)
    return LLMEngine.from_checkpoint(path, config=EngineConfig(**cfg))


def _greedy_with_logits(engine, prompt, steps):
    rows = []
    orig = engine.runner.model.logits

    def capture(hidden):
        out = orig(hidden)
        if out.shape[0]:  # a prompt chunk before the last one samples nothing: no rows
            rows.append(out[-1].float().cpu())
        return out

    engine.runner.model.logits = capture
    from vibeqwen.sampling import SamplingParams

    toks = [t for t, _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))]
    engine.runner.model.logits = orig
    return toks, torch.stack(rows)


def _prompts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 248044, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("fp8_prefill", ["w8a16", "w8a8"])
def test_gpu_engine_matches_oracle(mini_checkpoint, fp8_prefill):
    """Prompts of 100 tokens (their FP8 projections take the many-row branch: W8A16 or W8A8 by fp8_prefill),
    12 greedy tokens each."""
    from vibeqwen.checkpoint.loader import load_checkpoint

    rel_max, tie = (REL_FRO, TIE) if fp8_prefill == "w8a16" else (REL_FRO_W8A8, TIE_W8A8)
    engine = _engine(mini_checkpoint, fp8_prefill=fp8_prefill)
    assert engine.runner.model.fast and engine.runner.graphs is not None
    ps = _prompts(3, 100, seed=5)
    ours = [_greedy_with_logits(engine, p, 12) for p in ps]
    del engine
    torch.cuda.empty_cache()
    oracle = hf_model(load_checkpoint(mini_checkpoint, device="cuda"), torch.float32, meta_init=True)
    for p, (toks, lg) in zip(ps, ours):
        with torch.no_grad():
            ref = oracle(torch.tensor([p + toks[:-1]], device="cuda")).logits[0, len(p) - 1 :].float().cpu()
        rel = ((lg - ref).norm() / ref.norm()).item()
        rel0 = ((lg[0] - ref[0]).norm() / ref[0].norm()).item()  # the prefill's own row
        print(f"fp8_prefill {fp8_prefill}: rel fro {rel:.2e}, prefill row {rel0:.2e}")
        assert rel <= rel_max, f"relative logit error {rel:.3e}"
        top2 = ref.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]) / ref.std()
        for i, t in enumerate(toks):
            if gap[i] > tie:
                assert ref[i].argmax().item() == t, f"token {i}: {t} vs oracle {ref[i].argmax().item()}"
            if ref[i].argmax().item() != t:
                break  # past a near-tie divergence the sequences differ; stop comparing


def test_w8a8_norm_quantization_matches_the_layers_own(mini_checkpoint, monkeypatch):
    """A W8A8 prompt pass (300 tokens) with the norm kernels quantizing their outputs for the FP8 projections,
    against the same pass with every FP8 layer quantizing its own input (quantize_rows_fp8). The codes are the
    same bit for bit (test_norm_fused), so the final hidden states agree up to the norms' rare one-ulp
    differences in the bf16 copy that feeds GDN's b | a; a plumbing error (another tensor's codes, a lost
    scale) moves them by percents."""
    from vibeqwen.model import gdn, qwen
    from vibeqwen.model.quant_linear import prompt_pass
    from vibeqwen.model.state import ForwardBatch

    engine = _engine(mini_checkpoint, cuda_graphs=False)
    model, cache = engine.runner.model, engine.runner.cache
    t = 300
    ids = torch.randint(0, 248044, (t,), generator=torch.Generator().manual_seed(2)).cuda()
    table = list(range(1000, 1000 + -(-t // cache.block_size)))

    def run():
        b = ForwardBatch(cache, [t], [0], [table], [1])
        with prompt_pass(True):
            return model.forward(ids, b.device_batch().positions, b).float()

    fused = run()
    monkeypatch.setattr(qwen, "w8a8_rows", lambda *a: False)
    monkeypatch.setattr(gdn, "w8a8_rows", lambda *a: False)
    own = run()
    rel = ((fused - own).norm() / own.norm()).item()
    print(f"fused vs per-layer quantization: rel {rel:.2e}")
    assert rel < 5e-3, rel  # 6.7e-4 on the H200


def _check_same_or_near_tie(reference, ref_logits, other):
    """`other` equals `reference` token for token, or first differs where the reference's logits have a
    near-tie (top-2 gap under TIE logit standard deviations): bf16 runs with different batch shapes round
    differently, and random weights give small top-2 gaps, so exact equality is not a property of the GPU
    path; a real bug (a wrong slot, a stale state) diverges at once and by a wide margin."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            lg = ref_logits[i]
            top2 = lg.topk(2).values
            gap = ((top2[0] - lg[b]) / lg.std()).item()
            assert gap < TIE, f"diverged at token {i} ({a} vs {b}) with a clear margin {gap:.3f} std"
            return i
    return None


def test_graphs_match_eager_and_batching(mini_checkpoint):
    from vibeqwen.sampling import SamplingParams

    ps = _prompts(5, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # W8A16 prompts: alone, a 40-token prompt's FP8 projections run the decode kernel, batched (200 rows) the
    # many-row branch, which with W8A8 would round the activations to E4M3 (tested against the oracle)
    eager = _engine(mini_checkpoint, cuda_graphs=False, fp8_prefill="w8a16")
    alone = [_greedy_with_logits(eager, p, 10) for p in ps]
    del eager
    torch.cuda.empty_cache()
    graphs = _engine(mini_checkpoint, fp8_prefill="w8a16")
    batched = graphs.generate_batch(ps, [params] * len(ps))
    diverged = [_check_same_or_near_tie(t, lg, b) for (t, lg), b in zip(alone, batched)]
    print("first divergence per prompt:", diverged)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_greedy_equals_plain(mini_checkpoint, method, monkeypatch):
    from vibeqwen.engine import llm_engine
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.sampling import SamplingParams

    if method == "ngram":
        # random weights rarely repeat themselves: propose drafts every step, some right (the continuation
        # plain decoding produced) and some wrong, so verification accepts, rejects and rolls back
        monkeypatch.setattr(llm_engine, "ngram_propose", lambda tokens, k, lo, hi: [tokens[-1], 7, 11][:k])
    ps = _prompts(4, 24, seed=11)
    plain_eng = _engine(mini_checkpoint)
    plain = [_greedy_with_logits(plain_eng, p, 24) for p in ps]
    del plain_eng
    torch.cuda.empty_cache()
    eng = _engine(mini_checkpoint, spec=SpecConfig(method, 3))
    assert 4 in eng.runner.verify_graphs  # k + 1 = 4 tokens per sequence
    spec = eng.generate_batch(ps, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(ps))
    assert eng.stats.spec_drafted_total > 0
    diverged = [_check_same_or_near_tie(t, lg, s) for (t, lg), s in zip(plain, spec)]
    print(f"{method}: drafted {eng.stats.spec_drafted_total} accepted {eng.stats.spec_accepted_total}; "
          f"first divergence per prompt: {diverged}")


def test_mtp_draft_graphs_draft_as_eager(mini_checkpoint, monkeypatch):
    """VIBEQWEN_MTP_GRAPHS=1: where the MTP layer's MoE runs the GPU kernels, its draft passes replay CUDA graphs (one
    per batch size) and draft exactly what eager drafting drafts (4 sequences: the graph of 4, no padding rows, the
    same kernels); with BF16 MTP experts (the vendors' layout, this checkpoint's) the engine drafts eagerly. The
    output is the same either way."""
    from vibeqwen.engine.runner import ModelRunner
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.sampling import SamplingParams

    drafted = []
    mtp = ModelRunner._mtp

    def recording(self, *args):
        out = mtp(self, *args)
        drafted.append(dict(out))
        return out

    monkeypatch.setattr(ModelRunner, "_mtp", recording)
    ps = _prompts(4, 24, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(ps)
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("VIBEQWEN_MTP_GRAPHS", switch)
        drafted.clear()
        eng = _engine(mini_checkpoint, spec=SpecConfig("mtp", 3, adaptive=False))
        assert (eng.runner.mtp_graphs is not None) == (switch == "1" and eng.model.mtp.layer.mlp.fast)
        runs[switch] = (eng.generate_batch(ps, params), list(drafted))
        del eng
        torch.cuda.empty_cache()
    assert runs["1"][1] and runs["1"][1] == runs["0"][1]
    assert runs["1"][0] == runs["0"][0]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_verification_logits_equal_decode_logits(mini_checkpoint, graphs, monkeypatch):
    """A perfect drafter (the plain run's own continuation): every verification row must score what the
    plain decode step scored at the same position (bf16 rounding apart), so nearly every draft is accepted
    and the output equals the plain output. Localises a verification bug: graphs vs eager, first row vs later
    rows (the printout gives the relative logit difference of each row)."""
    from vibeqwen.engine import llm_engine
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.sampling import SamplingParams

    ps = _prompts(2, 30, seed=21)
    plain_eng = _engine(mini_checkpoint, cuda_graphs=graphs)
    plain = [_greedy_with_logits(plain_eng, p, 16) for p in ps]
    del plain_eng
    torch.cuda.empty_cache()
    by_prompt = {tuple(p): toks for p, (toks, _) in zip(ps, plain)}

    def propose(tokens, k, lo, hi):
        for p, o in by_prompt.items():
            if tuple(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                return o[done : done + k]
        return []

    monkeypatch.setattr(llm_engine, "ngram_propose", propose)
    eng = _engine(mini_checkpoint, spec=SpecConfig("ngram", 3), cuda_graphs=graphs)
    assert (4 in eng.runner.verify_graphs) == graphs
    rows = []
    orig = eng.runner.model.logits

    def capture(hidden):
        out = orig(hidden)
        rows.append(out.float().cpu())
        return out

    eng.runner.model.logits = capture
    p, (ref_toks, ref_logits) = ps[0], plain[0]
    req = eng.add_request("v", p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    report = []
    while not req.finished:
        done = req.num_output_tokens
        rows.clear()
        eng.step()
        lg = rows[-1]  # [drafts + 1, V]: row j scores output position done + j
        for j in range(lg.shape[0]):
            if done + j < len(ref_toks):
                ref = ref_logits[done + j]
                report.append((done + j, j, ((lg[j] - ref).norm() / ref.norm()).item()))
    eng.runner.model.logits = orig
    print("graphs" if graphs else "eager", "(position, row in step, rel diff):",
          [(a, b, f"{c:.1e}") for a, b, c in report])
    st = eng.stats
    print(f"drafted {st.spec_drafted_total} accepted {st.spec_accepted_total}; output equal "
          f"{req.output_token_ids == ref_toks}")
    worst = max(c for _, _, c in report)
    assert worst <= REL_FRO, f"a verification row is {worst:.2e} off the decode step's logits"
    assert req.output_token_ids == ref_toks
    assert st.spec_accepted_total >= 0.8 * st.spec_drafted_total


def test_async_scheduling_equals_sync(mini_checkpoint):
    """Async scheduling on the GPU path (CUDA graphs, device-side sampling, tokens fed to the next step on
    the device) gives the synchronous engine's tokens. One engine, switched between runs. Batches are the
    same shapes step for step: requests that reach max_tokens are left out of the step launched ahead, and the
    requests stopping on a stop id arrive last, so the rows of the others and the graph size (8) stay as the
    synchronous engine has them (the stopped row runs once more, where the synchronous engine has padding)."""
    from vibeqwen.sampling import SamplingParams

    engine = _engine(mini_checkpoint)
    assert engine.async_scheduling  # auto: on with CUDA graphs
    ps = _prompts(7, 60, seed=21)

    def run(params, overlap):
        engine.async_scheduling = overlap
        ahead = engine.stats.async_steps_total
        out = engine.generate_batch(ps, params)
        while engine.has_unfinished_requests():
            engine.step()
        return out, engine.stats.async_steps_total - ahead

    kinds = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}]
    params = [SamplingParams(max_tokens=6 + 3 * i, seed=i, ignore_eos=True, **kinds[i % 2]) for i in range(7)]
    (sync, none), (over, ahead) = run(params, False), run(params, True)
    assert none == 0 and ahead > 0
    assert over == sync
    # the last two stop on a token of their own output, mid-batch, the last one first (no row moves)
    for i, at in ((6, 3), (5, 7)):
        params[i].stop_token_ids = [sync[i][at]]
    (sync2, _), (over2, ahead) = run(params, False), run(params, True)
    assert ahead > 0 and len(sync2[6]) <= 4 and len(sync2[5]) <= 8
    assert over2 == sync2


def test_early_launch_changes_no_logit(mini_checkpoint, monkeypatch):
    """Decode graphs captured with early launch (vibeqwen_kernels.pdl.early_launch: graphs of up to 32 tokens, the
    default) and without it (VIBEQWEN_PDL_EARLY=0) compute the same sums: early launch changes only when a kernel's
    CTAs start, and the FP8 / bf16 / router GEMMs read only constant weights before their wait. Logits of a batch-1
    greedy run bit for bit, and the tokens of a batch of 6 (an 8-row graph) with sampling."""
    from vibeqwen.sampling import SamplingParams

    ps = _prompts(6, 50, seed=33)
    params = [SamplingParams(max_tokens=10, seed=i, ignore_eos=True, temperature=0.7 if i % 2 else 0)
              for i in range(len(ps))]
    runs = []
    for early in ("1", "0"):
        monkeypatch.setenv("VIBEQWEN_PDL_EARLY", early)
        engine = _engine(mini_checkpoint)
        one = _greedy_with_logits(engine, ps[0], 12)
        runs.append((one, engine.generate_batch(ps, params)))
        del engine
        torch.cuda.empty_cache()
    ((toks_e, logits_e), batch_e), ((toks_n, logits_n), batch_n) = runs
    assert toks_e == toks_n and torch.equal(logits_e, logits_n)
    assert batch_e == batch_n


def _count_rows(monkeypatch, module, name: str) -> list[int]:
    """Wraps module.name (a kernel call taking x first) so that each call appends x's row count to the returned
    list (graph captures included: Python runs then)."""
    fn = getattr(module, name)
    calls = []

    def counted(x, *a, **kw):
        calls.append(x.shape[0])
        return fn(x, *a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_decode_conv_epilogue_and_side_stream_change_no_logit(mini_checkpoint, monkeypatch):
    """A decode step's GDN input projection with the conv1d in the FP8 GEMM's epilogue and b|a on a side stream
    (GatedDeltaNet._decode_projection, the default) against the separate conv launch on one stream
    (VIBEQWEN_FP8_CONV=0, VIBEQWEN_SIDE_STREAM=0): the same bits. Logits of a batch-1 greedy run through the
    decode graphs, the tokens of a batch of 6 (an 8-row graph: two padding rows on the scratch slot) with
    sampling, and an eager run (graphs off) of the batch-1 prompt."""
    from vibeqwen_kernels.fp8 import mma as FM

    from vibeqwen.sampling import SamplingParams

    calls = _count_rows(monkeypatch, FM, "fp8_linear_mma_conv")
    ps = _prompts(6, 50, seed=34)
    params = [SamplingParams(max_tokens=10, seed=i, ignore_eos=True, temperature=0.7 if i % 2 else 0)
              for i in range(len(ps))]
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("VIBEQWEN_FP8_CONV", on)
        monkeypatch.setenv("VIBEQWEN_SIDE_STREAM", on)
        engine = _engine(mini_checkpoint)
        one = _greedy_with_logits(engine, ps[0], 12)
        runs.append((one, engine.generate_batch(ps, params)))
        del engine
        eager = _engine(mini_checkpoint, cuda_graphs=False)
        runs[-1] += (_greedy_with_logits(eager, ps[0], 6),)
        del eager
        torch.cuda.empty_cache()
        if on == "1":  # the fused path ran: graph captures (1- and 8-row graphs among them) and eager decode steps
            assert {1, 8} <= set(calls)
            calls.clear()
    assert not calls  # VIBEQWEN_FP8_CONV=0: never
    ((toks_f, logits_f), batch_f, (etoks_f, elogits_f)), ((toks_s, logits_s), batch_s, (etoks_s, elogits_s)) = runs
    assert toks_f == toks_s and torch.equal(logits_f, logits_s)
    assert batch_f == batch_s
    assert etoks_f == etoks_s and torch.equal(elogits_f, elogits_s)


def _switch_matches(mini_checkpoint, monkeypatch, env: str, module, name: str, seed: int) -> None:
    """A fused path (module.name, taking rows first) on (env=1) against off (env=0): it runs in the 1- and 8-row
    decode graphs, and nowhere when off; greedy logits agree up to fp32 summation order (rows compared while the
    tokens agree), and so do the tokens of a batch of 6."""
    from vibeqwen.sampling import SamplingParams

    calls = _count_rows(monkeypatch, module, name)
    ps = _prompts(6, 50, seed=seed)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0) for _ in ps]
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv(env, on)
        engine = _engine(mini_checkpoint)
        runs.append((_greedy_with_logits(engine, ps[0], 12), engine.generate_batch(ps, params)))
        del engine
        torch.cuda.empty_cache()
        if on == "1":
            assert {1, 8} <= set(calls), calls
            calls.clear()
    assert not calls
    ((toks_f, logits_f), batch_f), ((toks_s, logits_s), batch_s) = runs
    same = next((i for i, (a, b) in enumerate(zip(toks_f, toks_s)) if a != b), len(toks_f))
    assert same >= 4  # a flip of a near tie may come late, not at once
    for a, b in zip(logits_f[: same + 1], logits_s[: same + 1]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    agree = sum(x == y for fa, fb in zip(batch_f, batch_s) for x, y in zip(fa, fb))
    assert agree >= 0.8 * sum(len(f) for f in batch_f)


def test_fused_post_norm_matches_the_separate_launches(mini_checkpoint, monkeypatch):
    """The post-attention RMSNorm fused into the output projection's K-split reduce (FP8Linear.add_rms_norm, the
    default) against its own launch (VIBEQWEN_FUSED_POST_NORM=0), as `_switch_matches` checks."""
    from vibeqwen_kernels.fp8 import mma as FM

    _switch_matches(mini_checkpoint, monkeypatch, "VIBEQWEN_FUSED_POST_NORM", FM, "fp8_linear_mma_add_rms_norm", 35)


def test_fused_decode_attention_matches_the_separate_launches(mini_checkpoint, monkeypatch):
    """The q/k norm + RoPE + KV store inside the split-KV attention kernel (fused_decode_attention, for decode-sized
    batches with VIBEQWEN_FUSED_ATTENTION=1) against qk_norm_rope_store + paged_attention (=0), as `_switch_matches`
    checks (the split merge's fp32 order)."""
    from vibeqwen_kernels.attention import decode_fused as DF

    _switch_matches(mini_checkpoint, monkeypatch, "VIBEQWEN_FUSED_ATTENTION", DF, "fused_decode_attention", 36)


# ---- whole-chunk prefill graphs (EngineConfig.prefill_graphs, vibeqwen.model.prefill_graphs) ----

#: bf16 tolerance of graph vs eager prefill: the same math, but the graph's GEMMs run on B rows (other cuBLAS
#: algorithms; chunks of <= 64 tokens take the FP8 streaming kernel eagerly) and fla sees padded inputs, so the
#: two round differently: a few 2^-9 roundings per layer over 4 layers, ~1e-2 at most.
PREFILL_REL = 2e-2


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def test_prefill_graphs_match_eager_and_touch_nothing_else(mini_checkpoint):
    """One engine with prefill graphs; its runner's cache driven directly. Sequence G takes each chunk through
    ModelRunner.forward (a graph replay), sequence E takes the same tokens through the eager model; T = 17,
    100, 128, 129, 1000 (buckets 128, 128, 128, 256, 1024), each as a first chunk and again as a second chunk
    (context T), then T = 200 (bucket 256 replayed after T = 129), then short chunks: T = 5 first and second, 16
    and 1 (a decode graph takes a lone one-token step first). Hidden states, the last row's logits, the
    chunk's K/V and GDN state agree within bf16 tolerance and the greedy token agrees (or is a near-tie).
    A third sequence's K/V blocks and GDN slot, prefilled before, stay bit-identical, as do the blocks next
    to the scratch block and the slot below the scratch slot (padding writes only the scratch block / slot)."""
    from vibeqwen.model.quant_linear import prompt_pass
    from vibeqwen.model.state import ForwardBatch

    # W8A16: a graph runs B >= 128 rows, an eager chunk of <= 64 tokens the FP8 decode kernel, and with W8A8
    # the graph's FP8 projections would round their activations to E4M3 where the eager ones do not
    # (test_prefill_graphs_greedy_equals_eager runs the engine's default)
    engine = _engine(mini_checkpoint, prefill_graphs=True, fp8_prefill="w8a16")
    runner = engine.runner
    pg = runner.prefill_graphs
    # the default smallest bucket (16), or VIBEQWEN_PREFILL_MIN_BUCKET's
    assert pg is not None and pg.sizes == [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048) if b >= min_bucket()]
    model, cache = runner.model, runner.cache
    bs = cache.block_size
    attn = model.cfg.attention_layers[0]
    seq = {"G": (1, list(range(1000, 1130))), "E": (2, list(range(2000, 2130))), "C": (3, list(range(3000, 3010)))}
    lens = {name: 0 for name in seq}

    def batch(name, n):
        slot, table = seq[name]
        return ForwardBatch(cache, [n], [lens[name]], [table[: -(-(lens[name] + n) // bs)]], [slot])

    def eager(name, ids):  # the FP8 layers as in the runner's prompt passes (EngineConfig.fp8_prefill)
        b = batch(name, len(ids))
        with prompt_pass(runner.fp8_prefill_w8a8):
            return model.forward(ids, b.device_batch().positions, b)

    g = torch.Generator().manual_seed(4)
    eager("C", torch.randint(0, 248044, (150,), generator=g).cuda())
    lens["C"] = 150
    c_blocks = seq["C"][1]
    below = cache.scratch_block - 1

    def snap():
        return (cache.k[attn][c_blocks].clone(), cache.v[attn][c_blocks].clone(), cache.k[attn][below].clone(),
                cache.conv_stacked[:, [3, cache.scratch_slot - 1]].clone(),
                cache.ssm_stacked[:, [3, cache.scratch_slot - 1]].clone())

    def kv_rows(name, lo, hi):  # K of positions [lo, hi) of a sequence, [hi - lo, Hkv, D]
        flat = torch.tensor([seq[name][1][p // bs] * bs + p % bs for p in range(lo, hi)], device="cuda")
        return cache.k[attn].flatten(0, 1)[flat]

    before = snap()
    report = []
    for t, fresh in [(17, True), (17, False), (100, True), (100, False), (128, True), (128, False),
                     (129, True), (129, False), (1000, True), (1000, False), (200, True), (5, True), (5, False),
                     (16, False), (1, False)]:
        if fresh:
            lens["G"] = lens["E"] = 0
        ids = torch.randint(0, 248044, (t,), generator=g).cuda()
        bg = batch("G", t)
        assert pg.can_run(bg)
        hg = runner.forward(ids, bg).clone()
        assert runner.last_graphed
        he = eager("E", ids)
        lg, le = model.logits(hg[-1:])[0], model.logits(he[-1:])[0]
        rel_h, rel_l = _rel(hg, he), _rel(lg, le)
        top2 = le.topk(2).values
        gap = ((top2[0] - le[lg.argmax()]) / le.std()).item()
        lo, hi = lens["G"], lens["G"] + t
        rel_k = _rel(kv_rows("G", lo, hi), kv_rows("E", lo, hi))
        rel_ssm = _rel(cache.ssm_stacked[:, 1], cache.ssm_stacked[:, 2])
        rel_conv = _rel(cache.conv_stacked[:, 1], cache.conv_stacked[:, 2])
        report.append((t, not fresh, f"{rel_h:.1e}", f"{rel_l:.1e}", f"{rel_k:.1e}", f"{rel_ssm:.1e}"))
        assert max(rel_h, rel_l, rel_k, rel_ssm, rel_conv) <= PREFILL_REL, report[-1]
        assert lg.argmax() == le.argmax() or gap < TIE, (t, gap)
        lens["G"] = lens["E"] = hi
    print("T, second chunk, rel hidden / logits / K / GDN state:", report)
    after = snap()
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "padding wrote outside the scratch block/slot"
    # a batch of two sequences stays eager
    two = ForwardBatch(cache, [20, 1], [0, lens["C"]], [seq["G"][1][:2], c_blocks], [1, 3])
    assert not pg.can_run(two)


def test_prefill_graphs_greedy_equals_eager(mini_checkpoint):
    """The engine with prefill graphs against the eager engine, greedy: prompts of 17, 100, 129 and 1000
    tokens, max_num_batched_tokens 256 (so the 1000-token prompt is four chunks, the last three with a
    context). Every prompt chunk replays a graph; the continuations agree token for token or first part at
    a near-tie (bf16 rounding differs between the two)."""
    prompts = [p for n, s in ((17, 1), (100, 2), (129, 3), (1000, 4)) for p in _prompts(1, n, seed=30 + s)]
    eager = _engine(mini_checkpoint, max_num_batched_tokens=256, prefill_graphs=False)
    assert eager.runner.prefill_graphs is None
    ref = [_greedy_with_logits(eager, p, 8) for p in prompts]
    del eager
    torch.cuda.empty_cache()
    eng = _engine(mini_checkpoint, max_num_batched_tokens=256, prefill_graphs=True)
    pg = eng.runner.prefill_graphs
    assert pg is not None and pg.sizes == [b for b in (16, 32, 64, 128, 256) if b >= min_bucket()]
    calls = []
    run = pg.run

    def counted(input_ids, batch):
        calls.append((batch.query_lens[0], batch.context_lens[0]))
        return run(input_ids, batch)

    pg.run = counted
    ours = [_greedy_with_logits(eng, p, 8) for p in prompts]
    assert calls == [(17, 0), (100, 0), (129, 0), (256, 0), (256, 256), (256, 512), (232, 768)], calls
    diverged = [_check_same_or_near_tie(t, lg, o) for (t, lg), (o, _) in zip(ref, ours)]
    rel = [_rel(lg[0], o[0]) for (_, lg), (_, o) in zip(ref, ours)]  # the prefill's own logits
    print("first divergence per prompt:", diverged, "rel logits of the prefill row:", [f"{r:.1e}" for r in rel])
    assert max(rel) <= PREFILL_REL



def test_mixed_steps_replay_graphs_per_piece(mini_checkpoint):
    """A step that no one graph fits (ModelRunner._graph_pieces): two decoding sequences next to two prompt chunks
    replays the decode graph once and a prefill graph per chunk, against the same step as one eager pass on copies
    of the sequences; then a second such step (the chunks' second halves, with context) reads what the first wrote.
    Hidden states agree within the prefill tolerance, the sampled rows' greedy tokens agree or part at a near-tie."""
    from vibeqwen.engine.runner import MIXED_GRAPH_MAX_CHUNKS
    from vibeqwen.model.quant_linear import prompt_pass
    from vibeqwen.model.state import ForwardBatch

    assert MIXED_GRAPH_MAX_CHUNKS >= 2
    engine = _engine(mini_checkpoint, prefill_graphs=True, fp8_prefill="w8a16")
    runner = engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None
    model, cache = runner.model, runner.cache
    bs = cache.block_size
    names = ["a", "b", "c", "d"]  # a, b decode; c, d are prompts of 40 and 12 tokens, two chunks each
    copies = {"G": {n: (1 + i, list(range(1000 + 40 * i, 1040 + 40 * i))) for i, n in enumerate(names)},
              "E": {n: (5 + i, list(range(2000 + 40 * i, 2040 + 40 * i))) for i, n in enumerate(names)}}
    lens = {"G": dict.fromkeys(names, 0), "E": dict.fromkeys(names, 0)}

    def batch(copy, qlens):
        seqs = [(n, q) for n, q in zip(names, qlens) if q]
        return ForwardBatch(cache, [q for _, q in seqs], [lens[copy][n] for n, _ in seqs],
                            [copies[copy][n][1][: -(-(lens[copy][n] + q) // bs)] for n, q in seqs],
                            [copies[copy][n][0] for n, _ in seqs])

    def eager(copy, ids, qlens):
        b = batch(copy, qlens)
        with prompt_pass(runner.fp8_prefill_w8a8):
            return model.forward(ids, b.device_batch().positions, b)

    g = torch.Generator().manual_seed(6)
    for n, length in (("a", 50), ("b", 70)):  # the decoding sequences' prompts, eagerly in both copies
        ids = torch.randint(0, 248044, (length,), generator=g).cuda()
        qlens = [length if m == n else 0 for m in names]
        for copy in ("G", "E"):
            eager(copy, ids, qlens)
            lens[copy][n] = length
    calls = {"decode": [], "prefill": []}
    for graphs, key in ((runner.graphs, "decode"), (runner.prefill_graphs, "prefill")):
        def counted(input_ids, b, _run=graphs.run, _key=key):
            calls[_key].append(list(b.query_lens))
            return _run(input_ids, b)
        graphs.run = counted
    report = []
    for step, qlens in enumerate(([1, 1, 20, 6], [1, 1, 20, 6])):
        ids = torch.randint(0, 248044, (sum(qlens),), generator=g).cuda()
        before = {k: len(v) for k, v in calls.items()}
        hg = runner.forward(ids, batch("G", qlens)).clone()
        assert runner.last_graphed
        assert calls["decode"][before["decode"]:] == [[1, 1]], calls
        assert calls["prefill"][before["prefill"]:] == [[20], [6]], calls
        he = eager("E", ids, qlens)
        ends = [sum(qlens[: i + 1]) - 1 for i in range(len(qlens))]  # each sequence's last row: the sampled one
        lg, le = model.logits(hg[ends]), model.logits(he[ends])
        rel_h, rel_l = _rel(hg, he), _rel(lg, le)
        report.append((step, f"{rel_h:.1e}", f"{rel_l:.1e}"))
        assert max(rel_h, rel_l) <= PREFILL_REL, report
        for i in range(len(ends)):
            top2 = le[i].topk(2).values
            gap = ((top2[0] - le[i][lg[i].argmax()]) / le[i].std()).item()
            assert lg[i].argmax() == le[i].argmax() or gap < TIE, (step, i, gap)
        for copy in ("G", "E"):
            for n, q in zip(names, qlens):
                lens[copy][n] += q
    print("step, rel hidden / logits of the sampled rows:", report)


def test_prefix_cache_hits_match_full_prefill(mini_checkpoint):
    """Prefix caching on the GPU path (graphs on): a conversation's later turns and users of a shared system prompt
    start on cached prefixes (shared KV blocks, a copied partial block, a GDN state copied between slots), against
    an engine that prefills every prompt whole. The first token's logits agree within the prefill tolerance (the
    cached prefix was computed in other chunks, so bf16 rounding moves; a stale state or block would be far off)
    and the continuations agree or part at a near-tie."""
    off = _engine(mini_checkpoint)
    prompts, history = [], _prompts(1, 300, seed=50)[0]
    for turn in range(3):  # each turn extends the last prompt and its reply
        prompts.append(history)
        history = history + _greedy_with_logits(off, history, 8)[0] + _prompts(1, 20, seed=60 + turn)[0]
    system = _prompts(1, 150, seed=51)[0]
    prompts += [system + q for q in _prompts(3, 9, seed=52)]  # the second user leaves a branch-point snapshot
    ref = [_greedy_with_logits(off, p, 8) for p in prompts]
    del off
    torch.cuda.empty_cache()
    on = _engine(mini_checkpoint, enable_prefix_caching=True)
    assert on.cache_manager.prefix is not None
    ours, hits = [], []
    for p in prompts:
        before = on.stats.prefix_cache_hits_total
        ours.append(_greedy_with_logits(on, p, 8))
        hits.append(on.stats.prefix_cache_hits_total - before)
    diverged = [_check_same_or_near_tie(t, lg, o) for (t, lg), (o, _) in zip(ref, ours)]
    rel = [_rel(lg[0], o[0]) for (_, lg), (_, o) in zip(ref, ours)]
    print("hit tokens", hits, "first divergence:", diverged, "rel logits of the prefill row:",
          [f"{r:.1e}" for r in rel])
    assert hits[0] == hits[3] == hits[4] == 0 and hits[1] >= 300 and hits[2] >= 300 and hits[5] == 144
    assert max(rel) <= PREFILL_REL
