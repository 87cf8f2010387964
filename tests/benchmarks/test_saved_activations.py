"""benchmarks/tools/saved_activations.py: the arrays a block keeps for its backward, parsed and summed."""
import pytest

from benchmarks.tools import saved_activations


def test_parse_saved_reads_dtype_shape_bytes_and_source():
    printed = ("bf16[8,2048,6448] output of dot_general from /x/projection.py:26:15 (project)\n"
               "f32[1536,6448] from the argument state['mixer']['in_proj']['kernel'].value\n"
               "f32[] output of reduce_sum\n")
    saved = saved_activations.parse_saved(printed)
    assert [(s["dtype"], s["shape"], s["bytes"]) for s in saved] == [
        ("bf16", (8, 2048, 6448), 2 * 8 * 2048 * 6448), ("f32", (1536, 6448), 4 * 1536 * 6448), ("f32", (), 4)]
    assert saved[1]["is_input"] and not saved[0]["is_input"]
    totals = saved_activations.summary(saved, layers=3)
    assert totals["activation_bytes_per_layer"] == saved[0]["bytes"] + 4  # the parameter is not an activation
    assert totals["activation_bytes"] == 3 * totals["activation_bytes_per_layer"]


def test_a_traced_block_keeps_what_its_backward_reads_and_a_remat_policy_keeps_less():
    """xla backend, d_inner 128, one group of 16, 8 heads: in_proj's output [z, x, B, C, dt] is 296 wide."""
    everything = saved_activations.block_saved(64, 2, 32, d_state=16, headdim=16, backend="xla")
    # in_proj's float32 weight (a parameter: it lives anyway), not a bfloat16 copy of it: the backward converts again
    weights = [s for s in everything if s["shape"] == (64, 296)]
    assert [(s["dtype"], s["is_input"]) for s in weights] == [("f32", True)]
    dots = saved_activations.block_saved(64, 2, 32, d_state=16, headdim=16, backend="xla", remat="dots")
    # the product's output (in_proj's, made inside the checkpoint that converts its weight)
    assert [s["shape"] for s in dots if not s["is_input"] and s["shape"][-1] == 296] == [(2, 32, 296)]
    kept, all_kept = (saved_activations.summary(s, 1)["activation_bytes_per_layer"] for s in (dots, everything))
    assert 0 < kept < all_kept


def test_the_cli_prints_the_arrays_and_the_total(capsys, tmp_path):
    assert saved_activations.main(["--d-model", "64", "--batch", "1", "--seqlen", "32", "--d-state", "16",
                                   "--headdim", "16", "--backend", "xla", "--min-mib", "0",
                                   "--json", str(tmp_path / "saved.json")]) == 0
    out = capsys.readouterr().out
    assert "activations kept per layer" in out and (tmp_path / "saved.json").stat().st_size > 0


def test_remat_matmuls_on_the_kernels_keeps_in_proj_output_and_inputs_only():
    """Traced for sm_90 (the cuTile kernels' custom VJPs): the LM's "matmuls" policy keeps in_proj's output and
    the block's inputs, none of the kernels' own residuals (the SSD's chunk states, the norms' and the conv's
    outputs: recomputed in the backward)."""
    pytest.importorskip("cuda.tile")
    everything = saved_activations.block_saved(64, 2, 128, d_state=16, headdim=16)
    matmuls = saved_activations.block_saved(64, 2, 128, d_state=16, headdim=16, remat="matmuls")
    kept = [s for s in matmuls if not s["source"].startswith("from the argument")]
    assert [s["shape"] for s in kept] == [(2, 128, 296)] and "named 'mamba2_in_proj_output'" in kept[0]["source"]
    assert len([s for s in everything if not s["is_input"]]) > 5
    # Of the gated norm's inputs, saving everything: y alone; its backward reads z again from in_proj's output.
    assert [s["shape"] for s in everything if s["shape"][:1] == (2 * 128,) and s["shape"][-1:] == (128,)] == [
        (256, 1, 128)]
    assert sorted(s["shape"] for s in everything if s["shape"][-1:] == (296,)) == [(2, 128, 296), (64, 296)]
