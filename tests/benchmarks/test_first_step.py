"""benchmarks/first_step.py on the CPU: a tiny LM's step traced and lowered for sm_90 (--lower-only), its
cuTile kernels compiled by a fake compiler, and the record it writes."""
import json

import pytest

pytest.importorskip("cuda.tile")

from benchmarks import first_step  # noqa: E402
from benchmarks.environment import local_gpu_slug  # noqa: E402
from jax_mamba2.bridge import _compat, compile_ahead  # noqa: E402


def test_first_step_lower_only_records_stages_and_cubins(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cache"))  # restored after the test
    compiled = []

    def fake(kernel, constraints, arch):
        compiled.append(kernel._annotated_function.pyfunc.__name__)
        return _compat.kernel_signature(kernel, constraints).symbol, b"not a cubin"

    with compile_ahead.using(compile_ahead.KernelCompiler(compile_fn=fake)):
        assert first_step.main(["--config", "d128-l3-2x64", "--lower-only", "--cutile-cache",
                                str(tmp_path / "cache"), "--out", str(tmp_path)]) == 0
    record, = json.loads((tmp_path / f"first_step_{local_gpu_slug()}.json").read_text())["records"]
    assert record["config"] == "d128-l3-2x64" and record["lower_only"] is True
    assert record["cubins_compiled"] == len(compiled) >= 10
    assert sorted(record["cubin_compile_s"]) == sorted(set(compiled))
    assert record["trace_s"] > 0 and record["lower_s"] > 0 and record["xla_compile_s"] is None
    assert "run_s" not in record
    assert record["first_step_s"] == pytest.approx(record["trace_s"] + record["lower_s"])
    assert record["cutile_cache_entries_before"] == 0
