"""Tests of load_pretrained / save_pretrained and Orbax checkpoints (jax_mamba2/flax_layers/checkpoint.py)."""
import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import stat
import struct
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, load_pretrained, save_pretrained
from jax_mamba2 import _files as files_module
from jax_mamba2._files import exchange_paths
from jax_mamba2 import _staging as staging_module
from jax_mamba2.flax_layers import checkpoint as checkpoint_module
from jax_mamba2.flax_layers import weight_files
from jax_mamba2.flax_layers.config import MIXER_OPTIONS
from tests._helpers import rel_l2


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


def test_load_pretrained_builds_the_unrolled_model_on_request(tmp_path, tiny_config):
    """scan_layers=False: the same parameters (stacked as always) and logits, the blocks unrolled; a flag that
    is no bool is refused before config.json is read."""
    model = _random_model(tiny_config)
    save_pretrained(model, tmp_path)
    unrolled = load_pretrained(tmp_path, backend="xla", scan_layers=False)
    assert unrolled.scan_layers is False and load_pretrained(tmp_path, backend="xla").scan_layers is True
    _assert_same_params(unrolled, model)
    ids = jnp.arange(16).reshape(2, 8)
    # the same math in another program: rounding differs, not the values (all parameters random here)
    assert rel_l2(nnx.jit(lambda m: m(ids))(unrolled), nnx.jit(lambda m: m(ids))(model)) < 1e-5
    with pytest.raises(TypeError, match="load_pretrained: scan_layers=1 must be a bool"):
        load_pretrained(tmp_path / "missing", scan_layers=1)


def test_load_pretrained_passes_the_model_s_other_options_on(tmp_path, tiny_config):
    """remat, loss_backend, check_finite, deterministic_backward, save_chunk_states reach the model as its
    constructor takes them (remat's default chunk states included); the loss and its gradients are the plain
    model's. A bad option is refused before config.json is read, naming it; an unknown one with the list."""
    model = _random_model(tiny_config)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, backend="xla", remat="matmuls", loss_backend="xla", check_finite=False,
                             deterministic_backward=True)
    built = Mamba2LMHeadModel(tiny_config, backend="xla", remat="matmuls", loss_backend="xla", check_finite=False,
                              deterministic_backward=True, rngs=nnx.Rngs(0))
    assert (loaded.remat, loaded.loss_backend) == ("matmuls", "xla")
    mixer, expected = loaded.layers.mixer, built.layers.mixer
    assert (mixer.check_finite, mixer.deterministic_backward, mixer.save_chunk_states) == (
        expected.check_finite, expected.deterministic_backward, expected.save_chunk_states) == (False, True, True)
    assert load_pretrained(tmp_path, backend="xla", save_chunk_states=False).layers.mixer.save_chunk_states is False
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, tiny_config.vocab_size)
    loss = lambda m: m.loss(ids)  # noqa: E731
    (value, grads), (plain_value, plain_grads) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (loaded, model))
    assert rel_l2(value, plain_value) < 1e-5
    # float32 rounding of another program (remat recomputes the blocks)
    assert rel_l2(grads["embedding"]["embedding"][...], plain_grads["embedding"]["embedding"][...]) < 1e-3
    with pytest.raises(ValueError, match=r'load_pretrained: remat=\'all\' must be False, "matmuls" or True'):
        load_pretrained(tmp_path / "missing", remat="all")
    with pytest.raises(TypeError, match=r"load_pretrained: check_finite=1 must be a bool"):
        load_pretrained(tmp_path / "missing", check_finite=1)
    with pytest.raises(TypeError, match=r"load_pretrained: unknown model options \['remat_policy'\]; "
                                        r"Mamba2LMHeadModel takes \['backend', 'deterministic_backward', "
                                        r"'save_chunk_states', 'check_finite', 'remat', 'scan_layers', "
                                        r"'loss_backend'\]"):
        load_pretrained(tmp_path / "missing", remat_policy="matmuls")


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
                                         r"\['layers.mixer.A_log\[layer 1\]', 'norm_f.scale'\]"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("key,change", [
    ("backbone.layers.0.mixer.conv1d.weight", lambda a: a[:, 0]),  # rank 2
    ("backbone.layers.0.mixer.conv1d.weight", lambda a: np.concatenate([a, a], axis=1)),  # (channels, 2, d_conv)
    ("backbone.layers.0.mixer.conv1d.weight", lambda a: a[:, :0]),  # (channels, 0, d_conv)
    ("backbone.layers.0.mixer.in_proj.weight", lambda a: a[0]),
    ("backbone.layers.0.mixer.in_proj.weight", lambda a: a.T),
], ids=["conv_rank_2", "conv_two_inputs", "conv_no_input", "linear_rank_1", "linear_transposed"])
def test_checkpoint_load_names_a_tensor_of_the_wrong_shape_and_the_shape_it_must_have(tmp_path, tiny_config, key,
                                                                                         change):
    """The shape asked for is the checkpoint's (PyTorch's) layout: (channels, 1, d_conv), (out, in)."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    want = state[key].shape
    state[key] = np.ascontiguousarray(change(state[key]))
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    with pytest.raises(ValueError, match=rf"load_pretrained: {tmp_path}/model.safetensors: {key}.shape=\(.*\) must be "
                                         rf"{re.escape(str(want))} \(for layers.mixer"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("dtype, name", [(np.int32, "I32"), (np.bool_, "BOOL")])
def test_checkpoint_load_refuses_a_parameter_stored_in_a_dtype_that_is_not_a_float(tmp_path, tiny_config, dtype, name):
    """An A_log stored as int32 or bool is not a parameter the model can be cast from: named, not cast."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    state["backbone.layers.1.mixer.A_log"] = state["backbone.layers.1.mixer.A_log"].astype(dtype)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    with pytest.raises(TypeError, match=rf"load_pretrained: {tmp_path}/model.safetensors: "
                                        rf"backbone.layers.1.mixer.A_log holds {name} values; a parameter must be "
                                        r"stored in a float dtype \(F64, F32, F16, BF16, F8_E4M3, F8_E5M2, F8_E8M0\)"):
        load_pretrained(tmp_path)


def test_checkpoint_load_refuses_a_parameter_given_twice_and_a_tied_head_that_is_not_the_embedding(
        tmp_path, tiny_config):
    """Two names of one parameter (both embedding spellings; a layer index written two ways), or a stored head
    that differs from the embedding it is tied to, make an ambiguous checkpoint: refused, naming the tensor."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    cases = [
        ({"backbone.embeddings.weight": state["backbone.embedding.weight"] + 1}, "a second time"),
        ({"backbone.layers.01.norm.weight": state["backbone.layers.1.norm.weight"]}, "a second time"),
    ]
    if tiny_config.tie_embeddings:
        cases.append(({"lm_head.weight": state["backbone.embedding.weight"] * 2}, "differs from the embedding"))
    for extra, message in cases:
        save_file({**state, **extra}, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            load_pretrained(tmp_path, backend="xla")
    if tiny_config.tie_embeddings:  # a stored copy of the embedding, as mamba_ssm writes it, loads (NaNs and all)
        embedding = state["backbone.embedding.weight"].copy()
        embedding[3, 1] = np.nan
        save_file({**state, "backbone.embedding.weight": embedding, "lm_head.weight": embedding},
                  tmp_path / "model.safetensors")
        loaded = load_pretrained(tmp_path, backend="xla").embedding.embedding[...]
        assert np.isnan(loaded[3, 1]) and int(np.isnan(loaded).sum()) == 1


def test_checkpoint_load_checks_a_tied_head_s_dtype_and_shape_before_reading_a_tensor(tmp_path, tiny_config,
                                                                                         monkeypatch):
    """A stored head tied to the embedding is checked from the header as the embedding is: a head of another
    shape or an integer dtype fails naming it, before any tensor is read (not as "differs" once all are)."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    embedding = state["backbone.embedding.weight"]
    reads = []
    tensors_of = weight_files._safetensors_tensors
    monkeypatch.setattr(weight_files, "_safetensors_tensors", lambda file, caller, handles: {
        name: t._replace(read=lambda t=t, name=name: reads.append(name) or t.read())
        for name, t in tensors_of(file, caller, handles).items()})
    for head, error, message in [
        (embedding[:tiny_config.vocab_size], ValueError,
         rf"lm_head.weight.shape=\({tiny_config.vocab_size}, 32\) must be \(64, 32\) \(for embedding.embedding"),
        (embedding.astype(np.int32), TypeError, r"lm_head.weight holds I32 values"),
    ]:
        save_file({**state, "lm_head.weight": np.ascontiguousarray(head)}, tmp_path / "model.safetensors")
        with pytest.raises(error, match=rf"load_pretrained: {tmp_path}/model.safetensors: {message}"):
            load_pretrained(tmp_path, backend="xla")
        assert reads == []


