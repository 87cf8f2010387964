"""Tests of load_pretrained / save_pretrained and Orbax checkpoints (jax_mamba2/flax_layers/checkpoint.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jax_mamba2.flax_layers import Mamba2LMHeadModel, load_pretrained, save_pretrained


def _random_model(config):
    """A model whose parameters are all random (also D and the norm scales, which init to ones)."""
    model = Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), state))
    return model


def _torch_state_dict(model, embedding_name: str) -> dict[str, np.ndarray]:
    """The model's weights as mamba_ssm's PyTorch modules hold them (names and layouts written out here)."""
    layers, mixer = model.layers, model.layers.mixer
    state = {embedding_name: model.embedding.embedding[...], "backbone.norm_f.weight": model.norm_f.scale[...]}
    if model.lm_head is not None:
        state["lm_head.weight"] = model.lm_head.kernel[...].T
    elif embedding_name == "backbone.embedding.weight":  # mamba_ssm's state_dict lists the tied head too
        state["lm_head.weight"] = model.embedding.embedding[...]
    for i in range(model.config.n_layer):
        prefix = f"backbone.layers.{i}."
        state |= {
            prefix + "norm.weight": layers.norm.scale[i],
            prefix + "mixer.in_proj.weight": mixer.in_proj.kernel[i].T,  # Linear: (out, in)
            prefix + "mixer.conv1d.weight": mixer.conv1d.kernel[i].T[:, None, :],  # (channels, 1, d_conv)
            prefix + "mixer.conv1d.bias": mixer.conv1d.bias[i],
            prefix + "mixer.dt_bias": mixer.dt_bias[i],
            prefix + "mixer.A_log": mixer.A_log[i],
            prefix + "mixer.D": mixer.D[i],
            prefix + "mixer.norm.weight": mixer.norm.scale[i],
            prefix + "mixer.out_proj.weight": mixer.out_proj.kernel[i].T,
        }
    return {name: np.ascontiguousarray(value) for name, value in state.items()}


def _assert_same_params(actual, expected):
    actual_state, expected_state = nnx.state(actual, nnx.Param), nnx.state(expected, nnx.Param)
    assert jax.tree.structure(actual_state) == jax.tree.structure(expected_state)
    for a, e in zip(jax.tree.leaves(actual_state), jax.tree.leaves(expected_state)):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(a, e)


def test_checkpoint_save_load_round_trip_is_exact(tmp_path, tiny_config):
    config = tiny_config.replace(vocab_size=64, tie_embeddings=False)  # vocab already padded: config kept too
    model = _random_model(config)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mamba2"
    loaded = load_pretrained(tmp_path, backend="xla")
    assert loaded.config == config
    _assert_same_params(loaded, model)
    ids = jnp.arange(16).reshape(2, 8)
    np.testing.assert_array_equal(nnx.jit(lambda m: m(ids))(loaded), nnx.jit(lambda m: m(ids))(model))


def test_checkpoint_loads_mamba_ssm_and_hf_named_state_dicts(tmp_path, tiny_config):
    model = _random_model(tiny_config)
    mamba_ssm_dir, hf_dir = tmp_path / "mamba_ssm", tmp_path / "hf"
    mamba_ssm_dir.mkdir()
    hf_dir.mkdir()
    # mamba_ssm: one model.safetensors and mamba_ssm's config.json.
    config = tiny_config
    (mamba_ssm_dir / "config.json").write_text(json.dumps({
        "d_model": config.d_model, "n_layer": config.n_layer, "vocab_size": config.vocab_size,
        "ssm_cfg": {"layer": "Mamba2", **config.ssm_cfg}, "d_intermediate": 0, "attn_layer_idx": [],
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": config.pad_vocab_size_multiple, "tie_embeddings": True}))
    save_file(_torch_state_dict(model, "backbone.embedding.weight"), mamba_ssm_dir / "model.safetensors")
    # HF transformers: two shards with an index, and HF's config.json.
    hf_state = _torch_state_dict(model, "backbone.embeddings.weight")
    names = sorted(hf_state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({name: hf_state[name] for name in shard_names}, hf_dir / file)
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: file for file, shard_names in shards.items() for name in shard_names}}))
    (hf_dir / "config.json").write_text(json.dumps(config.to_hf()))

    from_mamba_ssm = load_pretrained(mamba_ssm_dir, backend="xla")
    from_hf = load_pretrained(hf_dir, backend="xla")
    assert from_mamba_ssm.config == config
    assert from_hf.config.padded_vocab_size == config.padded_vocab_size
    _assert_same_params(from_mamba_ssm, model)
    _assert_same_params(from_hf, model)


def test_checkpoint_load_lists_unknown_and_unassigned_keys(tmp_path, tiny_config):
    model = _random_model(tiny_config)
    state = _torch_state_dict(model, "backbone.embedding.weight")
    del state["backbone.layers.1.mixer.A_log"], state["backbone.norm_f.weight"]
    state["backbone.layers.0.mixer.x_proj.weight"] = np.zeros((2, 2), np.float32)
    state["backbone.layers.7.norm.weight"] = np.zeros((32,), np.float32)  # beyond n_layer
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    with pytest.raises(ValueError, match=r"unknown keys \['backbone.layers.0.mixer.x_proj.weight', "
                                         r"'backbone.layers.7.norm.weight'\]; unassigned parameters "
                                         r"\['layers.mixer.A_log\[layers \[1\]\]', 'norm_f.scale'\]"):
        load_pretrained(tmp_path)


def test_checkpoint_orbax_round_trip(tmp_path, tiny_config):
    model = _random_model(tiny_config)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Mamba2LMHeadModel(
        tiny_config, backend="xla", rngs=nnx.Rngs(0))))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", abstract_state))
    _assert_same_params(restored, model)
