"""benchmarks/ssd.py and benchmarks/report.py: roofline, CLI, JSON records -> table and plot (no GPU)."""
import json
import re
import time

import jax
import pytest

from benchmarks import report, ssd


def test_roofline_matches_the_worked_numbers_of_the_notes():
    # mamba2.md §10, 2.7b layer (H=80, P=64, N=128, G=1, Q=256): 3.96 MFLOP and 21.2 KB per token.
    line = ssd.roofline(ssd.Shape(1, 8192, 80, 64, 128, 1), chunk_size=256)
    assert line["flops"] / 8192 == pytest.approx(3.965e6, rel=1e-3)
    fused_per_token = (line["bytes"] - 4 * 80 * 64 * 128) / 8192
    assert fused_per_token == pytest.approx(21152)
    assert line["floor_ms"] == max(line["compute_ms"], line["memory_ms"])
    backward = ssd.roofline(ssd.Shape(1, 8192, 80, 64, 128, 1), chunk_size=256, direction="fwd_bwd")
    assert 2.5 < backward["flops"] / line["flops"] < 4.5  # the backward is ~2.5-3x the forward


def test_shape_parse_accepts_commas_and_rejects_wrong_arity():
    assert ssd.Shape.parse("4,2048,32,64,128,1") == ssd.Shape(4, 2048, 32, 64, 128, 1)
    with pytest.raises(ValueError, match="must be B,L,H,P,N,G"):
        ssd.Shape.parse("4,2048,32")


def _record(impl, ms, *, error=None):
    shape = ssd.Shape(4, 2048, 32, 64, 128, 1)
    if error:
        return {"impl": impl, "shape": shape._asdict(), "direction": "fwd", "chunk_size": 256,
                "error": error}
    line = ssd.roofline(shape)
    return {"op": "ssd", "direction": "fwd", "impl": impl, "shape": shape._asdict(), "dtype": "bfloat16",
            "chunk_size": 256, "error": None, "ms_median": ms * 1.1, "ms_p20": ms, "ms_p80": ms * 1.2,
            "ms_pipelined": ms, "tflops": line["flops"] / ms / 1e9, "gbps": line["bytes"] / ms / 1e6,
            "rel_l2_err": 3e-3, "timing": "block_until_ready", "roofline": line, "first_call_s": 2.0,
            "gpu": "NVIDIA H200"}


@pytest.fixture
def result_file(tmp_path):
    records = [_record("cutile", 0.25), _record("xla", 1.0), _record("mamba_ssm", 0.5),
               _record("jla", 0.4), _record("cutile_callback", 0.3, error="RuntimeError: boom")]
    return report.write_records(records, tmp_path / "ssd_fwd_h200.json")


def test_table_from_json_has_ratios_errors_and_floor(result_file):
    records = report.load_records(result_file)
    ratio = report.ratios(records)
    assert ratio["cutile"]["vs_best_peer"] == pytest.approx(0.25 / 0.4)
    assert ratio["cutile"]["speedup_vs_xla"] == pytest.approx(4.0)
    table = report.format_table(records)
    row = next(line for line in table.splitlines() if " cutile " in line)
    assert "0.62" in row and "4.00" in row and "3.0e-03" in row
    assert "cutile_callback: RuntimeError: boom" in table
    assert json.loads(result_file.read_text())[0]["impl"] == "cutile"


def test_merge_replaces_records_of_the_same_shape_and_impl(result_file, tmp_path):
    newer = [_record("cutile", 0.2), {**_record("cutile", 0.9), "shape": ssd.Shape(2, 32768, 32, 64, 128, 1)._asdict()}]
    path = report.write_records(newer, tmp_path / "later.json")
    assert report.main([str(result_file), "--merge", str(path)]) == 0
    records = report.load_records(result_file)
    assert [r["impl"] for r in records] == ["cutile", "xla", "mamba_ssm", "jla", "cutile_callback", "cutile"]
    assert records[0]["ms_pipelined"] == 0.2 and records[-1]["shape"]["seqlen"] == 32768