def test_checkpoint_loads_a_tied_embedding_stored_only_as_the_head(tmp_path, tiny_config):
    """Tied embeddings stored once, under the head's name (HF's save may keep either name of a shared tensor): the
    head is the embedding, its shape checked as the embedding's. Untied, the head is the head and the embedding is
    missing."""
    model = _random_model(tiny_config)
    assert tiny_config.tie_embeddings
    state = _torch_state_dict(model, "backbone.embedding.weight")
    state["lm_head.weight"] = state.pop("backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    save_file(state, tmp_path / "model.safetensors")
    _assert_same_params(load_pretrained(tmp_path, backend="xla"), model)
    rows = tiny_config.vocab_size  # the unpadded vocabulary, not the embedding's 64 padded rows
    save_file({**state, "lm_head.weight": np.ascontiguousarray(state["lm_head.weight"][:rows])},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"load_pretrained: {tmp_path}/model.safetensors: lm_head.weight.shape="
                                         rf"\({rows}, 32\) must be \(64, 32\) \(for embedding.embedding"):
        load_pretrained(tmp_path, backend="xla")
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.replace(tie_embeddings=False).to_hf()))
    with pytest.raises(ValueError, match=r"unknown keys \[\]; unassigned parameters \['embedding.embedding'\]"):
        load_pretrained(tmp_path, backend="xla")


def test_checkpoint_loads_a_mamba_ssm_config_that_picks_its_kernels(tmp_path, tiny_config):
    """mamba_ssm's Mamba2 takes use_mem_eff_path (fused CUDA kernels or not) from ssm_cfg, so its config.json may
    hold it; the model is the same either way."""
    model = _random_model(tiny_config)
    save_pretrained(model, tmp_path)
    ssm_cfg = {"layer": "Mamba2", **tiny_config.ssm_cfg, "use_mem_eff_path": False}
    (tmp_path / "config.json").write_text(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": ssm_cfg}))
    loaded = load_pretrained(tmp_path, backend="xla")
    assert loaded.config == tiny_config
    _assert_same_params(loaded, model)


def test_sharded_checkpoint_shards_must_hold_what_the_index_says(tmp_path, tiny_config):
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    names = sorted(state)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: state[n] for n in first}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: state[n] for n in second}, tmp_path / "model-00002-of-00002.safetensors")

    def index(weight_map):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    right = {**{n: "model-00001-of-00002.safetensors" for n in first},
             **{n: "model-00002-of-00002.safetensors" for n in second}}
    index(right)
    load_pretrained(tmp_path, backend="xla")
    index({**right, first[0]: "model-00002-of-00002.safetensors"})  # the tensor is in the other shard
    with pytest.raises(ValueError, match="each tensor in the one shard the index names"):
        load_pretrained(tmp_path, backend="xla")
    index({**right, first[0]: "../model-00001-of-00002.safetensors"})
    with pytest.raises(ValueError, match="must be a file name in the checkpoint's directory"):
        load_pretrained(tmp_path, backend="xla")


