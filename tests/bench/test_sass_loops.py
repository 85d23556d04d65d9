"""bench/kernels/sass_loops.py on the CPU: reading loops out of cuobjdump's SASS text (no nvcc needed)."""

from __future__ import annotations

import pytest

SASS = """
\tcode for sm_90a
\t\tFunction : _ZN43_GLOBAL__N__ddb5acc0_10_moe_mma_cu_729816f014moe_mlp_kernelILi2ELi8ELb0ELb1ELi1ELb0EEEvPK13__nv_bfloat16ii
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                         /* 0x00000a00ff017b82 */
                                                                                  /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                             /* 0x0000000000007919 */
        /*0020*/                   DEPBAR.LE SB0, 0x1 ;                           /* 0x0000000000007919 */
        /*0030*/                   LDS.128 R12, [R2+UR5] ;                        /* 0x0000000000007919 */
        /*0040*/                   LOP3.LUT R4, R12, 0x81c081c0, RZ, 0xc0, !PT ;  /* 0x0000000000007919 */
        /*0050*/                   HMUL2.BF16_V2 R4, R4, R5.H0_H0 ;              /* 0x0000000000007919 */
        /*0060*/                   HMMA.16816.F32.BF16 R20, R4, R8, R20 ;         /* 0x0000000000007919 */
        /*0070*/              @!PT LDS RZ, [RZ] ;                                 /* 0x0000000000007919 */
        /*0080*/                   LDGSTS.E.BYPASS.128 [R49+0x8100], desc[UR10][R64.64] ;  /* 0x0 */
        /*0090*/               @P3 BRA 0x20 ;                                     /* 0x0000000000007919 */
        /*00a0*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;              /* 0x0000000000007919 */
        /*00b0*/               @P0 BRA 0xd0 ;                                     /* 0x0000000000007919 */
        /*00c0*/                   STL [R1], R4 ;                                 /* 0x0000000000007919 */
        /*00d0*/                   BRA 0xa0 ;                                     /* 0x0000000000007919 */
        /*00e0*/                   BRA 0x400 ;                                    /* 0x0000000000007919 */
        /*00f0*/                   EXIT ;                                         /* 0x0000000000007919 */
\t\t..........

\t\tFunction : plain_kernel
        /*0000*/                   NOP ;                                          /* 0x0000000000007919 */
        /*0010*/                   EXIT ;                                         /* 0x0000000000007919 */
"""

RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _ZN3abc6kernelEPf:
  REG:78 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function plain_kernel:
  REG:16 STACK:0 SHARED:0 LOCAL:0
"""


@pytest.fixture(scope="module")
def sl(bench_script):
    return bench_script("kernels/sass_loops.py", "sass_loops")


def test_parse_sass_splits_kernels_and_skips_encoding_lines(sl):
    kernels = sl.parse_sass(SASS)
    assert list(kernels) == [
        "_ZN43_GLOBAL__N__ddb5acc0_10_moe_mma_cu_729816f014moe_mlp_kernelILi2ELi8ELb0ELb1ELi1ELb0EEEvPK13__nv_bfloat16ii",
        "plain_kernel"]
    first = next(iter(kernels.values()))
    assert [a for a, _ in first] == list(range(0, 0x100, 0x10))  # the encoding-only lines are not instructions
    assert first[6] == (0x60, "HMMA.16816.F32.BF16 R20, R4, R8, R20")
    assert kernels["plain_kernel"] == [(0, "NOP"), (0x10, "EXIT")]


@pytest.mark.parametrize("text,want", [
    ("HMMA.16816.F32.BF16 R20, R4, R8, R20", "HMMA"), ("@!PT LDS RZ, [RZ]", "LDS"), ("@P3 BRA 0x20", "BRA"),
    ("EXIT", "EXIT"), ("", "")])
def test_opcode(sl, text, want):
    assert sl.opcode(text) == want


def test_loops_are_backward_branches_with_their_bodies(sl):
    insns = next(iter(sl.parse_sass(SASS).values()))
    found = sl.loops(insns)
    # 0x90 -> 0x20 (the streaming loop) and 0xd0 -> 0xa0; the forward branches (0xb0, 0xe0: past the end) are not
    assert [(lp["start"], lp["end"], lp["instructions"]) for lp in found] == [("0x20", "0x90", 8), ("0xa0", "0xd0", 4)]
    ops = found[0]["ops"]
    assert (ops["HMMA"], ops["LDS"], ops["LDGSTS"], ops["HMUL2"], ops["LOP3"], ops["STL"]) == (1, 2, 1, 1, 1, 0)
    assert found[1]["ops"]["STL"] == 1 and found[1]["ops"]["HMMA"] == 0
    assert set(ops) == set(sl.OPS)


@pytest.mark.parametrize("branch", ["BRA 0x10", "@P3 BRA 0x10", "BRA.U !UP0, 0x10", "@P0 BRA.DIV UR4, 0x10",
                                    "@!P1 BRA P2, 0x10", "BRA `(.L_x_3) 0x10"])
def test_every_branch_form_closes_a_loop(sl, branch):
    (lp,) = sl.loops([(0x10, "HMMA.16816.F32.BF16 R0, R4, R8, R0"), (0x20, branch)])
    assert (lp["start"], lp["end"], lp["instructions"], lp["ops"]["HMMA"]) == ("0x10", "0x20", 2, 1)


def test_a_branch_to_an_address_outside_the_kernel_is_not_a_loop(sl):
    assert sl.loops([(0x10, "NOP"), (0x20, "BRA 0x8")]) == []


def test_parse_registers(sl):
    assert sl.parse_registers(RES_USAGE) == {"_ZN3abc6kernelEPf": 78, "plain_kernel": 16}


@pytest.mark.parametrize("mangled,want", [
    ("_ZN43_GLOBAL__N__ddb5acc0_10_moe_mma_cu_729816f014moe_mlp_kernelILi2ELi8ELb0ELb1ELi1ELb1EEEvPK13__nv_bfloat16ii",
     "moe_mlp_kernelILi2ELi8ELb0ELb1ELi1ELb1EEE"),
    ("_ZN3abc6kernelEPf", "kernel"),
    ("plain_kernel", "plain_kernel")])
def test_short_name(sl, mangled, want):
    assert sl.short_name(mangled) == want


def test_a_failing_cuobjdump_exits_with_its_message(sl, monkeypatch, tmp_path):
    """cuobjdump -sass without nvdisasm on PATH fails: the script exits naming the command, cuobjdump's message and
    where an nvdisasm comes from, not with a CalledProcessError traceback."""
    import subprocess

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 255, "", "cuobjdump fatal   : Could not find executable file 'nvdisasm'")

    monkeypatch.setattr(sl.subprocess, "run", fake_run)
    with pytest.raises(SystemExit) as e:
        sl._disassemble("/x/cuobjdump", "-sass", tmp_path / "k.cubin")
    msg = str(e.value)
    assert "/x/cuobjdump -sass failed" in msg and "Could not find executable file 'nvdisasm'" in msg
    assert "nvidia-cuda-nvdisasm" in msg
