"""benchmarks/decode_kernels.py on the CPU (the ops' xla path): the sweep's configs, the records it writes (after
every record, merged with an earlier file's), and a config applied through the registry reaching the op."""
import json

import jax.numpy as jnp
import pytest

from benchmarks import decode_kernels


def test_sweep_configs_are_distinct_tensor_core_tiles():
    pytest.importorskip("cuda.tile")
    for rows in (1, 64):
        configs = decode_kernels.sweep_configs("in_proj", rows)
        assert len(set(configs)) == len(configs)
        assert all(c.BLOCK_N >= 32 and c.BLOCK_M is None for c in configs)  # 16-column or 1-row tiles: no mma
    mixer = decode_kernels.sweep_configs("mixer", 64)
    assert {c.BLOCK_P for c in mixer} == {32, 64} and {c.OCCUPANCY for c in mixer} == {2, 4, 8}


def test_cli_writes_a_record_per_case_and_merges_reruns(tmp_path, capsys, monkeypatch):
    """The CLI's records and merge, on the CPU through the ops' XLA path (the script itself refuses to run without
    the kernels, so that no XLA timing is recorded under their names: bypassed here)."""
    monkeypatch.setattr(decode_kernels, "exit_unless_cutile_runs", lambda script: None)
    argv = ["--cases", "in_proj", "out_proj", "mixer", "--d-model", "64", "--batches", "2", "--out", str(tmp_path)]
    assert decode_kernels.main(argv) == 0
    path = next(tmp_path.glob("decode_kernels_*.json"))
    records = json.loads(path.read_text())["records"]
    assert [r["case"] for r in records] == ["in_proj", "out_proj", "mixer"]
    for record in records:
        assert record["us_per_launch"] > 0 and record["floor_us"] > 0 and record["default"] and record["config"]
        assert record["kernel_us"] is None  # the CPU has no GPU kernels to trace
    assert decode_kernels.main(argv[:2] + argv[4:]) == 0  # a rerun of in_proj replaces it, the rest stays
    assert [r["case"] for r in json.loads(path.read_text())["records"]] == ["out_proj", "mixer", "in_proj"]
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_floors_count_the_weights_and_the_state():
    shapes = decode_kernels.Shapes(1024)
    _, _, in_proj = decode_kernels._arrays("in_proj", shapes, 1, jnp.bfloat16, __import__("jax").random.key(0))
    assert in_proj >= 1024 * shapes.d_in_proj * 2
    _, _, mixer = decode_kernels._arrays("mixer", shapes, 64, jnp.bfloat16, __import__("jax").random.key(0))
    assert mixer >= 2 * 64 * shapes.nheads * 64 * 128 * 2
