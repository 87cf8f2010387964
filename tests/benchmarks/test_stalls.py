"""benchmarks/tools/stalls.py folds Nsight Compute's warp-state samples into stalls per SASS loop (no GPU: ncu's
CSV and details text written here in its format)."""
import json

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools import stalls  # noqa: E402

# ncu's source page: the kernel's name on a line of its own, then the header; absolute addresses, branch
# targets absolute too. A loop 0x10-0x40 with one HGMMA and its wait; the branch past EXIT is a wait stub's.
_BASE = 0x7F0000001000
_SOURCE = "\n".join([
    '"Kernel Name","fused_scan_fwd_kernel_Kt2"',
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"stall_barrier","stall_long_sb","stall_selected","stall_barrier (Not Issued)"',
    *(f'"{hex(_BASE + offset)}","{text}","{samples}","0","{barrier}","{long_sb}","{selected}","{barrier}"'
      for offset, text, samples, barrier, long_sb, selected in [
          (0x00, "      MOV R1, c[0x0][0x28]", 1, 0, 0, 1),
          (0x10, "      WARPGROUP.ARRIVE", 2, 0, 0, 2),
          (0x20, "      HGMMA.64x64x16.F32.BF16 R56, gdesc[UR4], RZ, !UPT", 3, 0, 0, 3),
          (0x30, "      WARPGROUP.DEPBAR.LE gsb0, 0x0", 12, 11, 0, 1),
          (0x40, f"@P0   BRA {hex(_BASE + 0x10)}", 3, 0, 2, 1),
          (0x50, f"      BRA {hex(_BASE + 0x60)}", 0, 0, 0, 0),
          (0x60, "      EXIT", 1, 0, 0, 1),
          (0x70, f"      BRA {hex(_BASE + 0x30)}", 2, 0, 2, 0)]),
])
_DETAILS = """  fused_scan_fwd_kernel_Kt2 (128, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    SM Frequency                    Ghz         1.76
    Elapsed Cycles                cycle      338,284
    Duration                         us       190.75
    Section: Compute Workload Analysis
    Issue Slots Busy               %        40.68
    Registers Per Thread             register/thread             168
"""


def test_summary_folds_the_samples_of_each_wgmma_loop_by_stall_reason():
    summary = stalls.summarize_rows(stalls.source_rows(_SOURCE))
    assert summary["samples"] == 24
    [loop] = summary["loops"]
    assert (loop["offsets"], loop["instructions"], loop["hgmma"], loop["waits"]) == (["0x10", "0x40"], 4, 1, 1)
    assert loop["samples"] == 20 and loop["share_of_all_samples"] == round(20 / 24, 4)
    assert loop["stall_reasons"] == {"barrier": 0.55, "selected": 0.35, "long_sb": 0.1}
    top = loop["top_sites"][0]
    assert (top["offset"], top["sass"], top["share_of_loop"]) == ("0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 0.6)
    assert top["reasons"] == {"barrier": 11, "selected": 1}


def test_kernel_metrics_read_the_details_page():
    assert stalls.kernel_metrics(_DETAILS) == {"sm_ghz": 1.76, "duration_us": 190.75, "issue_slots_busy_pct": 40.68,
                                               "registers_per_thread": 168.0}


def test_summarize_command_adds_its_record_to_the_list_replacing_the_same_shape(tmp_path):
    (tmp_path / "source.csv").write_text(_SOURCE)
    (tmp_path / "details.txt").write_text(_DETAILS)
    out = tmp_path / "stalls.json"

    def summarize(*meta):
        assert stalls.main(["summarize", str(tmp_path / "source.csv"), "--details", str(tmp_path / "details.txt"),
                            "--meta", *meta, "layout=fused", "--out", str(out)]) == 0
        return json.loads(out.read_text())

    summarize("run=106", "shape=4,8192,32,64,128,1")
    summarize("run=106", "shape=4,8192,32,64,64,1")
    records = summarize("run=109", "shape=4,8192,32,64,128,1")
    assert [(r["shape"], r["run"]) for r in records] == [("4,8192,32,64,64,1", "106"), ("4,8192,32,64,128,1", "109")]
    assert records[1]["kernel"]["duration_us"] == 190.75
    assert [loop["offsets"] for loop in records[1]["loops"]] == [["0x10", "0x40"]]
