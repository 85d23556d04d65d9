"""Programmatic dependent launch (`vibeqwen_kernels.pdl`): the launch switch, and the source-level contract that
makes it safe. A kernel launched with PDL may start before the previous kernel finished, so every kernel that
can be launched with it must wait first; a kernel that forgot would race with its producer. The contract is
checked here on the source: every Triton kernel launched in the package takes `PDL` and calls `pdl_wait(PDL)`
as its first statement (the GDN recurrent kernel: first unless launched for early launch, where it reads only its
state slice and the host-written metadata before the wait: `EARLY_READERS`), every launch passes
`**pdl_launch(...)`, and every CUDA kernel waits first thing (the FP8, bf16 and router GEMMs: first thing unless
launched for early launch, where only constant weights are read before the wait)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from vibeqwen_kernels import pdl

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def _launches() -> list[tuple[str, ast.Call]]:
    """Every `name[grid](...)` call in the package whose name ends in 'kernel'."""
    out = []
    for path in KERNELS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                f = node.func.value
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name.endswith("kernel"):
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno} {name}", node))
    return out


def _jit_kernels() -> dict[str, ast.FunctionDef]:
    out = {}
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                out[node.name] = node
    return out


def test_every_launch_passes_pdl_launch():
    launches = _launches()
    assert len(launches) >= 25, "the scan found too few launches"
    missing = [
        where
        for where, call in launches
        if not any(k.arg is None and "pdl_launch" in ast.unparse(k.value) for k in call.keywords)
    ]
    assert not missing, f"launches without **pdl_launch(...): {missing}"


#: Triton kernels that, under early launch only (PDL 2, a constexpr switch), read something before their wait: the
#: inputs they may touch there (what the kernel ahead never writes), and the ones they must not
EARLY_READERS = {
    # the GDN recurrent kernel's state slice and the host-written metadata (kernels/gdn/_recurrent_kernels.py)
    "gdn_recurrent_kernel": ({"state_ptr", "slots_ptr", "qsl_ptr", "init_ptr"},
                             {"q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "o_ptr", "inter_ptr"}),
}
EARLY_WAIT = "if not (EARLY_STATE and PDL == 2):\n    pdl_wait(PDL)"


def _names(stmts) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name)}


def test_every_launched_kernel_waits_first():
    kernels = _jit_kernels()
    names = {where.split()[-1] for where, _ in _launches()}
    assert set(EARLY_READERS) <= names
    bad = []
    for name in sorted(names):
        fn = kernels[name]
        params = [a.arg for a in fn.args.args]
        body = fn.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        if name in EARLY_READERS:
            # waits first unless early launch; then the statements up to the early branch's wait read only what
            # the kernel ahead never writes
            allowed, forbidden = EARLY_READERS[name]
            branch = next((i for i, st in enumerate(body) if isinstance(st, ast.If)
                           and ast.unparse(st.test) == "EARLY_STATE and PDL == 2"), None)
            waits = branch is not None and any(ast.unparse(st) == "pdl_wait(PDL)" for st in body[branch].body)
            before = body[:branch] + body[branch].body if waits else body
            touched = _names(before) & (allowed | forbidden)
            if first != EARLY_WAIT or not waits or touched & forbidden or not touched & allowed:
                bad.append(f"{name}: first statement {first!r}, early wait found {waits}, reads before it "
                           f"{sorted(touched)}")
        elif "PDL" not in params or first != "pdl_wait(PDL)":
            bad.append(f"{name}: params end {params[-2:]}, first statement {first!r}")
    assert not bad, "kernels that do not wait first: " + "; ".join(bad)


@pytest.mark.parametrize("source,min_kernels", [("moe_mma.cu", 4), ("fp8_mma.cu", 1), ("bf16_mma.cu", 2)])
def test_cuda_kernels_wait_first(source, min_kernels):
    from vibeqwen_kernels.cuda_build import _read_source

    src = _read_source(source.removesuffix(".cu")).decode()  # as nvcc gets it: csrc/*.cuh inlined
    starts = [m.end() for m in re.finditer(r"__global__[^{]*\{", src)]
    assert len(starts) >= min_kernels
    for start in starts:
        if source in ("fp8_mma.cu", "bf16_mma.cu"):
            # with early launch (pdl 2) these kernels request their constant weights first: nothing before that
            # wait may touch x, out, the partials, the scales or the router's outputs, which the previous kernels
            # write or read; in the other modes they wait before anything
            late = src.index("if (pdl == 2) pdl_wait(pdl);", start)
            head = src[start:late]
            assert "__global__" not in head
            first = src.index("if (pdl != 2) pdl_wait(pdl);", start)
            assert first < late and "load_stream" not in src[start:first] and "first_steps" not in src[start:first]
            used = set(re.findall(r"(?<![.\w])[A-Za-z_]\w*", re.sub(r'//[^\n]*|"[^"]*"', "", head)))
            assert not used & {"x", "x_stride", "out", "ws", "scale", "stage_piece", "logits", "counter", "dbg",
                               "topk_w", "topk_ids", "sorted_ids", "block_expert", "tile_partials"}, head
        else:
            head = src[start:src.index("pdl_wait(pdl);", start)]
            assert head.strip() == "", head
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src


def test_gdn_decode_reads_only_its_state_before_the_wait():
    """csrc/gdn_decode.cu waits first unless launched for early launch; then, up to its early wait, it reads only its
    first state slice and the host-written metadata (`Unit::fetch_state`): never q, k, v, a, b, o or the counter,
    which the kernel ahead may write or the previous launch may still reset."""
    from vibeqwen_kernels.cuda_build import _read_source

    src = re.sub(r"//[^\n]*", "", _read_source("gdn_decode").decode())
    starts = [m.end() for m in re.finditer(r"__global__[^{]*\{", src)]
    assert len(starts) == 1
    body = src[starts[0]:]
    first, early = body.index("if (!early) pdl_wait(p.pdl);"), body.index("if (early) pdl_wait(p.pdl);")
    assert first < early
    head = body[:early]
    assert "fetch_state(" in head[first:]
    forbidden = re.compile(r"\b(fetch_inputs|counter|atomicAdd|p\.[qkvabo])\b")
    assert not forbidden.search(head), head
    fetch = src[src.index("void fetch_state("):src.index("void fetch_inputs(")]
    assert not forbidden.search(fetch), fetch
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src


def test_pdl_launch_switch(monkeypatch):
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("VIBEQWEN_PDL", "0")
    pdl.pdl_enabled.cache_clear()
    try:
        assert pdl.pdl_enabled(torch.device("cuda", 0)) is False
    finally:
        pdl.pdl_enabled.cache_clear()


def test_package_imports_without_triton():
    """The PyTorch reference path runs where Triton is not installed: the launch switch must not import it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import vibeqwen_kernels, vibeqwen_kernels.pdl, vibeqwen.model.qwen, vibeqwen.engine.llm_engine\n"
        "from vibeqwen_kernels.moe import mma_cuda\n"
        "from vibeqwen_kernels.fp8 import mma\n"
        "from vibeqwen_kernels import bf16_mma\n"
        "from vibeqwen_kernels.moe import route_cuda\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_by_default_on_hopper():
    dev = torch.device("cuda")
    want = torch.cuda.get_device_capability(dev)[0] >= 9
    assert pdl.pdl_launch(dev) == ({"PDL": 1, "launch_pdl": True} if want else {"PDL": False})
    assert pdl.pdl_mode(dev) == (1 if want else 0)
    with pdl.early_launch():
        assert pdl.pdl_mode(dev) == (2 if want else 0)
        with pdl.early_launch(False):
            assert pdl.pdl_mode(dev) == (1 if want else 0)
        assert pdl.pdl_launch(dev) == ({"PDL": 2, "launch_pdl": True} if want else {"PDL": False})
    assert pdl.pdl_mode(dev) == (1 if want else 0)


def test_early_launch_context(monkeypatch):
    """early_launch switches pdl_mode to 2 where PDL is on and restores it; VIBEQWEN_PDL_EARLY=0 keeps 1."""
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    dev = torch.device("cuda", 0)
    assert pdl.pdl_mode(dev) == 1
    with pdl.early_launch():
        assert pdl.pdl_mode(dev) == 2 and pdl.pdl_launch(dev) == {"PDL": 2, "launch_pdl": True}
    assert pdl.pdl_mode(dev) == 1
    monkeypatch.setenv("VIBEQWEN_PDL_EARLY", "0")
    with pdl.early_launch():
        assert pdl.pdl_mode(dev) == 1
    try:
        with pdl.early_launch():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert pdl.pdl_mode(dev) == 1
