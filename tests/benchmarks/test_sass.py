"""benchmarks/tools/sass.py reads the sm_90 SASS of the forward kernels (compiled here, no GPU)."""
import dataclasses
import json
import re

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.ssd import Shape  # noqa: E402
from benchmarks.tools import sass, stages  # noqa: E402
from benchmarks.tools.stages import dims_of  # noqa: E402
from jax_mamba2.kernels import backward, forward, fused_scan  # noqa: E402
from jax_mamba2.kernels._common import kernel_name  # noqa: E402
from jax_mamba2.kernels.export import compile_launch  # noqa: E402

_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   WARPGROUP.ARRIVE ;                      /* 0x00000000000079c5 */
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR4], RZ, !UPT ;   /* 0x00e00000043879f0 */
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;         /* 0x00000000000079c5 */
        /*0040*/               @P0 BRA 0x10 ;                              /* 0x0000000000000947 */
        /*0050*/                   BRA 0x60 ;                              /* 0xfffffffc00fc7947 */
        /*0060*/                   EXIT ;                                  /* 0x000000000000794d */
        /*0070*/                   BRA 0x30 ;                              /* 0xfffffffc00fc7947 */
"""


def test_loops_count_instructions_hgmma_and_waits_of_each_backward_branch():
    """The branch back from 0x40 closes a loop; the one past EXIT is a wait stub's return, not a loop."""
    assert sass.loops(_LISTING) == [sass.Loop(start=0x10, end=0x40, instructions=4, hgmma=1, waits=1)]
    assert [address for address, _ in sass.instructions(_LISTING)] == list(range(0, 0x80, 0x10))


def _fused_cubin(dims, **configs):
    layout = stages.variant_layout(dims, configs)
    launch = forward.forward_plan(dims, configs, layout).launches[-1]
    return compile_launch(launch, forward.forward_arrays(dims, layout))[1]


def test_fused_default_at_the_main_shape_has_a_product_loop_with_waits():
    """The fused kernel's chunk loop at (4,8192,32,64,128,1): wgmma products and at least one wait on them."""
    try:
        listing, resources = sass.disassemble(_fused_cubin(dims_of(Shape(4, 8192, 32, 64, 128, 1), 64)))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert "REG:" in resources
    product_loops = [loop for loop in sass.loops(listing) if loop.hgmma]
    assert product_loops and all(loop.waits >= 1 for loop in product_loops)


def test_fused_kernel_adds_the_reach_term_without_registers_stack_or_products():
    """The op's reach term (SSDDims.has_reach, one vector added per chunk to the rows' inter-chunk scale) leaves
    the fused default at the LM layer's shape (8,2048,32,64,128,1) with the registers, stack and wgmma of its
    chunk loop, a few instructions longer."""
    dims = dims_of(Shape(8, 2048, 32, 64, 128, 1), 64)
    try:
        (plain, plain_resources), (reach, reach_resources) = (
            sass.disassemble(_fused_cubin(d)) for d in (dims, dataclasses.replace(dims, has_reach=True)))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    registers = [re.search(r"REG:(\d+) STACK:(\d+)", r).groups() for r in (plain_resources, reach_resources)]
    assert registers[0] == registers[1] and registers[1][1] == "0"
    (plain_loop,), (reach_loop,) = ([loop for loop in sass.loops(listing) if loop.hgmma > 4]
                                    for listing in (plain, reach))
    assert reach_loop.hgmma == plain_loop.hgmma
    assert plain_loop.instructions < reach_loop.instructions < 1.1 * plain_loop.instructions


def test_dx_pass_adds_the_reach_term_without_registers_or_products():
    """The backward's dx pass with the op's reach term (added to each row's Δ) at the LM layer's shape: the
    registers and wgmma of the pass without it, a few instructions more."""
    dims = dims_of(Shape(8, 2048, 32, 64, 128, 1), 64)
    counts = []
    for d in (dims, dataclasses.replace(dims, has_reach=True)):
        plan = backward.backward_plan(d, saved_states=True)
        launch = next(launch for launch in plan.launches if "bwd_dx" in kernel_name(launch.kernel))
        try:
            listing, resources = sass.disassemble(compile_launch(launch, backward.backward_arrays(
                d, saved_states=True))[1])
        except FileNotFoundError as e:
            pytest.skip(str(e))
        counts.append((re.search(r"REG:(\d+)", resources).group(1), len(sass.instructions(listing)),
                       sum("HGMMA" in op for _, op in sass.instructions(listing))))
    (plain_regs, plain_ops, plain_hgmma), (reach_regs, reach_ops, reach_hgmma) = counts
    assert reach_regs == plain_regs and reach_hgmma == plain_hgmma
    assert plain_ops < reach_ops < 1.05 * plain_ops


def test_code_fingerprint_is_the_machine_code_alone():
    """Two compiles of one build agree; another config's build does not."""
    dims = dims_of(Shape(4, 8192, 32, 64, 64, 1), 64)
    default = _fused_cubin(dims)
    assert sass.code_fingerprint(default) == sass.code_fingerprint(_fused_cubin(dims))
    pairs = fused_scan.FusedScanConfig(BLOCK_P=64, WORKER_WARPS=8, CHUNKS_PER_ITER=2, WEIGHT_X=False)
    assert sass.code_fingerprint(default) != sass.code_fingerprint(_fused_cubin(dims, fused_scan=pairs))


def test_loops_command_reports_every_launch_of_the_plan(capsys):
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    sass.main(["loops", "4,8192,32,64,64,1", "--config", "fused_scan.CHUNKS_PER_ITER=2,fused_scan.WORKER_WARPS=8"])
    out = capsys.readouterr().out
    assert "chunk_cumsum_fwd_kernel (fused: default config)" in out
    assert "fused_scan_fwd_kernel (fused: FusedScanConfig(" in out and "CHUNKS_PER_ITER=2" in out
    assert "HGMMA" in out and "REG:" in out


def test_fingerprints_command_names_the_builds_that_differ(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sass, "fingerprint_builds", lambda: {"a": "1", "b": "2"})
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"a": "1", "b": "3"}))
    assert sass.main(["fingerprints", str(tmp_path / "after.json"), "--compare", str(before)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "b"
    assert json.loads((tmp_path / "after.json").read_text()) == {"a": "1", "b": "2"}
    assert sass.main(["fingerprints", str(tmp_path / "again.json"), "--compare", str(tmp_path / "after.json")]) == 0


def test_decode_report_prints_each_form_of_out_proj_s_product(capsys):
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    assert sass.main(["decode", "--rows", "1", "--dependent", "0", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        f"d_model 1024 rows 1 {form} DEPENDENT {level}" for form in ("plain", "gated", "mixer_gated")
        for level in (0, 2)]
    assert all("instructions" in line and "LDL" in line and "REG:" in line for line in lines)