def test_sharded_checkpoint_errors_name_the_shard_that_holds_the_tensor(tmp_path, tiny_config):
    """A tensor of the wrong shape or dtype, or a tied head that is not the embedding, is named with its shard."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    d_name, a_name, head = "backbone.layers.2.mixer.D", "backbone.layers.2.mixer.A_log", "lm_head.weight"
    second = {d_name, a_name, head}
    shards = {"model-00001-of-00002.safetensors": {n: a for n, a in state.items() if n not in second},
              "model-00002-of-00002.safetensors": {n: a for n, a in state.items() if n in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, held in shards.items() for n in held}}))
    shard = tmp_path / "model-00002-of-00002.safetensors"
    save_file(shards["model-00001-of-00002.safetensors"], tmp_path / "model-00001-of-00002.safetensors")
    assert tiny_config.tie_embeddings
    for change, error, message in [
        ({d_name: state[d_name][:-1]}, ValueError, rf"{d_name}.shape=\(7,\) must be \(8,\)"),
        ({a_name: state[a_name].astype(np.int32)}, TypeError, rf"{a_name} holds I32 values"),
        ({head: state[head] + 1}, ValueError, rf"{head} differs from the embedding"),
    ]:
        save_file({**shards[shard.name], **change}, shard)
        with pytest.raises(error, match=rf"load_pretrained: {shard}: {message}"):
            load_pretrained(tmp_path, backend="xla")


def test_checkpoint_loads_sharded_pytorch_weights_and_checks_the_shards_against_the_index(tmp_path, tiny_config):
    """HF saves large PyTorch models as pytorch_model-0000N-of-0000M.bin shards with pytorch_model.bin.index.json:
    loaded as the safetensors shards are, each shard holding exactly the tensors the index gives it."""
    torch = pytest.importorskip("torch")
    model = _random_model(tiny_config)
    state = _torch_state_dict(model, "backbone.embeddings.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, shard_names in shards.items():
        torch.save({name: torch.from_numpy(np.array(state[name])) for name in shard_names}, tmp_path / file)
    right = {name: file for file, shard_names in shards.items() for name in shard_names}

    def index(weight_map):
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index(right)
    read = checkpoint_module.load_hf_state(tmp_path)
    assert sorted(read) == names
    for name, array in read.items():
        np.testing.assert_array_equal(array, state[name], err_msg=name)
    _assert_same_params(load_pretrained(tmp_path, backend="xla"), model)
    index({**right, names[0]: "pytorch_model-00002-of-00002.bin"})  # the tensor is in the other shard
    for read in (load_pretrained, checkpoint_module.load_hf_state):
        with pytest.raises(ValueError, match=rf"{read.__name__}: {tmp_path}/pytorch_model-00001-of-00002.bin holds "
                                             r".* but .*pytorch_model.bin.index.json's weight_map gives it .*each "
                                             r"tensor in the one shard the index names"):
            read(tmp_path)


def test_checkpoint_loads_a_base_model_as_a_tied_lm_and_refuses_it_untied(tmp_path, tiny_config):
    """HF's Mamba2Model (the backbone without the head) saves its tensors without the "backbone." prefix
    (embeddings.weight, layers.{i}.mixer.in_proj.weight, norm_f.weight): under a tied config it loads, the head
    being the embedding; untied, the checkpoint holds no LM head, which the error says."""
    model = _random_model(tiny_config)
    assert tiny_config.tie_embeddings
    state = {name.removeprefix("backbone."): array
             for name, array in _torch_state_dict(model, "backbone.embeddings.weight").items()}
    assert "embeddings.weight" in state and "layers.0.mixer.in_proj.weight" in state and "lm_head.weight" not in state
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    _assert_same_params(load_pretrained(tmp_path, backend="xla"), model)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.replace(tie_embeddings=False).to_hf()))
    with pytest.raises(ValueError, match=rf"load_pretrained: checkpoint {tmp_path} holds a base model without an "
                                         r"LM head .*no lm_head.weight.*tie_word_embeddings / tie_embeddings is "
                                         r"false"):
        load_pretrained(tmp_path, backend="xla")
    # Names of both kinds are no base model: the unprefixed ones are unknown.
    save_file({**state, "backbone.norm_f.weight": state.pop("norm_f.weight")}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    with pytest.raises(ValueError, match=r"unknown keys \['embeddings.weight', 'layers.0.mixer.A_log', "):
        load_pretrained(tmp_path, backend="xla")


def test_checkpoint_error_for_missing_layers_gives_runs_of_them(tmp_path, tiny_config):
    """A config.json of many more layers than the checkpoint holds names the missing ones as a run, in a short
    message, without spelling out range(n_layer) (n_layer may be up to 2^31 - 1); of fewer, it lists the first
    unknown keys and counts the rest."""
    save_pretrained(_random_model(tiny_config), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for n_layer in (10 ** 5, 2 ** 31 - 1):
        (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": n_layer}))
        with pytest.raises(ValueError, match=r"unknown keys \[\]; unassigned parameters") as raised:
            load_pretrained(tmp_path, backend="xla")
        assert f"'layers.mixer.A_log[layers 3-{n_layer - 1}]'" in str(raised.value)
        assert len(str(raised.value)) < 1000
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))  # 18 tensors unknown
    with pytest.raises(ValueError, match=r"unknown keys \['backbone.layers.1.mixer.A_log', .*, \.\.\. \(10 more\)\]; "
                                         r"unassigned parameters \[\]"):
        load_pretrained(tmp_path, backend="xla")
    missing = checkpoint_module._missing_layers
    assert missing({0, 2, 3}, 6) == "layers 1, 4-5"
    assert missing(set(range(5)), 6) == "layer 5"
    assert missing(set(range(0, 40, 2)), 40) == "layers 1, 3, 5, 7, 9, 11, 13, 15, ... (12 more runs; 20 of 40 layers)"


def test_save_over_a_checkpoint_drops_its_other_weight_files(tmp_path, tiny_config):
    """Shards, their index and PyTorch's files of the checkpoint saved over are not carried over (a reader that
    looks for them would load the old model); other files are."""
    model = _random_model(tiny_config)
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "tokenizer.json"):
        (tmp_path / name).write_text("old")
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_saved_files_get_the_permissions_the_umask_leaves(tmp_path, tiny_config):
    """The weights are as readable as any file the user writes (safetensors alone makes its file private)."""
    previous = os.umask(0o022)
    try:
        save_pretrained(_random_model(tiny_config), tmp_path / "model")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "model").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}


def test_save_refuses_paths_it_cannot_replace(tmp_path, tiny_config, monkeypatch):
    model = _random_model(tiny_config)
    with pytest.raises(TypeError, match="save_pretrained: path=None must be a str or os.PathLike"):
        save_pretrained(model, None)
    monkeypatch.chdir(tmp_path)
    for path in (".", tmp_path, tmp_path.parent):
        with pytest.raises(ValueError, match="is the working directory or holds it"):
            save_pretrained(model, path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="parent is not a directory"):
        save_pretrained(model, tmp_path / "a_file" / "checkpoint")
    long_name = tmp_path / ("c" * 240)  # a legal name; the staging name beside it must stay legal too
    save_pretrained(model, long_name)
    assert (long_name / "model.safetensors").is_file()


def test_save_succeeds_once_the_new_checkpoint_is_in_place(tmp_path, tiny_config, monkeypatch):
    """After the swap the save has happened: a failing delete of the old directory or sync of the parent does
    not turn it into an error."""
    model = _random_model(tiny_config)
    save_pretrained(model, tmp_path / "checkpoint")
    monkeypatch.setattr(files_module, "fsync", _failing_parent_fsync(files_module.fsync, tmp_path))
    save_pretrained(model, tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()


def _failing_parent_fsync(fsync, parent):
    def fsync_or_fail(path):
        if pathlib.Path(path) == parent:
            raise OSError(22, "Invalid argument")
        fsync(path)
    return fsync_or_fail


def _shifted_model(config, shift: float):
    """`_random_model(config)` with every parameter plus `shift`: the same shapes, other values."""
    model = _random_model(config)
    nnx.update(model, jax.tree.map(lambda a: a + shift, nnx.state(model, nnx.Param)))
    return model


def test_a_load_reads_one_checkpoint_while_saves_replace_it(tmp_path, tiny_config, monkeypatch):
    """A save that replaces the directory once the load has opened it leaves the load on what it opened (the
    weight files stay open); one that replaces it while the load opens it (between config.json and the weights)
    makes the load open it again, so config and weights come from one save; a directory replaced at every
    attempt is an error that says so."""
    path = tmp_path / "ckpt"
    models = [_random_model(tiny_config),
              _shifted_model(dataclasses.replace(tiny_config, norm_epsilon=1e-3,
                                                 ssm_cfg={**tiny_config.ssm_cfg, "norm_eps": 1e-3}), 1.0)]
    save_pretrained(models[0], path)
    real_open, real_tensors = weight_files.open_weights, weight_files._weight_tensors

    def open_then_save(*args, **kwargs):
        opened = real_open(*args, **kwargs)
        save_pretrained(models[1], path)
        return opened
    with monkeypatch.context() as patch:
        patch.setattr(weight_files, "open_weights", open_then_save)
        loaded = load_pretrained(path, backend="xla")
    _assert_same_params(loaded, models[0])
    # The configs differ in their epsilons (a save's round trip keeps the rest as it is).
    assert loaded.config.norm_epsilon == 1e-5 and load_pretrained(path, backend="xla").config.norm_epsilon == 1e-3

    for saves, expected in ((1, models[0]), (weight_files._OPEN_ATTEMPTS, None)):
        opened = []

        def save_while_opening(directory, caller, handles):
            opened.append(directory)
            if len(opened) <= saves:  # config.json read, the weights not yet opened: the other model, then
                save_pretrained(models[(len(opened) + 1) % 2], path)  # alternately (the directory holds models[1])
            return real_tensors(directory, caller, handles)
        with monkeypatch.context() as patch:
            patch.setattr(weight_files, "_weight_tensors", save_while_opening)
            if expected is None:
                with pytest.raises(ValueError, match=r"ckpt was replaced \(by a save to it\) each of the 3 times"):
                    load_pretrained(path, backend="xla")
                continue
            loaded = load_pretrained(path, backend="xla")
        assert len(opened) == 2
        _assert_same_params(loaded, expected)
        assert loaded.config.norm_epsilon == expected.config.norm_epsilon


def test_a_read_only_checkpoint_directory_is_saved_over_and_keeps_its_mode(tmp_path, tiny_config, monkeypatch):
    """The old directory's mode reaches the new one once its files are written (a read-only mode copied first would
    refuse them to any user but root, so the order is checked as well as the outcome), and the old directory is
    deleted whatever its mode, a read-only subdirectory carried over included."""
    path = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), path)
    (path / "tokenizer").mkdir()
    (path / "tokenizer" / "vocab.json").write_text("{}")
    (path / "tokenizer").chmod(0o555)
    path.chmod(0o555)
    modes_copied = []
    real_copymode = checkpoint_module.shutil.copymode

    def copymode(source, target):
        target = pathlib.Path(target)
        modes_copied.append((target.name, sorted(p.name for p in target.iterdir()) if target.is_dir() else None))
        real_copymode(source, target)
    monkeypatch.setattr(checkpoint_module.shutil, "copymode", copymode)
    try:
        new = _shifted_model(tiny_config, 1.0)
        save_pretrained(new, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o555
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    finally:
        path.chmod(0o755)
        (path / "tokenizer").chmod(0o755)
    staging_modes = [entries for name, entries in modes_copied if entries is not None]
    assert staging_modes == [["config.json", "model.safetensors", "tokenizer"]]  # once, after the writes
    _assert_same_params(load_pretrained(path, backend="xla"), new)


def test_removing_a_staging_tree_leaves_a_symlink_and_its_target_alone(tmp_path):
    """A staging name that is a symlink (not a save's) is neither followed to open up its target's mode nor
    deleted through."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o500)
    link = tmp_path / ".ckpt.tmp-link"
    link.symlink_to(target)
    try:
        staging_module._remove_tree(link)
        assert link.is_symlink() and stat.S_IMODE(target.stat().st_mode) == 0o500
    finally:
        target.chmod(0o700)


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



# ------------------------------------------------------------------------------------------------
# time_step_limit in every encoding that config.json writers use
# ------------------------------------------------------------------------------------------------
def _hf_config_text(config, time_step_limit_json: str) -> str:
    """config.json as transformers writes it (sorted keys, transformers-only fields), with `time_step_limit`
    spelled as the raw JSON text given."""
    hf = {key: value for key, value in config.to_hf().items()  # without the keys only this package writes
          if key not in ("unpadded_vocab_size", "pad_vocab_size_multiple", "A_init_range", "fused_add_norm")}
    hf |= {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "initializer_range": 0.1,
           "rescale_prenorm_residual": False, "time_step_rank": "auto", "use_cache": True,
           "dtype": "float32", "transformers_version": "5.0.0", "time_step_limit": "__LIMIT__"}
    return json.dumps(hf, indent=2, sort_keys=True).replace('"__LIMIT__"', time_step_limit_json) + "\n"


def _mamba_ssm_config_text(config, dt_limit_json: str) -> str:
    """config.json as mamba_ssm's save_pretrained writes it (json.dump of MambaConfig.__dict__)."""
    raw = {"d_model": config.d_model, "d_intermediate": 0, "n_layer": config.n_layer,
           "vocab_size": config.vocab_size, "ssm_cfg": {"layer": "Mamba2", **config.ssm_cfg, "dt_limit": "__LIMIT__"},
           "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
           "fused_add_norm": True, "pad_vocab_size_multiple": config.pad_vocab_size_multiple,
           "tie_embeddings": True}
    return json.dumps(raw, indent=4).replace('"__LIMIT__"', dt_limit_json)


NO_LIMIT = (0.0, math.inf)


@pytest.mark.parametrize("limit_json, expected", [
    pytest.param("[0.0, Infinity]", NO_LIMIT, id="python_json_literal"),  # mamba_ssm, transformers 4.x
    pytest.param('[0.0, {"__float__": "Infinity"}]', NO_LIMIT, id="transformers5_tag"),
    pytest.param('[{"__float__": "0.0"}, {"__float__": "Infinity"}]', NO_LIMIT, id="tag_both"),
    pytest.param('[0.0, "inf"]', NO_LIMIT, id="string_inf"),
    pytest.param('[0.0, "Infinity"]', NO_LIMIT, id="string_Infinity"),
    pytest.param("[0.0, 1e308]", NO_LIMIT, id="large_float"),
    pytest.param("[0.0, 3.4028234663852886e+38]", NO_LIMIT, id="float32_max"),
    pytest.param("[0.0, 1e999]", NO_LIMIT, id="overflowing_float"),
    pytest.param("[0.0, null]", NO_LIMIT, id="null_bound"),
    pytest.param("null", NO_LIMIT, id="null"),
    pytest.param("[0, 1e308]", NO_LIMIT, id="int_low"),
    pytest.param("[0.001, 10.0]", (0.001, 10.0), id="finite"),
])
@pytest.mark.parametrize("format_", ["hf", "mamba_ssm"])
def test_checkpoint_loads_every_time_step_limit_encoding(tmp_path, tiny_config, format_, limit_json, expected):
    model = _random_model(tiny_config)
    save_pretrained(model, tmp_path)
    write = _hf_config_text if format_ == "hf" else _mamba_ssm_config_text
    (tmp_path / "config.json").write_text(write(tiny_config, limit_json))
    loaded = load_pretrained(tmp_path, backend="xla")
    assert loaded.config.mixer_options["dt_limit"] == expected
    assert loaded.layers.mixer.dt_limit == expected
    config = tiny_config.replace(ssm_cfg={**tiny_config.ssm_cfg, "dt_limit": expected})
    if format_ == "hf":  # HF's vocab_size is the padded one
        config = config.replace(vocab_size=config.padded_vocab_size, pad_vocab_size_multiple=1)
    assert loaded.config == config
    _assert_same_params(loaded, model)


@pytest.mark.parametrize("limit_json, message", [
    pytest.param('[0.0, "unbounded"]', r"time_step_limit has the entry 'unbounded'; each must be a number, null, "
                                       r"or an encoding of infinity", id="bad_string"),
    pytest.param('[0.0, {"__float__": "NaN"}]', r"time_step_limit=\[0.0, \{'__float__': 'NaN'\}\] must satisfy "
                                                r"0 <= min <= max", id="nan"),
    pytest.param("[1.0, 0.5]", r"time_step_limit=\[1.0, 0.5\] must satisfy 0 <= min <= max", id="decreasing"),
    pytest.param('["inf", "inf"]', r"time_step_limit=\['inf', 'inf'\] must satisfy 0 <= min <= max with min finite",
                 id="infinite_min"),
    pytest.param("[0.0]", r"time_step_limit=\[0.0\] must be a pair \[low, high\]", id="one_value"),
    pytest.param('"inf"', r"time_step_limit='inf' must be a pair \[low, high\]", id="scalar"),
    pytest.param("[0.0, true]", r"time_step_limit has the entry True", id="bool"),
])
def test_checkpoint_rejects_bad_time_step_limit(tmp_path, tiny_config, limit_json, message):
    (tmp_path / "config.json").write_text(_hf_config_text(tiny_config, limit_json))
    with pytest.raises(ValueError, match=rf"load_pretrained: {tmp_path / 'config.json'}: Mamba2Config.from_hf: "
                                         + message):
        load_pretrained(tmp_path)


def test_checkpoint_loads_what_transformers_saves_and_transformers_loads_ours(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf_config = transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8, num_heads=8, expand=2,
        n_groups=1, conv_kernel=4, chunk_size=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = transformers.Mamba2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, 64, (2, 16))  # int64, as torch's embedding expects
    with torch.no_grad():
        expected = hf_model(torch.from_numpy(ids)).logits.numpy()

    model = load_pretrained(tmp_path / "hf", backend="xla")
    assert model.config.vocab_size == 64 and model.config.mixer_options["dt_limit"] == NO_LIMIT
    # float32 products as torch computes them on the CPU (a GPU runs JAX's default ones as TF32, ~1e-3 off).
    with jax.default_matmul_precision("float32"):
        logits = model(jnp.asarray(ids))
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)

    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.from_numpy(ids)).logits.numpy(), expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Round trips keep the configuration
