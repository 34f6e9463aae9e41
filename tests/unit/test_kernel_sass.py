"""tools/kernel_sass.py's loop finding on hand-written SASS (no compiler needed): the step loop,
the ring's chunk loop around it and the work between them, which docs/perf-log.md v25 step 1
compared across kernel forms."""

from __future__ import annotations

from tool_module import tool_module


def kernel_sass():
    return tool_module("kernel_sass")


# A chunk loop (0x0040-0x0100) whose barrier and copies surround a step loop (0x0080-0x00c0), and
# a loop after it without tensor-core instructions (the merge's).
SASS = """
        Function : cupa_decode_demo
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   LDS R2, [R3] ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR8][R6.64] ;
        /*0070*/                   IMAD R8, R2, 0x4, R9 ;
        /*0080*/                   LDSM.16.M88.4 R12, [R8] ;
        /*0090*/                   HMMA.16816.F32 R16, R12, R14, R16 ;
        /*00a0*/                   @P0 FMUL R16, R16, R20 ;
        /*00b0*/                   ISETP.GE.AND P1, PT, R9, R10, PT ;
        /*00c0*/                   @!P1 BRA 0x80 ;
        /*00d0*/                   VIADD R21, R21, 0x1 ;
        /*00e0*/                   ISETP.GE.AND P2, PT, R21, R22, PT ;
        /*0100*/                   @!P2 BRA 0x40 ;
        /*0110*/                   FADD R23, R23, R24 ;
        /*0120*/                   @!P3 BRA 0x110 ;
        /*0130*/                   EXIT ;
        Function : cupa_other
        /*0000*/                   HMMA.16816.F32 R0, R2, R4, R0 ;
        /*0010*/                   BRA 0x0 ;
"""


def test_step_loop_chunk_loop_and_the_work_between():
    ks = kernel_sass()
    code = ks.instructions(SASS, "cupa_decode_demo")
    assert [a for a, _ in code][:3] == [0x0, 0x40, 0x50]  # this kernel's only
    step, chunk = ks.chunk_loop(code), ks.ring_chunk(code)
    assert len(step) == 5 and step[0].startswith("LDSM") and step[-1].startswith("@!P1 BRA")
    assert len(chunk) == 12 and chunk[0].startswith("BAR.SYNC")
    assert len(chunk) - len(step) == 7  # barrier, copies, address work, loop control
    assert [ks.opcode(t) for t in step] == ["LDSM", "HMMA", "FMUL", "ISETP", "BRA"]
    assert len(ks.loops(code)) == 3
    assert ks.smallest_loop(code, "HMMA", "EXIT") == []


def test_a_kernel_whose_chunk_is_its_innermost_tensor_core_loop():
    """The 8-column kernel: no step loop inside the chunk's, so nothing lies between them."""
    ks = kernel_sass()
    code = ks.instructions(SASS.replace("@!P1 BRA 0x80", "NOP"), "cupa_decode_demo")
    assert ks.chunk_loop(code) == ks.ring_chunk(code)
    assert len(ks.chunk_loop(code)) == 12
