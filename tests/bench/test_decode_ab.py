"""bench/decode_ab.py on the CPU: how a variant's name becomes named variants and environment switches."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ab(bench_script):
    return bench_script("decode_ab.py", "decode_ab")


@pytest.mark.parametrize("name,named,env", [
    ("on", {"on"}, {}),
    ("no_early+VIBEQWEN_ROUTE_WIDE=0", {"no_early"}, {"VIBEQWEN_ROUTE_WIDE": "0"}),
    ("VIBEQWEN_A=1+VIBEQWEN_B=x=y", set(), {"VIBEQWEN_A": "1", "VIBEQWEN_B": "x=y"}),
    # a value holding "+": the parts that are neither variants nor NAME=VALUE continue it
    ("VIBEQWEN_X=in+moe:0.5", set(), {"VIBEQWEN_X": "in+moe:0.5"}),
    ("VIBEQWEN_X=in+moe:0.5+out+none", {"none"}, {"VIBEQWEN_X": "in+moe:0.5+out"}),
    ("VIBEQWEN_X=a+b=c", set(), {"VIBEQWEN_X": "a+b=c"}),  # "b" is no switch name: part of the value
    ("VIBEQWEN_X=", set(), {"VIBEQWEN_X": ""}),
])
def test_parse_variant(ab, name, named, env):
    got_named, got_env = ab.parse_variant(name)
    assert got_named == named
    assert got_env == env


@pytest.mark.parametrize("name", ["bogus", "on+bogus", "VIBEQWEN_X=1++on", "", "on+", "+on"])
def test_parse_variant_rejects(ab, name):
    with pytest.raises(ValueError, match="unknown variant part"):
        ab.parse_variant(name)


def test_apply_sets_and_restores_the_environment(ab, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("VIBEQWEN_AB_TEST_B", "before")
    monkeypatch.delenv("VIBEQWEN_AB_TEST_A", raising=False)
    import os

    ab.apply("VIBEQWEN_AB_TEST_A=in+moe+VIBEQWEN_AB_TEST_B=2")
    assert os.environ["VIBEQWEN_AB_TEST_A"] == "in+moe"
    assert os.environ["VIBEQWEN_AB_TEST_B"] == "2"
    ab.apply("on")
    assert "VIBEQWEN_AB_TEST_A" not in os.environ
    assert os.environ["VIBEQWEN_AB_TEST_B"] == "before"
    with pytest.raises(SystemExit, match="unknown variant part"):
        ab.apply("nope")
