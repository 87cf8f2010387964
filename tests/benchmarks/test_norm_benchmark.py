"""benchmarks/norm.py on the CPU: the floors, the config sweep, the JSON records (xla), and the kernels' path
of --configs on the NumPy emulator against xla."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import norm


def test_floor_bytes_count_one_pass_over_each_array():
    rows = 8 * 2048
    # Gated: x, z, y (bf16) forward; x, z, dy, dx, dz more for the backward.
    assert norm.floor_bytes(norm.CASES["gated_before"], rows, "fwd") == 3 * 2 * rows * 2048
    assert norm.floor_bytes(norm.CASES["gated_after"], rows, "fwd_bwd") == 8 * 2 * rows * 2048
    # Add + norm: x (2), residual (4), h (4), y (2); then h (4), dy (2), dh (4), dx (2), dresidual (4).
    assert norm.floor_bytes(norm.CASES["add_norm"], rows, "fwd") == 12 * rows * 1024
    assert norm.floor_bytes(norm.CASES["add_norm"], rows, "fwd_bwd") == 28 * rows * 1024


def test_sweep_varies_one_pass_around_the_default():
    pytest.importorskip("cuda.tile")
    for case in norm.CASES.values():
        base = norm.default_config(case)
        fwd, bwd = norm.sweep_configs(case, "fwd"), norm.sweep_configs(case, "fwd_bwd")
        assert base in fwd and base in bwd and len(set(fwd)) == len(fwd) and len(set(bwd)) == len(bwd)
        assert {(c.BWD_OCCUPANCY, c.BWD_LATENCY) for c in fwd} == {(base.BWD_OCCUPANCY, base.BWD_LATENCY)}
        assert {(c.FWD_OCCUPANCY, c.FWD_LATENCY) for c in bwd} == {(base.FWD_OCCUPANCY, base.FWD_LATENCY)}
        assert max(c.BLOCK_ROWS for c in fwd) * case.features <= 8192
    spec = norm.parse_config("BLOCK_ROWS=4,BWD_LATENCY=2", norm.CASES["add_norm"])
    assert spec == dataclasses.replace(norm.default_config(norm.CASES["add_norm"]), BLOCK_ROWS=4, BWD_LATENCY=2)
    with pytest.raises(ValueError, match="BLOCKROWS=4"):
        norm.parse_config("BLOCKROWS=4", norm.CASES["add_norm"])


def test_cli_writes_records_with_errors_against_float32(tmp_path, capsys):
    assert norm.main(["--impls", "xla", "--rows", "37", "--budget-seconds", "0.05", "--out", str(tmp_path)]) == 0
    names = {"gated_before": {"out", "dx", "dz", "dweight"}, "gated_after": {"out", "dx", "dz", "dweight"},
             "add_norm": {"out", "residual_out", "dx", "dresidual", "dweight"}}
    for direction in ("fwd", "fwd_bwd"):
        (path,) = [p for p in tmp_path.glob("norm_*.json") if p.name.rsplit("_", 1)[0] == f"norm_{direction}"]
        records = json.loads(path.read_text())
        assert [r["case"] for r in records] == list(norm.CASES)
        for r in records:
            want = names[r["case"]] if direction == "fwd_bwd" else names[r["case"]] & {"out", "residual_out"}
            assert r["impl"] == "xla" and r["config"] is None and r["ms_pipelined"] > 0
            assert set(r["errors"]) == want and max(r["errors"].values()) < 1e-2
    assert capsys.readouterr().out.count(" xla ") == 6
    # A second run of one case replaces that case's records and keeps the others.
    assert norm.main(["--impls", "xla", "--rows", "37", "--cases", "add_norm", "--direction", "fwd",
                      "--budget-seconds", "0.05", "--out", str(tmp_path)]) == 0
    (path,) = [p for p in tmp_path.glob("norm_fwd_*.json") if not p.name.startswith("norm_fwd_bwd")]
    assert [r["case"] for r in json.loads(path.read_text())] == list(norm.CASES)


@pytest.mark.parametrize("name", list(norm.CASES))
def test_kernels_in_a_config_match_xla_on_the_emulator(monkeypatch, name):
    """The benchmark's own spelling of the custom VJP (forward, NormSaved, backward) on the emulated kernels in
    a non-default config, against the op on xla (float32 inputs, so the tolerance is float32's)."""
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import ffi
    from tests.kernels import _cutile_emulator as emulator

    monkeypatch.setattr(ffi, "run_plan", emulator.jax_run_plan)
    case = norm.CASES[name]._replace(features=norm.CASES[name].features // 64)
    inputs = jax.tree.map(lambda a: a.astype(jnp.float32), norm.make_inputs(case, rows=9, seed=3))
    config = dataclasses.replace(norm.default_config(case), BLOCK_ROWS=2, BWD_LATENCY=2)
    for direction in ("fwd", "fwd_bwd"):
        got = norm.jax_call(inputs, direction, *norm.kernel_forward_and_backward(case, config))()
        want = norm.jax_call(inputs, direction, norm.op_forward(case, "xla"))()
        assert len(got) == len(want)
        for name_, g, w in zip(norm.OUTPUT_NAMES, got, want):
            assert (g is None) == (w is None), name_
            if w is not None:
                assert g.shape == w.shape and norm.rel_l2(g, w) < 1e-5, name_
        assert np.isfinite(np.asarray(got[0])).all()