# ------------------------------------------------------------------------------------------------
# Mixer options HF transformers has no equivalent for (save_pretrained raises on non-default values).
HF_INEXPRESSIBLE = {"d_ssm", "D_has_hdim", "rmsnorm", "norm_before_gate"}
SINGLE_VALUED_FIELDS = {"d_intermediate", "rms_norm"}  # only 0 and True are supported


def test_checkpoint_round_trip_keeps_every_config_field(tmp_path):
    config = Mamba2Config(
        d_model=48, n_layer=2, vocab_size=50,
        ssm_cfg=dict(d_state=8, d_conv=3, expand=3, headdim=16, ngroups=3, A_init_range=(2.0, 8.0),
                     dt_min=0.002, dt_max=0.05, dt_init_floor=2e-4, dt_limit=(0.001, 10.0), bias=True,
                     conv_bias=False, chunk_size=16, norm_eps=1e-6, conv_init=0.05),
        residual_in_fp32=False, fused_add_norm=False, pad_vocab_size_multiple=16, tie_embeddings=False,
        norm_epsilon=1e-6)
    # Every field and every expressible mixer option differs from its default, so none can be lost silently.
    for field in dataclasses.fields(Mamba2Config):
        if field.default is not dataclasses.MISSING and field.name not in SINGLE_VALUED_FIELDS | {"ssm_cfg"}:
            assert getattr(config, field.name) != field.default, field.name
    assert set(config.ssm_cfg) == set(MIXER_OPTIONS) - HF_INEXPRESSIBLE  # ssm_cfg holds only non-defaults

    model = _random_model(config)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, backend="xla")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(config)
    assert loaded.config == config and loaded.config.vocab_size == 50 and loaded.config.padded_vocab_size == 64
    _assert_same_params(loaded, model)


# ------------------------------------------------------------------------------------------------
# Atomic saves
# ------------------------------------------------------------------------------------------------
def _failing_writer(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"\x00" * 64)  # a partial file, as a crash mid-write leaves
    raise OSError("No space left on device")


def _snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_checkpoint_save_crash_keeps_the_old_checkpoint(tmp_path, tiny_config, monkeypatch):
    target = tmp_path / "ckpt"
    old = _random_model(tiny_config)
    save_pretrained(old, target)
    (target / "tokenizer.json").write_text("{}")
    before = _snapshot(target)

    monkeypatch.setattr(checkpoint_module, "save_file", _failing_writer)
    new = _random_model(tiny_config.replace(vocab_size=50, tie_embeddings=False))
    with pytest.raises(OSError, match="No space left on device"):
        save_pretrained(new, target)
    assert _snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left behind
    loaded = load_pretrained(target, backend="xla")
    assert loaded.config == tiny_config
    _assert_same_params(loaded, old)

    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match="No space left on device"):
        save_pretrained(new, fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # neither the target nor a staging dir


def test_checkpoint_save_syncs_files_and_the_staging_directory_before_the_rename(tmp_path, tiny_config, monkeypatch):
    """The written files and the staging directory's entries reach the disk before it is renamed into place, and the
    parent directory's entries after: a crash then leaves the old checkpoint or the whole new one."""
    events = []
    real_fsync, real_replace = files_module.fsync, checkpoint_module.replace_dir
    for module in (checkpoint_module, files_module):  # the files' syncs, and the directories' (sync_directory)
        monkeypatch.setattr(module, "fsync", lambda path: (events.append(("fsync", path)), real_fsync(path)))
    monkeypatch.setattr(checkpoint_module, "replace_dir",
                        lambda new, path: (events.append(("rename", new)), real_replace(new, path)))
    target = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), target)
    rename = events.index(next(e for e in events if e[0] == "rename"))
    staging = events[rename][1]
    synced_before = [path for kind, path in events[:rename] if kind == "fsync"]
    assert synced_before == [staging / "config.json", staging / "model.safetensors", staging]
    assert ("fsync", target.parent) in events[rename + 1:]


