"""bench/h200.py's spec_mtp stage on the CPU (tiny checkpoint): it runs every row, the drafted rows verify their k
drafts a sequence, and the engine is left as it was."""

from __future__ import annotations

import types

import pytest

from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.spec import SpecConfig


@pytest.fixture(scope="module")
def h200(bench_script):
    return bench_script("h200.py", "h200_bench")


def test_spec_mtp_stage_times_every_row(h200, tiny_checkpoint, tiny_config, monkeypatch):
    monkeypatch.setattr(h200, "VOCAB_TEXT", tiny_config.vocab_size - 8)
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=8,
                                                                            spec=SpecConfig("mtp+ngram", 7)))
    res: dict = {}
    h200.stage_spec_mtp(types.SimpleNamespace(context=12), res, tiny_config, engine)
    rows = res["spec_mtp"]
    assert [(r["batch"], r["mtp_drafts"]) for r in rows] == [(b, k) for b in (1, 8) for k in (0, 1, 2, 3)]
    for r in rows:
        assert r["step"] > 0 and r["execute"] > 0 and r["forward"] > 0
        # every sequence verifies its k drafts (cost-aware speculation off); no MTP pass without drafting
        assert r["drafts"] == r["batch"] * r["mtp_drafts"]
        assert (r.get("mtp", 0.0) > 0) == (r["mtp_drafts"] > 0)
    # the engine as it was: drafting off, no request left, the runner's own methods again
    assert not engine.config.spec.enabled and not engine.has_unfinished_requests()
    assert "forward" not in vars(engine.runner) and "_mtp" not in vars(engine.runner)


def test_spec_mtp_stage_needs_the_mtp_head(h200, tiny_checkpoint, tiny_config):
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2))
    with pytest.raises(RuntimeError, match="MTP head"):
        h200.stage_spec_mtp(types.SimpleNamespace(context=12), {}, tiny_config, engine)
