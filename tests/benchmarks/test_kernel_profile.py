"""benchmarks/tools/kernel_profile.py folds a Perfetto trace or ncu's raw CSV into per-kernel times per call."""
import gzip
import json

from benchmarks.tools import kernel_profile


def _summary(tmp_path, name, payload, calls, capsys):
    path = tmp_path / name
    path.write_bytes(payload)
    out = tmp_path / "summary.json"
    assert kernel_profile.main(["summarize", str(path), "--calls", str(calls), "--out", str(out)]) == 0
    assert "per call" in capsys.readouterr().out
    return json.loads(out.read_text())


def test_trace_summary_counts_gpu_kernels_per_call_and_the_span(tmp_path, capsys):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "host_op", "ts": 0.0, "dur": 500.0},        # not a GPU event
        # Two calls: dx (40 us, 30 us) and dc (20 us, 20 us), the last ending at 200 us.
        {"ph": "X", "pid": 7, "name": "dx_kernel", "ts": 10.0, "dur": 40.0},
        {"ph": "X", "pid": 7, "name": "dc_kernel", "ts": 60.0, "dur": 20.0},
        {"ph": "X", "pid": 7, "name": "dx_kernel", "ts": 110.0, "dur": 30.0},
        {"ph": "X", "pid": 7, "name": "dc_kernel", "ts": 180.0, "dur": 20.0},
    ]
    summary = _summary(tmp_path, "perfetto_trace.json.gz", gzip.compress(json.dumps({"traceEvents": events}).encode()),
                       2, capsys)
    assert summary["kernels"] == [{"kernel": "dx_kernel", "launches": 1.0, "us": 35.0},
                                  {"kernel": "dc_kernel", "launches": 1.0, "us": 20.0}]
    assert summary["busy_us_per_call"] == 55.0
    assert summary["span_us_per_call"] == (200.0 - 10.0) / 2


def test_ncu_summary_reads_durations_after_the_units_row(tmp_path, capsys):
    csv = ('==PROF== Connected to process 1\n'
           '"ID","Kernel Name","gpu__time_duration.sum"\n'
           '"","","nsecond"\n'
           '"0","fused_kernel","1,500"\n'
           '"1","fused_kernel","2,500"\n'
           '"2","cumsum_kernel","500"\n')
    summary = _summary(tmp_path, "kernels.csv", csv.encode(), 2, capsys)
    assert summary["kernels"] == [{"kernel": "fused_kernel", "launches": 1.0, "us": 2.0},
                                  {"kernel": "cumsum_kernel", "launches": 0.5, "us": 0.25}]
    assert "span_us_per_call" not in summary