def _dead_pid() -> int:
    """The PID of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _partial_staging(directory: pathlib.Path, name: str, *, lock_file: bool = False) -> pathlib.Path:
    """A staging directory as a killed save leaves it, with its (unheld) lock file beside it on request."""
    staging = directory / name
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")
    if lock_file:
        staging_module._lock_path(staging).touch()
    return staging


def test_checkpoint_save_removes_only_staging_that_a_killed_save_left(tmp_path, tiny_config):
    """A save killed mid-way leaves its staging directory; the next save on the host deletes it when its
    process is gone, and keeps a live process's, another host's and a previous checkpoint set aside. These
    directories have no lock file (as a version that wrote none leaves them), so their PID field decides."""
    target = tmp_path / "ckpt"
    dead = _dead_pid()
    host = staging_module._host_tag()
    names = {"abandoned": f".ckpt.tmp-{host}-{dead}-0123abcd", "live": f".ckpt.tmp-{host}-{os.getpid()}-4567cdef",
             "other_host": f".ckpt.tmp-{host}x-{dead}-89abcdef", "set_aside": f".ckpt.old-{host}-{dead}-0123abcd",
             "other_target": f".ckpt2.tmp-{host}-{dead}-0123abcd"}
    for name in names.values():
        _partial_staging(tmp_path, name)
    save_pretrained(_random_model(tiny_config), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", *(n for k, n in names.items()
                                                                          if k != "abandoned")])
    assert load_pretrained(target, backend="xla").config == tiny_config


_HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


def test_checkpoint_save_keeps_staging_whose_lock_another_process_holds(tmp_path, tiny_config):
    """A live save in another PID namespace writes a PID that names no process here (or another one): the lock
    its process holds keeps its staging directory, whatever the PID field says."""
    pytest.importorskip("fcntl")
    host = staging_module._host_tag()
    staging = _partial_staging(tmp_path, f".ckpt.tmp-{host}-{_dead_pid()}-0123abcd", lock_file=True)
    lock = staging_module._lock_path(staging)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        save_pretrained(_random_model(tiny_config), tmp_path / "ckpt")
        assert (staging / "model.safetensors").read_bytes() == b"partial"
        assert lock.is_file()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    save_pretrained(_random_model(tiny_config), tmp_path / "ckpt")  # its process gone, the lock is free
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_cleanup_skips_the_staging_this_process_s_saves_hold(tmp_path, monkeypatch):
    """A save of this process holds its staging directory even where the file system's flock would let another
    thread of it take the lock (NFS emulates flock with per-process record locks): the cleanup skips the names
    this process's saves hold, and removes the same directory once none does."""
    pytest.importorskip("fcntl")
    host = staging_module._host_tag()
    staging = _partial_staging(tmp_path, f".ckpt.tmp-{host}-{os.getpid()}-0123abcd", lock_file=True)
    monkeypatch.setattr(staging_module, "_LIVE_STAGING", {staging.name})
    staging_module.remove_abandoned_staging(tmp_path / "ckpt")
    assert staging.is_dir() and staging_module._lock_path(staging).exists()
    staging_module._LIVE_STAGING.clear()
    staging_module.remove_abandoned_staging(tmp_path / "ckpt")
    assert not staging.exists() and not staging_module._lock_path(staging).exists()


def test_checkpoint_save_removes_staging_whose_lock_is_free(tmp_path, tiny_config):
    """A staging directory whose lock file nobody holds was left by a save that died, even where its PID field
    names a live process (here this one, which may be another namespace's PID reused); a lock file whose
    directory is gone (a save killed between the two) goes too."""
    pytest.importorskip("fcntl")
    host = staging_module._host_tag()
    _partial_staging(tmp_path, f".ckpt.tmp-{host}-{os.getpid()}-0123abcd", lock_file=True)
    orphan = staging_module._lock_path(tmp_path / f".ckpt.tmp-{host}-{os.getpid()}-4567cdef")
    orphan.touch()
    save_pretrained(_random_model(tiny_config), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_save_holds_the_lock_beside_the_staging_directory(tmp_path, tiny_config, monkeypatch):
    """While the checkpoint is written its lock file lies beside the staging directory, locked (a second open
    file description cannot take it); it never enters the checkpoint and is gone after the save, whose
    exchange may leave the old checkpoint under the staging name until deleted."""
    fcntl = pytest.importorskip("fcntl")
    target, seen = tmp_path / "ckpt", {}
    real_replace = checkpoint_module.replace_dir

    def replace_dir(new, path):
        seen["staging"], seen["entries"] = new, sorted(p.name for p in new.iterdir())
        with open(staging_module._lock_path(new), "rb") as probe:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        real_replace(new, path)

    monkeypatch.setattr(checkpoint_module, "replace_dir", replace_dir)
    for config in (tiny_config, tiny_config.replace(vocab_size=50)):  # a new target, then one to replace
        save_pretrained(_random_model(config), target)
        assert seen["entries"] == ["config.json", "model.safetensors"]
        assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert not staging_module._lock_path(seen["staging"]).exists()


def test_checkpoint_save_takes_another_name_when_a_cleanup_takes_its_new_lock_file(tmp_path, tiny_config,
                                                                                 monkeypatch):
    """Another save's cleanup may take a lock file in the instant between its creation and its lock, and delete
    it: the save then starts over under a new name rather than write into a directory without a lock file."""
    fcntl = pytest.importorskip("fcntl")
    taken = []

    def flock(fd, operation):
        if not taken:  # the cleanup wins the first file: it deletes it and holds its lock
            taken.append(pathlib.Path(os.readlink(f"/proc/self/fd/{fd}")))
            os.unlink(taken[0])
            raise BlockingIOError(11, "Resource temporarily unavailable")
        fcntl.flock(fd, operation)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name a descriptor's file")
    monkeypatch.setattr(staging_module, "fcntl", types.SimpleNamespace(
        flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    staging = []
    real_replace = checkpoint_module.replace_dir
    monkeypatch.setattr(checkpoint_module, "replace_dir",
                        lambda new, path: (staging.append(new), real_replace(new, path)))
    save_pretrained(_random_model(tiny_config), tmp_path / "ckpt")
    assert len(taken) == 1 and staging[0].name + ".lock" != taken[0].name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_save_without_fcntl_follows_the_pid_rule(tmp_path, tiny_config, monkeypatch):
    """Where `fcntl` is missing (Windows) a save writes no lock file, and the PID field alone decides, even for a
    directory that has one."""
    monkeypatch.setattr(staging_module, "fcntl", None)
    host = staging_module._host_tag()
    names = {"dead": f".ckpt.tmp-{host}-{_dead_pid()}-0123abcd", "live": f".ckpt.tmp-{host}-{os.getpid()}-4567cdef"}
    for name in names.values():
        _partial_staging(tmp_path, name, lock_file=True)
    save_pretrained(_random_model(tiny_config), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", names["dead"] + ".lock", names["live"], names["live"] + ".lock"])


def test_checkpoint_save_exchanges_the_directories_in_one_step(tmp_path, tiny_config, monkeypatch):
    """Where the system can (Linux), the new checkpoint and the old one swap names atomically: `path` is
    never renamed away, so no moment leaves it missing; the old one is deleted after, under the other name."""
    probe = [tmp_path / "a", tmp_path / "b"]
    for directory in probe:
        directory.mkdir()
    if not exchange_paths(*probe):
        pytest.skip("this system has no atomic exchange of two directories (renameat2)")
    target = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), target)
    real_replace = os.replace

    def replace(source, destination):
        assert pathlib.Path(source) != target, "the old checkpoint was renamed aside"
        real_replace(source, destination)

    monkeypatch.setattr(staging_module.os, "replace", replace)
    new = _random_model(tiny_config.replace(vocab_size=50))
    save_pretrained(new, target)
    _assert_same_params(load_pretrained(target, backend="xla"), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "ckpt"]


def test_checkpoint_save_failed_exchange_keeps_the_old_checkpoint(tmp_path, tiny_config, monkeypatch):
    target = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), target)
    before = _snapshot(target)

    def exchange(a, b):
        raise OSError("exchange failed")

    monkeypatch.setattr(staging_module, "exchange_paths", exchange)
    with pytest.raises(OSError, match="exchange failed"):
        save_pretrained(_random_model(tiny_config.replace(vocab_size=50)), target)
    assert _snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_save_failed_swap_restores_the_old_checkpoint(tmp_path, tiny_config, monkeypatch):
    """Where the directories cannot be exchanged, the old checkpoint moves aside before the new one moves in,
    and back if that fails."""
    target = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), target)
    before = _snapshot(target)
    monkeypatch.setattr(staging_module, "exchange_paths", lambda a, b: False)
    real_replace, calls = os.replace, []

    def replace(source, destination):  # the old checkpoint moves aside, then the new one fails to move in
        calls.append((source, destination))
        if len(calls) == 2:
            raise OSError("rename failed")
        real_replace(source, destination)

    monkeypatch.setattr(staging_module.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        save_pretrained(_random_model(tiny_config.replace(vocab_size=50)), target)
    assert len(calls) == 3  # aside, in (failed), back
    assert _snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_save_replaces_the_checkpoint_and_keeps_other_files(tmp_path, tiny_config):
    target = tmp_path / "ckpt"
    save_pretrained(_random_model(tiny_config), target)
    (target / "tokenizer.json").write_text('{"model": "bpe"}')
    (target / "state").mkdir()
    (target / "state" / "step").write_text("7")
    new = _random_model(tiny_config.replace(vocab_size=50))
    save_pretrained(new, target)
    assert (target / "tokenizer.json").read_text() == '{"model": "bpe"}'
    assert (target / "state" / "step").read_text() == "7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    probe = tmp_path / "probe"
    probe.mkdir()  # the mode a plain mkdir gives under this umask
    assert (target.stat().st_mode & 0o777) == (probe.stat().st_mode & 0o777)
    loaded = load_pretrained(target, backend="xla")
    assert loaded.config.vocab_size == 50
    _assert_same_params(loaded, new)

    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"save_pretrained: .*file exists and is not a directory"):
        save_pretrained(new, tmp_path / "file")


