"""benchmarks/conv1d.py on the CPU (xla only, a tiny shape): the floor, the configs and the JSON records."""
import json

import pytest

from benchmarks import conv1d
from jax_mamba2.kernels.causal_conv1d import ConvFwdConfig
from jax_mamba2.kernels.causal_conv1d_bwd import REDUCE_BLOCK_C, ConvBwdConfig


def test_floor_bytes_count_one_pass_over_each_tensor():
    # (8, 2048, 2304) bf16: 151 MB forward (x, y), 377 MB forward + backward (x, y; x, dy, dx).
    assert conv1d.floor_bytes((8, 2048, 2304), "fwd") == 2 * 2 * 8 * 2048 * 2304
    assert conv1d.floor_bytes((8, 2048, 2304), "fwd_bwd") == 5 * 2 * 8 * 2048 * 2304


def test_cli_writes_records_with_errors_against_float32(tmp_path, capsys):
    assert conv1d.main(["--impls", "xla", "--shapes", "2,37,24", "--budget-seconds", "0.05",
                        "--out", str(tmp_path)]) == 0
    for direction, names in (("fwd", {"y"}), ("fwd_bwd", {"y", "dx", "dkernel", "dbias"})):
        (path,) = [p for p in tmp_path.glob("conv1d_*.json") if p.name.rsplit("_", 1)[0] == f"conv1d_{direction}"]
        (record,) = json.loads(path.read_text())
        assert record["impl"] == "xla" and record["shape"] == [2, 37, 24] and record["ms_pipelined"] > 0
        assert set(record["errors"]) == names and max(record["errors"].values()) < 1e-2
    assert capsys.readouterr().out.count("xla") == 2


def test_cli_times_the_mixer_layout_against_the_same_reference(tmp_path):
    """In the mixer layout x is in_proj's [z, xBC, dt] (here d_ssm 64: 64 + 320 + 1 channels) and the outputs
    are x, B, C; the records' y and dx cover the conv's channels, as in the plain layout."""
    assert conv1d.main(["--impls", "xla", "--layouts", "plain", "mixer", "--shapes", "2,37,320", "--direction",
                        "fwd_bwd", "--budget-seconds", "0.05", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("conv1d_fwd_bwd_*.json")
    records = json.loads(path.read_text())
    assert [r["layout"] for r in records] == ["plain", "mixer"]
    assert records[0]["floor_ms"] == records[1]["floor_ms"] == conv1d.floor_bytes((2, 37, 320), "fwd_bwd") / 4.3e9
    for record in records:
        assert max(record["errors"].values()) < 1e-2 and record["config"] is None
    assert conv1d.mixer_layout(2304) == (2048, 2048 + 2304 + 32, (2048, 128, 128))


def test_configs_parse_from_their_fields():
    assert conv1d.parse_config("8x1024x2", ConvFwdConfig) == ConvFwdConfig(BLOCK_L=8, BLOCK_C=1024, OCCUPANCY=2)
    assert conv1d.parse_config("8x16x512x4", ConvFwdConfig) == ConvFwdConfig(BLOCK_L=8, BLOCK_C=512, OCCUPANCY=4,
                                                                             SEGMENT_TILES=16)
    assert conv1d.parse_config("16x8x128x3", ConvBwdConfig) == ConvBwdConfig(
        BLOCK_L=16, SEGMENT_TILES=8, BLOCK_C=128, REDUCE_BLOCK_C=REDUCE_BLOCK_C, OCCUPANCY=3)
    with pytest.raises(SystemExit, match="config '16x512' must be BLOCK_LxSEGMENT_TILESxBLOCK_CxOCCUPANCY"):
        conv1d.parse_config("16x512", ConvBwdConfig)


def test_configured_kernels_run_their_tiles_and_match_xla():
    """What a sweep times: the bridge's plans at the listed tiles (here on the NumPy emulator, the mixer
    layout, blocks of 16 channels straddling B and C), against xla."""
    import jax
    import jax.numpy as jnp

    conv_ops = pytest.importorskip("jax_mamba2.bridge.conv_ops")
    from tests._helpers import rel_l2
    from tests.kernels import _cutile_emulator as emulator

    kernels = conv_ops.ConvKernels("emulated", emulator.jax_run_plan, ConvFwdConfig(BLOCK_L=4, BLOCK_C=16),
                                   ConvBwdConfig(BLOCK_L=4, SEGMENT_TILES=2, BLOCK_C=32, REDUCE_BLOCK_C=64))
    inputs = conv1d.make_inputs((1, 21, 320), layout="mixer")
    got = conv1d.jax_call("cutile", inputs, "fwd_bwd", "mixer", kernels)()
    want = conv1d.jax_call("xla", jax.tree.map(lambda a: a.astype(jnp.float32), inputs), "fwd_bwd", "mixer")()
    for name, g, w in zip(("y", "dx", "dkernel", "dbias"), got, want):
        assert g.shape == w.shape and rel_l2(g, w) < 1e-2, name