def test_plot_writes_a_png_per_result_file(result_file, tmp_path):
    path = report.plot_records(report.load_records(result_file), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _slow_for_a_while(seconds: float):
    """A program that takes 2 ms per call for its first `seconds` after its first call, then ~nothing: a GPU
    whose clocks ramp up under load. It returns one array made beforehand: no dispatch per call, whose time on a
    loaded CPU (the suite's other workers) could pass the warm bound."""
    first, zero = [], jax.numpy.zeros(())

    def fn():
        first.append(first[0] if first else time.perf_counter())
        if time.perf_counter() - first[0] < seconds:
            time.sleep(0.002)
        return zero
    return fn


def test_time_jax_times_the_calls_after_its_warm_up():
    cold = ssd.time_jax(_slow_for_a_while(0.5), budget_s=0.01, warmup_s=0.0)[0]
    warm = ssd.time_jax(_slow_for_a_while(0.5), budget_s=0.01, warmup_s=0.6)[0]
    assert cold.ms_pipelined > 1.0 and warm.ms_pipelined < 0.5 and warm.ms_median < 0.5
    assert len(warm.ms_pipelined_rounds) == ssd.PIPELINED_ROUNDS
    assert warm.ms_pipelined == sorted(warm.ms_pipelined_rounds)[ssd.PIPELINED_ROUNDS // 2]


def test_benchmark_main_writes_records_with_the_fixed_keys(tmp_path, capsys):
    ssd.main(["--impls", "xla", "--shapes", "1,64,2,16,16,1", "--chunk", "32",
              "--seconds-per-impl", "0.01", "--warmup-seconds", "0.01", "--out", str(tmp_path)])
    (path,) = [p for p in tmp_path.glob("ssd_fwd_*.json") if "_tuning_" not in p.name]
    (record,) = report.load_records(path)
    required = {"op", "direction", "impl", "shape", "dtype", "ms_median", "ms_p20", "ms_p80",
                "ms_pipelined", "tflops", "gbps", "rel_l2_err", "max_abs_err", "timing", "gpu", "sm",
                "driver", "versions", "git_sha", "date", "chunk_size", "roofline"}
    assert required <= set(record) and record["error"] is None
    assert record["rel_l2_err"] < 2e-2 and record["ms_p20"] <= record["ms_median"] <= record["ms_p80"]
    assert "pipelined" in capsys.readouterr().out


def test_forward_backward_program_runs_the_forward_kernels():
    """The timed fwd_bwd program keeps the forward: with jax.grad of the linear loss alone, the forward's
    kernels are dead code (their outputs do not reach the gradients) and only the backward is timed."""
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge.aot import export_for_cuda

    shape = ssd.Shape(1, 128, 4, 64, 64, 1)
    args, weights = ssd._ordered(ssd.make_inputs(shape)), ssd.loss_weights(shape)
    forward = ssd._ssd_call("cutile", 64)

    def kernels(program):
        return set(re.findall(r"chunk_scan_\w*kernel", export_for_cuda(program, args, weights).mlir_module()))

    assert kernels(ssd.forward_backward(forward)) == {
        "chunk_scan_fwd_kernel", "chunk_scan_bwd_dc_kernel", "chunk_scan_bwd_dx_kernel"}
    assert "chunk_scan_fwd_kernel" not in kernels(jax.grad(ssd._linear_loss(forward)))


def test_loss_weights_are_arguments_of_the_timed_program_not_constants():
    """Closed-over weights became constants of the compiled program, which XLA spent minutes folding."""
    shape = ssd.Shape(1, 128, 4, 64, 64, 1)
    args, weights = ssd._ordered(ssd.make_inputs(shape)), ssd.loss_weights(shape)
    jaxpr = jax.make_jaxpr(ssd.forward_backward(ssd._ssd_call("xla", 64)))(args, weights)
    assert not [c for c in jaxpr.consts if getattr(c, "size", 0) > 1]


def test_cutile_records_the_chunk_its_kernels_run_at():
    """Asked for chunk 256, the cutile backends run their kernels at 64, and their records say so."""
    pytest.importorskip("cuda.tile")
    shape = ssd.Shape(1, 128, 4, 64, 64, 1)
    inputs, weights = ssd.make_inputs(shape), ssd.loss_weights(shape)
    assert ssd.prepare_ours("cutile", inputs, weights, 256, "fwd").chunk_size == 64
    assert ssd.prepare_ours("xla", inputs, weights, 256, "fwd").chunk_size == 256
