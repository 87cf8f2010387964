"""benchmarks/lm_train_mesh.py on fake CPU devices (tests/conftest.py) with a tiny LM."""
import json

import numpy as np
import pytest

from benchmarks import lm_train_mesh
from benchmarks.lm_train_mesh import MeshShape

TINY = ["--configs", "d32-l2", "--d-state", "8", "--headdim", "8", "--chunk-size", "8", "--vocab", "61",
        "--seqlen", "32", "--loss-steps", "4", "--steps", "2", "--warmup-seconds", "0", "--backend", "xla",
        "--compiler-option", "xla_backend_optimization_level=0", "--in-process"]


def test_meshes_configs_and_batches_parse():
    assert MeshShape.parse("data=2") == (2, 1) and MeshShape.parse("model=2").name == "model=2"
    assert MeshShape.parse("data=2,model=4").name == "data=2,model=4"
    assert MeshShape.parse("data=1").name == "data=1" and MeshShape(1, 1).devices == 1
    with pytest.raises(ValueError, match="mesh 'tensor=2' must be like data=2"):
        MeshShape.parse("tensor=2")
    assert lm_train_mesh.parse_config("d1536-l48") == (1536, 48)
    with pytest.raises(ValueError, match="config 'big' must be d<d_model>-l<n_layer>"):
        lm_train_mesh.parse_config("big")
    with pytest.raises(SystemExit):
        lm_train_mesh.parse_args(["--out", "x.json", "--compiler-option", "no_value"])
    a = lm_train_mesh.progression_batches(3, 4, 10, 61)
    assert a.shape == (3, 4, 11) and a.dtype == np.int32 and a.max() < 61
    strides = np.diff(a, axis=-1) % 61
    assert set(np.unique(strides)) <= {1, 2} and (strides == strides[..., :1]).all()
    np.testing.assert_array_equal(a, lm_train_mesh.progression_batches(3, 4, 10, 61))


def _record(mesh, global_batch, tokens_per_s, losses, all_gathers=()):
    shape = MeshShape.parse(mesh)
    return {"config": "d64-l2", "mesh": shape.name, "mesh_shape": shape._asdict(), "seqlen": 32,
            "batch_per_device": global_batch // shape.data, "global_batch": global_batch, "dtype": "bfloat16",
            "backend": "xla", "tokens_per_s": tokens_per_s, "losses": losses,
            "timing": {"ms_median": 1.0, "ms_p20": 1.0, "ms_p80": 1.0},
            "peak_memory_bytes": [None], "collectives": {"activation_all_gathers": list(all_gathers)}}


def test_comparisons_pick_the_one_device_run_of_the_same_per_device_and_global_batch(tmp_path):
    records = [_record("data=1", 8, 100.0, [4.0, 3.0]), _record("data=1", 16, 190.0, [4.0, 2.0]),
               _record("data=2", 16, 190.0, [4.0, 2.005]), _record("model=2", 8, 150.0, [4.0, 3.0], ["ag"])]
    path = tmp_path / "out.json"
    result = lm_train_mesh.merge_records(path, records)
    by_mesh = {c["mesh"]: c for c in result["comparisons"]}
    assert by_mesh["data=2"]["speedup"] == pytest.approx(1.9) and by_mesh["data=2"]["speedup_met"]
    assert by_mesh["data=2"]["loss_max_rel_diff"] == pytest.approx(0.0025) and by_mesh["data=2"]["loss_within_rtol"]
    assert by_mesh["model=2"]["speedup"] == pytest.approx(1.5) and by_mesh["model=2"]["speedup_met"] is False
    assert by_mesh["model=2"]["activation_all_gathers"] == 1
    # A later run replaces the record of the same key; the others stay.
    result = lm_train_mesh.merge_records(path, [_record("model=2", 8, 170.0, [4.0, 3.0])])
    assert len(result["records"]) == 4 and json.loads(path.read_text()) == result
    assert {c["mesh"]: c["speedup_met"] for c in result["comparisons"]} == {"data=2": True, "model=2": True}
    assert "speed-up 1.70x (target 1.6)" in lm_train_mesh.format_table(result)


@pytest.mark.slow  # three compiled steps
def test_the_benchmark_on_two_fake_devices(tmp_path, capsys):
    out = tmp_path / "lm_train_2gpu.json"
    assert lm_train_mesh.main([*TINY, "--mesh", "data=1", "model=2", "--batch", "2", "--out", str(out)]) == 0
    assert lm_train_mesh.main([*TINY, "--mesh", "data=2", "--batch", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    records = {r["mesh"]: r for r in result["records"]}
    assert sorted(records) == ["data=1", "data=2", "model=2"]
    for mesh, r in records.items():
        assert r["global_batch"] == 2 and len(r["losses"]) == 4 and r["timing"]["steps"] == 2
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["timing"]["ms_median"] * 1e-3))
        assert len(r["peak_memory_bytes"]) == MeshShape.parse(mesh).devices
        assert r["collectives"]["activation_all_gathers"] == []
        # compiled as a user compiles the layer scan: the model's options, --compiler-option on top
        assert r["compiler_options"] == {"xla_gpu_enable_triton_gemm": False, "xla_backend_optimization_level": 0}
        assert r["environment"]["git_sha"]
    assert set(records["data=1"]["collectives"]["totals"]) == set()
    assert set(records["data=2"]["collectives"]["totals"]) == {"all-reduce"}
    assert {"all-reduce", "all-to-all"} <= set(records["model=2"]["collectives"]["totals"])
    comparisons = {c["mesh"]: c for c in result["comparisons"]}
    for mesh in ("data=2", "model=2"):  # both at data=1's global batch: their losses agree to bf16 rounding
        assert comparisons[mesh]["loss_within_rtol"], comparisons[mesh]
    assert comparisons["data=2"]["speedup"] is None  # no data=1 run at 1 row
    assert comparisons["model=2"]["speedup"] > 0
    assert "wrote" in capsys.readouterr().out


def test_a_failed_worker_becomes_a_record_with_its_error(tmp_path):
    job = lm_train_mesh.jobs(lm_train_mesh.parse_args([*TINY, "--mesh", "data=16", "--batch", "1", "--out",
                                                       str(tmp_path / "x.json")]))[0]
    record = lm_train_mesh.run_isolated(job, timeout_s=300)
    assert "mesh data=16 needs 16 devices; 8 visible" in record["error"]
    assert record["mesh"] == "data=16" and record["global_batch"] == 16