# ------------------------------------------------------------------------------------------------
# Errors from bad checkpoint files name the file and the key
# ------------------------------------------------------------------------------------------------
MAMBA_SSM_TINY = {"d_model": 32, "n_layer": 3, "vocab_size": 61,
                  "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 8}}
HF_TINY = Mamba2Config.from_mamba_ssm(MAMBA_SSM_TINY).to_hf()


@pytest.mark.parametrize("text, error, message", [
    pytest.param('{"d_model": 32,', ValueError, r"config.json is not valid JSON: Expecting property name",
                 id="truncated_json"),
    pytest.param("[1, 2]", ValueError, r"config.json must hold a JSON object, not list", id="not_an_object"),
    pytest.param("[" * 100_000 + "]" * 100_000, ValueError, r"config.json is not valid JSON: maximum recursion depth",
                 id="nested_too_deep"),
    pytest.param(json.dumps({k: v for k, v in MAMBA_SSM_TINY.items() if k != "n_layer"}), ValueError,
                 r"config.json: Mamba2Config.from_mamba_ssm: missing required keys \['n_layer'\]", id="no_n_layer"),
    pytest.param(json.dumps({k: v for k, v in MAMBA_SSM_TINY.items() if k != "d_model"}), ValueError,
                 r"config.json: Mamba2Config.from_mamba_ssm: missing required keys \['d_model'\]", id="no_d_model"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "n_layer": "3"}), TypeError,
                 r"config.json: Mamba2Config: n_layer='3' must be a positive int", id="n_layer_string"),
    pytest.param(json.dumps({"model_type": "mamba2", "hidden_size": 32, "vocab_size": 64}), ValueError,
                 r"config.json: Mamba2Config.from_hf: missing required keys \['num_hidden_layers'\]",
                 id="hf_no_num_hidden_layers"),
    pytest.param(json.dumps({"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64}),
                 ValueError, r"config.json: Mamba2Config.from_hf: model_type='mamba' must be 'mamba2'",
                 id="hf_mamba1"),
    pytest.param(json.dumps({"architectures": ["LlamaForCausalLM"]}), ValueError,
                 r"config.json has none of the keys \['d_model', 'n_layer', 'ssm_cfg'\]", id="unknown_format"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": [8, 8]}), TypeError,
                 r"config.json: Mamba2Config: ssm_cfg=\[8, 8\] must be a mapping", id="ssm_cfg_list"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": {"layer": "Mamba2", "d_state": "8"}}), TypeError,
                 r"config.json: Mamba2Config: ssm_cfg\['d_state'\]='8' must be a positive int",
                 id="mixer_option_string"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": {"layer": "Mamba2", "chunk_size": 12}}), ValueError,
                 r"config.json: Mamba2Config: ssm_cfg\['chunk_size'\]=12 must be a power of two",
                 id="mixer_option_value"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": {"d_state": 8}}), ValueError,
                 r"config.json: Mamba2Config.from_mamba_ssm: ssm_cfg=\{'d_state': 8\} has no 'layer', which "
                 r"mamba_ssm reads as 'Mamba1'", id="mamba1_checkpoint"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "ssm_cfg": {"layer": "Mamba2", "use_mem_eff_path": "no"}}),
                 TypeError, r"config.json: Mamba2Config: ssm_cfg\['use_mem_eff_path'\]='no' must be "
                 r"a bool", id="mamba_ssm_kernel_choice_string"),
    pytest.param(json.dumps({**HF_TINY, "hidden_act": "gelu"}), ValueError,
                 r"config.json: Mamba2Config.from_hf: hidden_act='gelu' must be 'silu'", id="hf_conv_activation"),
    pytest.param(json.dumps({**MAMBA_SSM_TINY, "tie_embeddings": "false"}), TypeError,
                 r"config.json: Mamba2Config: tie_embeddings='false' must be a bool", id="bool_string"),
    pytest.param(json.dumps({**HF_TINY, "head_dim": "8"}), TypeError,
                 r"config.json: Mamba2Config.from_hf: head_dim='8' must be a positive int", id="hf_size_string"),
    pytest.param(json.dumps({**HF_TINY, "layer_norm_epsilon": "1e-5"}), TypeError,
                 r"config.json: Mamba2Config.from_hf: layer_norm_epsilon='1e-5' must be a number",
                 id="hf_epsilon_string"),
    pytest.param(json.dumps({**HF_TINY, "time_step_min": "0.001"}), TypeError,
                 r"config.json: Mamba2Config.from_hf: time_step_min='0.001' must be a number",
                 id="hf_mixer_option_string"),
    pytest.param(json.dumps({**HF_TINY, "time_step_floor": 0}), ValueError,
                 r"config.json: Mamba2Config.from_hf: time_step_floor=0 must be positive", id="hf_number_zero"),
    pytest.param(json.dumps({**HF_TINY, "state_size": "8"}), TypeError,
                 r"config.json: Mamba2Config.from_hf: state_size='8' must be a positive int", id="hf_state_size"),
    pytest.param(json.dumps({**HF_TINY, "tie_word_embeddings": "false"}), TypeError,
                 r"config.json: Mamba2Config.from_hf: tie_word_embeddings='false' must be a bool",
                 id="hf_bool_string"),
])
def test_checkpoint_bad_config_file_errors_name_file_and_key(tmp_path, text, error, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(error, match=rf"load_pretrained: {tmp_path}/{message}"):
        load_pretrained(tmp_path)
    if not message.startswith(r"config.json: Mamba2: "):  # the mixer's own checks run when the model is built
        with pytest.raises(error, match=rf"load_config: {tmp_path}/{message}"):
            checkpoint_module.load_config(tmp_path)


@pytest.mark.parametrize("weights", [None, b"not safetensors"], ids=["no_weights", "unreadable_weights"])
def test_checkpoint_config_errors_come_before_the_weights_are_opened(tmp_path, monkeypatch, weights):
    """config.json is checked, and the model built from it, before any weight file is opened: a config no model can
    be made of is named as config.json's fault whatever the weights are (missing, unreadable, or large)."""
    opened = []
    tensors_of = weight_files._weight_tensors
    monkeypatch.setattr(weight_files, "_weight_tensors",
                        lambda path, caller, handles: opened.append(path) or tensors_of(path, caller, handles))
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    for config, message in [
        ({**MAMBA_SSM_TINY, "ssm_cfg": {**MAMBA_SSM_TINY["ssm_cfg"], "chunk_size": 12}}, "must be a power of two"),
        # Sizes no array holds: a longer axis than JAX indexes, a stacked weight of more elements than XLA counts.
        ({**MAMBA_SSM_TINY, "n_layer": 2 ** 40}, r"n_layer=1099511627776 must be a positive int of at most 2\*\*31 - 1"),
        ({**MAMBA_SSM_TINY, "n_layer": 2 ** 31 - 1, "d_model": 2 ** 20}, r"in_proj.kernel of shape \(n_layer, "
         r"d_model, d_in_proj\)=\(2147483647, 1048576, \d+\) would hold \d+ elements; an array holds at most "
         r"2\*\*60 - 1"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=rf"load_pretrained: {tmp_path}/config.json: .*{message}"):
            load_pretrained(tmp_path)
        assert opened == []


_HF_SIZES = {key: value for key, value in HF_TINY.items() if key != "num_heads"}  # num_heads follows the width


@pytest.mark.parametrize("changes, message", [
    pytest.param(dict(num_hidden_layers=2 ** 40), r"num_hidden_layers=1099511627776 must be a positive int of at "
                 r"most 2\*\*31 - 1", id="layers_over_int32"),
    pytest.param(dict(num_hidden_layers=-3), r"num_hidden_layers=-3 must be a positive int", id="negative_layers"),
    # Each axis fits int32; the weights stacked over the layers, or the embedding, hold more elements than XLA counts.
    pytest.param(dict(num_hidden_layers=2 ** 31 - 1, hidden_size=2 ** 20),
                 r"in_proj.kernel of shape \(num_hidden_layers, hidden_size, d_in_proj\)=\(2147483647, 1048576, \d+\) "
                 r"would hold \d+ elements", id="stacked_in_proj"),
    pytest.param(dict(num_hidden_layers=1, hidden_size=2 ** 29 + 2 ** 20, expand=1, vocab_size=2 ** 31 - 8,
                      unpadded_vocab_size=2 ** 31 - 8),
                 r"the embedding of shape \(vocab_size, hidden_size\)=\(2147483640, 537919488\) would hold \d+ "
                 r"elements", id="embedding"),
    pytest.param(dict(hidden_size=2 ** 30), r"d_inner=expand\*hidden_size=2147483648 must be at most 2\*\*31 - 1",
                 id="d_inner"),
])
def test_checkpoint_hf_config_size_errors_name_the_hf_keys(tmp_path, changes, message):
    """An HF config.json's sizes are named as the file spells them (num_hidden_layers, hidden_size, vocab_size),
    not by the Mamba2Config fields they become (n_layer, d_model, padded_vocab_size)."""
    (tmp_path / "config.json").write_text(json.dumps({**_HF_SIZES, **changes}))
    for read in (load_pretrained, checkpoint_module.load_config):
        with pytest.raises(ValueError, match=rf"^{read.__name__}: {tmp_path}/config.json: Mamba2Config.from_hf: "
                                             rf"{message}") as raised:
            read(tmp_path)
        assert not re.search(r"\b(n_layer|d_model|padded_vocab_size)\b", str(raised.value))


@pytest.mark.parametrize("index, error, message", [
    pytest.param({"metadata": {}}, ValueError, r"{index_file} must have the key 'weight_map'", id="no_weight_map"),
    pytest.param({"weight_map": ["a"]}, ValueError, r"{index_file} must have the key 'weight_map'",
                 id="weight_map_list"),
    pytest.param({"weight_map": {"backbone.norm_f.weight": "{shard}"}}, FileNotFoundError,
                 r"{shard}, a shard in .*{index_file}'s weight_map, does not exist", id="missing_shard"),
    pytest.param("{{", ValueError, r"{index_file} is not valid JSON", id="truncated_json"),
])
@pytest.mark.parametrize("index_file, shard", [
    ("model.safetensors.index.json", "model-00001-of-00002.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin"),  # checked before torch is needed
], ids=["safetensors", "pytorch"])
def test_checkpoint_bad_index_errors_name_file_and_key(tmp_path, tiny_config, index, error, message, index_file,
                                                       shard):
    def spell(text):
        return text.replace("{index_file}", re.escape(index_file)).replace("{shard}", shard).replace("{{", "{")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    (tmp_path / index_file).write_text(spell(index) if isinstance(index, str) else spell(json.dumps(index)))
    for read in (load_pretrained, checkpoint_module.load_hf_state):
        with pytest.raises(error, match=rf"{read.__name__}: {tmp_path}/{spell(message)}"):
            read(tmp_path)


def test_checkpoint_load_rejects_bad_arguments_before_reading_the_directory(tmp_path):
    with pytest.raises(ValueError, match=r"load_pretrained: backend='cuda' must be one of 'auto'"):
        load_pretrained(tmp_path, backend="cuda")
    for name, value in (("param_dtype", jnp.int8), ("param_dtype", None), ("dtype", "float8_e4m3fn")):
        with pytest.raises(TypeError, match=rf"load_pretrained: {name}=.* must be"):
            load_pretrained(tmp_path, **{name: value})
    for read in (load_pretrained, checkpoint_module.load_config, checkpoint_module.load_hf_state):
        with pytest.raises(TypeError, match=rf"{read.__name__}: path=None must be a str or os.PathLike"):
            read(None)


def test_checkpoint_path_missing_or_a_file_says_what_it_must_be(tmp_path, monkeypatch):
    """A hub id (nothing is downloaded) or a file of the checkpoint instead of its directory: the error says
    what path must be, not that some path/config.json is missing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    for read in (load_pretrained, checkpoint_module.load_config, checkpoint_module.load_hf_state):
        with pytest.raises(FileNotFoundError, match=rf"{read.__name__}: path='state-spaces/mamba2-130m' does not "
                                                    r"exist: it must be a local checkpoint directory"):
            read("state-spaces/mamba2-130m")
        with pytest.raises(ValueError, match=rf"{read.__name__}: path='model.safetensors' is not a directory: it must be a "
                                             r"local checkpoint directory, holding config.json and the weights"):
            read("model.safetensors")


def test_checkpoint_config_missing_or_a_directory_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"load_config: {tmp_path / 'config.json'} does not exist"):
        checkpoint_module.load_config(tmp_path)
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match=rf"load_config: {tmp_path / 'config.json'} is not a file: it must be the "
                                         r"checkpoint's JSON config"):
        checkpoint_module.load_config(tmp_path)


def test_checkpoint_truncated_weights_error_names_the_file(tmp_path, tiny_config):
    save_pretrained(_random_model(tiny_config), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"load_pretrained: {weights} is not a readable safetensors file"):
        load_pretrained(tmp_path)


def test_checkpoint_pytorch_weights_without_torch_name_the_file(tmp_path, tiny_config, monkeypatch):
    """A mamba_ssm checkpoint holds pytorch_model.bin only: without torch, an ImportError says what to do."""
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_SSM_TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    for read in (load_pretrained, checkpoint_module.load_hf_state):
        with pytest.raises(ImportError, match=rf"{read.__name__}: {tmp_path}/pytorch_model.bin needs torch"):
            read(tmp_path)


def test_checkpoint_loads_pytorch_parameters_and_floats_numpy_has_no_dtype_for(tmp_path, tiny_config):
    """A pytorch_model.bin saved from parameters (their tensors require grad) and in bfloat16 or float8 (which
    NumPy has no dtype for) loads: detached, widened to float32, which holds each value exactly."""
    torch = pytest.importorskip("torch")
    model = _random_model(tiny_config)
    arrays = _torch_state_dict(model, "backbone.embedding.weight")
    stored = {name: torch.nn.Parameter(torch.from_numpy(np.array(a))) for name, a in arrays.items()}
    stored["backbone.layers.1.mixer.A_log"] = torch.nn.Parameter(
        stored["backbone.layers.1.mixer.A_log"].detach().to(torch.bfloat16))
    stored["backbone.layers.2.mixer.D"] = stored["backbone.layers.2.mixer.D"].detach().to(torch.float8_e4m3fn)
    stored["lm_head.weight"] = stored["backbone.embedding.weight"]  # mamba_ssm's tied head: the same tensor
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_SSM_TINY))
    torch.save(stored, tmp_path / "pytorch_model.bin")
    expected = {name: t.detach().float().numpy() for name, t in stored.items()}
    read = checkpoint_module.load_hf_state(tmp_path)
    assert sorted(read) == sorted(expected)
    for name, array in read.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    loaded = load_pretrained(tmp_path, backend="xla")
    np.testing.assert_array_equal(loaded.embedding.embedding[...], arrays["backbone.embedding.weight"])
    np.testing.assert_array_equal(loaded.layers.mixer.A_log[1], expected["backbone.layers.1.mixer.A_log"])
    np.testing.assert_array_equal(loaded.layers.mixer.D[2], expected["backbone.layers.2.mixer.D"])
    np.testing.assert_array_equal(loaded.layers.mixer.D[0], arrays["backbone.layers.0.mixer.D"])


def test_checkpoint_pytorch_file_of_no_state_dict_names_the_entry(tmp_path, tiny_config):
    """A training checkpoint ({"model": state dict, ...}) is not a state dict: the entry that is no tensor is named."""
    torch = pytest.importorskip("torch")
    arrays = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_SSM_TINY))
    torch.save({"model": {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}},
               tmp_path / "pytorch_model.bin")
    for read in (load_pretrained, checkpoint_module.load_hf_state):
        with pytest.raises(ValueError, match=rf"{read.__name__}: {tmp_path}/pytorch_model.bin holds 'model': dict, "
                                             r"not a tensor; it must hold a state dict"):
            read(tmp_path)


def _damaged_pytorch_file(torch, damage: str) -> bytes:
    """A pytorch_model.bin that torch.load fails on with an error other than its own RuntimeError."""
    if damage == "zip_cut_short":  # its end of central directory gone: torch's zip reader raises OSError
        buffer = io.BytesIO()
        torch.save({f"w{i}": torch.ones(100, 100) for i in range(2)}, buffer)
        return buffer.getvalue()[:buffer.tell() // 2]
    if damage == "not_a_pickle":  # the unpickler looks up a memo entry that is not there: KeyError
        return b"hello world" * 100
    # A zip64 locator saying the archive spans two disks: zipfile.is_zipfile raises BadZipFile
    return struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 2) + struct.pack("<4s4H2LH", b"PK\x05\x06", *[0] * 7)


@pytest.mark.parametrize("damage", ["zip_cut_short", "not_a_pickle", "multi_disk_zip"])
def test_checkpoint_damaged_pytorch_file_error_names_the_file(tmp_path, damage):
    """Whatever a damaged file makes torch.load (or zipfile) raise, the load fails with a ValueError naming it."""
    torch = pytest.importorskip("torch")
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_SSM_TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(_damaged_pytorch_file(torch, damage))
    for read in (load_pretrained, checkpoint_module.load_hf_state):
        with pytest.raises(ValueError, match=rf"{read.__name__}: {tmp_path}/pytorch_model.bin is not a readable "
                                             r"PyTorch state dict: \w+"):
            read(tmp_path)


def test_checkpoint_maps_zip_format_pytorch_files_and_reads_legacy_ones_whole(tmp_path, tiny_config, monkeypatch):
    """A pytorch_model.bin in torch's zip format is memory-mapped (the host holds only the pages read), one in the
    legacy format (which cannot be) read whole: both load the same weights."""
    torch = pytest.importorskip("torch")
    model = _random_model(tiny_config)
    arrays = _torch_state_dict(model, "backbone.embedding.weight")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    mmaps, real_load = [], torch.load

    def load(*args, **kwargs):  # a wrapper of no signature: whether torch maps files is asked of torch itself
        mmaps.append(kwargs.get("mmap"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    for zip_format in (True, False):
        torch.save({name: torch.from_numpy(np.array(array)) for name, array in arrays.items()},
                   tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
        mmaps.clear()
        read = checkpoint_module.load_hf_state(tmp_path)
        assert mmaps == [True if zip_format else None]
        assert sorted(read) == sorted(arrays)
        for name, array in read.items():
            assert array.dtype == np.float32, name
            np.testing.assert_array_equal(array, arrays[name], err_msg=name)
        _assert_same_params(load_pretrained(tmp_path, backend="xla"), model)
        # What was read is the loader's own: rewriting the mapped file in place changes none of it.
        with open(tmp_path / "pytorch_model.bin", "r+b") as f:
            f.write(b"\0" * (tmp_path / "pytorch_model.bin").stat().st_size)
        for name, array in read.items():
            np.testing.assert_array_equal(array, arrays[name], err_msg=name)


def test_checkpoint_pytorch_shapes_are_checked_before_any_value_is_read(tmp_path, tiny_config, monkeypatch):
    """A PyTorch file's tensors are known by their shapes and dtypes until read: a wrong shape is refused before
    any tensor's values are converted (a bf16 file is not widened whole to find it)."""
    torch = pytest.importorskip("torch")
    arrays = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    arrays["backbone.layers.0.mixer.D"] = arrays["backbone.layers.0.mixer.D"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    torch.save({name: torch.from_numpy(np.array(a)).to(torch.bfloat16) for name, a in arrays.items()},
               tmp_path / "pytorch_model.bin")
    reads, real_array = [], weight_files._torch_array
    monkeypatch.setattr(weight_files, "_torch_array", lambda *args, **kwargs: reads.append(args[2]) or real_array(
        *args, **kwargs))
    with pytest.raises(ValueError, match=r"backbone.layers.0.mixer.D.shape="):
        load_pretrained(tmp_path, backend="xla")
    assert reads == []


def test_checkpoint_loads_safetensors_float8_widened_as_pytorch_float8(tmp_path, tiny_config):
    """safetensors' F8_E4M3, F8_E5M2 and F8_E8M0 tensors (which its NumPy reader has no dtype for) load as float32,
    as PyTorch's float8 ones do (E8M0, unsigned powers of two, from a positive tensor), read from the file as it
    was opened even once a save has replaced it."""
    model = _random_model(tiny_config)
    state = _torch_state_dict(model, "backbone.embedding.weight")
    float8 = {"backbone.layers.1.mixer.A_log": (ml_dtypes.float8_e5m2, "F8_E5M2"),
              "backbone.layers.2.mixer.D": (ml_dtypes.float8_e4m3fn, "F8_E4M3"),
              "backbone.layers.0.mixer.in_proj.weight": (ml_dtypes.float8_e4m3fn, "F8_E4M3"),
              "backbone.layers.1.mixer.dt_bias": (ml_dtypes.float8_e8m0fnu, "F8_E8M0")}
    for name, (dtype, stored) in float8.items():
        state[name] = (np.abs(state[name]) if stored == "F8_E8M0" else state[name]).astype(dtype)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    save_file(state, tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as opened:
        assert {name: opened.get_slice(name).get_dtype() for name in float8} == {
            name: stored for name, (_, stored) in float8.items()}
    expected = {name: array.astype(np.float32) for name, array in state.items()}
    read = checkpoint_module.load_hf_state(tmp_path)
    assert sorted(read) == sorted(expected)
    for name in float8:
        assert read[name].dtype == np.float32, name
        np.testing.assert_array_equal(read[name], expected[name], err_msg=name)
    loaded = load_pretrained(tmp_path, backend="xla")
    np.testing.assert_array_equal(loaded.layers.mixer.A_log[1], expected["backbone.layers.1.mixer.A_log"])
    np.testing.assert_array_equal(loaded.layers.mixer.D[2], expected["backbone.layers.2.mixer.D"])
    np.testing.assert_array_equal(loaded.layers.mixer.in_proj.kernel[0],
                                  expected["backbone.layers.0.mixer.in_proj.weight"].T)
    np.testing.assert_array_equal(loaded.layers.mixer.D[0], state["backbone.layers.0.mixer.D"])
    with contextlib.ExitStack() as handles:
        _, tensors = weight_files.open_weights(tmp_path, "load_hf_state", handles)
        save_pretrained(_shifted_model(tiny_config, 1.0), tmp_path)
        np.testing.assert_array_equal(tensors["backbone.layers.2.mixer.D"].read(),
                                      expected["backbone.layers.2.mixer.D"])


def test_checkpoint_float8_read_of_a_file_cut_short_names_the_file(tmp_path, tiny_config):
    """A safetensors file cut short in place after it was opened: reading a float8 tensor whose bytes are gone fails
    naming the file and the tensor, not with NumPy's reshape error."""
    state = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    name = "backbone.layers.2.mixer.D"
    state[name] = state[name].astype(ml_dtypes.float8_e4m3fn)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    save_file(state, tmp_path / "model.safetensors")
    file = tmp_path / "model.safetensors"
    header_end = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    with contextlib.ExitStack() as handles:
        _, tensors = weight_files.open_weights(tmp_path, "load_hf_state", handles)
        os.truncate(file, header_end)  # nothing but the header left: safetensors' own map is not read again
        with pytest.raises(ValueError, match=rf"load_hf_state: {file} is not a readable safetensors file: it ends "
                                             rf"within {name}'s bytes"):
            tensors[name].read()


def test_checkpoint_load_refuses_a_pytorch_tensor_that_is_not_a_float_by_torch_s_dtype_names(tmp_path, tiny_config):
    """A PyTorch file's integer tensor is refused listing torch's float dtypes (not safetensors' names), and one of
    a packed float dtype that torch converts to no NumPy array (float4_e2m1fn_x2) is named, not a torch error: by
    load_pretrained as no parameter dtype before anything is read, by load_hf_state (which reads it) as one NumPy
    cannot hold."""
    torch = pytest.importorskip("torch")
    arrays = _torch_state_dict(_random_model(tiny_config), "backbone.embedding.weight")
    stored = {name: torch.from_numpy(np.array(array)) for name, array in arrays.items()}
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf()))
    name = "backbone.layers.1.mixer.A_log"
    torch.save({**stored, name: stored[name].to(torch.int32)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(TypeError, match=rf"load_pretrained: {tmp_path}/pytorch_model.bin: {name} holds int32 values; "
                                        r"a parameter must be stored in a float dtype \(float64, float32, float16, "
                                        r"bfloat16, float8_e4m3fn, float8_e5m2, "):
        load_pretrained(tmp_path, backend="xla")
    if hasattr(torch, "float4_e2m1fn_x2"):
        packed = torch.zeros(arrays[name].shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        torch.save({**stored, name: packed}, tmp_path / "pytorch_model.bin")
        with pytest.raises(TypeError, match=rf"load_pretrained: {tmp_path}/pytorch_model.bin: {name} holds "
                                            r"float4_e2m1fn_x2 values; a parameter must be stored in a float dtype "
                                            r"\(float64, "):
            load_pretrained(tmp_path, backend="xla")
        with pytest.raises(TypeError, match=rf"load_hf_state: {tmp_path}/pytorch_model.bin holds {name} as a "
                                            r"torch.float4_e2m1fn_x2 tensor, which NumPy cannot hold"):
            checkpoint_module.load_hf_state(tmp_path)


def test_checkpoint_load_checks_every_name_and_shape_before_reading_a_tensor(tmp_path, tiny_config, monkeypatch):
    """From the files' headers: a config that disagrees with the tensors (here a vocabulary of 2^30 rows, whose
    float32 buffer would take 128 GiB) fails naming the tensor, with no tensor read; a good checkpoint reads each
    tensor once."""
    save_pretrained(_random_model(tiny_config), tmp_path)
    reads = []
    tensors_of = weight_files._safetensors_tensors

    def counted(file, caller, handles):
        return {name: t._replace(read=lambda t=t, name=name: reads.append(name) or t.read())
                for name, t in tensors_of(file, caller, handles).items()}
    monkeypatch.setattr(weight_files, "_safetensors_tensors", counted)
    load_pretrained(tmp_path, backend="xla")
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(checkpoint_module.load_hf_state(tmp_path))
    reads.clear()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 2 ** 30, "unpadded_vocab_size": 2 ** 30,
                                                      "pad_vocab_size_multiple": 1}))
    with pytest.raises(ValueError, match=r"backbone.embeddings.weight.shape=\(64, 32\) must be \(1073741824, 32\)"):
        load_pretrained(tmp_path, backend="xla")
    assert reads == []
