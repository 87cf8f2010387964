"""Tests of Mamba2Config (jax_mamba2/flax_layers/config.py)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import (Mamba2Config, Mamba2LMHeadModel, mamba2_1_3b, mamba2_2_7b, mamba2_130m,
                                    mamba2_370m, mamba2_780m)

# state-spaces/mamba2 config.json (mamba_ssm format) and its HF transformers conversion.
MAMBA_SSM_130M = {"d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
                  "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                  "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
                  "tie_embeddings": True}
HF_130M = {"model_type": "mamba2", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50288,
           "state_size": 128, "head_dim": 64, "num_heads": 24, "expand": 2, "n_groups": 1, "conv_kernel": 4,
           "use_bias": False, "use_conv_bias": True, "chunk_size": 256, "time_step_min": 0.001,
           "time_step_max": 0.1, "time_step_floor": 1e-4, "time_step_limit": [0.0, math.inf],
           "layer_norm_epsilon": 1e-5, "residual_in_fp32": True, "rms_norm": True, "tie_word_embeddings": True}


def _param_count(config):
    abstract = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("preset, expected", [
    (mamba2_130m, 128_989_632), (mamba2_370m, 368_346_624), (mamba2_780m, 780_161_280),
    (mamba2_1_3b, 1_343_757_312), (mamba2_2_7b, 2_702_599_680),
], ids=["130m", "370m", "780m", "1.3b", "2.7b"])
def test_config_presets_param_counts(preset, expected):
    assert _param_count(preset()) == expected


def test_config_from_mamba_ssm_and_from_hf_describe_the_same_model():
    from_mamba_ssm = Mamba2Config.from_mamba_ssm(MAMBA_SSM_130M)
    from_hf = Mamba2Config.from_hf(HF_130M)
    assert from_mamba_ssm == mamba2_130m()
    assert from_mamba_ssm.padded_vocab_size == from_hf.padded_vocab_size == 50288
    assert from_mamba_ssm.mixer_options == from_hf.mixer_options
    assert from_mamba_ssm.replace(vocab_size=50288, pad_vocab_size_multiple=1) == from_hf
    assert Mamba2Config.from_hf(from_hf.to_hf()) == from_hf
    hash(from_hf)  # static data under jit


def test_config_drops_mamba_ssm_options_that_choose_how_the_mixer_computes():
    """A config.json of a model trained with mamba_ssm's unfused path (or sequence parallelism) loads as the same
    model: those options change no output."""
    config = Mamba2Config.from_mamba_ssm({**MAMBA_SSM_130M, "ssm_cfg": {
        "layer": "Mamba2", "use_mem_eff_path": False, "sequence_parallel": True, "d_state": 64}})
    assert config == mamba2_130m(ssm_cfg={"d_state": 64})
    assert dict(config.ssm_cfg) == {"d_state": 64}


@pytest.mark.parametrize("changes, message", [
    (dict(ssm_cfg={"dstate": 64}), r"Mamba2Config: ssm_cfg has unknown keys \['dstate'\]"),
    (dict(ssm_cfg={"layer": "Mamba1"}), r"Mamba2Config: ssm_cfg\['layer'\]='Mamba1' must be 'Mamba2'"),
    (dict(d_intermediate=128), r"Mamba2Config: d_intermediate=128 must be 0"),
    (dict(n_layer=0), r"Mamba2Config: n_layer=0 must be a positive int"),
    (dict(ssm_cfg={"dt_limit": ["inf", "inf"]}), r"Mamba2Config: ssm_cfg\['dt_limit'\]=\['inf', 'inf'\] must satisfy "
     r"0 <= min <= max with min finite"),
    (dict(rms_norm=False), r"Mamba2Config: rms_norm=False must be True"),
    (dict(norm_epsilon=math.inf), r"Mamba2Config: norm_epsilon=inf must be a positive finite float"),
])
def test_config_rejects_bad_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        mamba2_130m(**changes)


@pytest.mark.parametrize("changes, message", [
    (dict(n_layer=True), r"Mamba2Config: n_layer=True must be a positive int"),
    (dict(vocab_size=50277.0), r"Mamba2Config: vocab_size=50277.0 must be a positive int"),
    (dict(ssm_cfg={"layer": "Mamba2", "headdim": "16"}),
     r"Mamba2Config: ssm_cfg\['headdim'\]='16' must be a positive int"),
    (dict(d_intermediate="0"), r"Mamba2Config: d_intermediate='0' must be the int 0"),
    (dict(d_intermediate=0.0), r"Mamba2Config: d_intermediate=0.0 must be the int 0"),
    # Checked before d_ssm is compared with expand * d_model, and a float d_ssm equal to it is refused as the
    # layer refuses it.
    (dict(ssm_cfg={"layer": "Mamba2", "expand": None}), r"Mamba2Config: ssm_cfg\['expand'\]=None must be a positive int"),
    (dict(ssm_cfg={"layer": "Mamba2", "d_ssm": 1536.0}), r"Mamba2Config: ssm_cfg\['d_ssm'\]=1536.0 must be a positive "
                                                         r"multiple of ssm_cfg\['headdim'\]=64"),
])
def test_config_rejects_sizes_that_are_not_ints_with_a_type_error(changes, message):
    with pytest.raises(TypeError, match=message):
        mamba2_130m(**changes)


@pytest.mark.parametrize("ssm_cfg, message", [
    (dict(d_state=-1), r"ssm_cfg\['d_state'\]=-1 must be a positive int"),
    (dict(expand=0), r"ssm_cfg\['expand'\]=0 must be a positive int"),
    (dict(headdim=100), r"ssm_cfg\['headdim'\]=100 must divide d_inner=ssm_cfg\['expand'\]\*d_model=1536"),
    (dict(ngroups=5), r"nheads=d_ssm//headdim=24 must be divisible by ssm_cfg\['ngroups'\]=5"),
    (dict(chunk_size=100), r"ssm_cfg\['chunk_size'\]=100 must be a power of two"),
    (dict(dt_min=0.5), r"ssm_cfg\['dt_min'\]=0.5, ssm_cfg\['dt_max'\]=0.1 must satisfy 0 < dt_min <= dt_max"),
    (dict(A_init_range=(0, 16)), r"ssm_cfg\['A_init_range'\]=\(0, 16\) must satisfy 0.0 < low <= high"),
    (dict(conv_init=-1), r"ssm_cfg\['conv_init'\]=-1 must be a positive finite float"),
])
def test_config_rejects_mixer_options_no_mixer_can_be_built_from(ssm_cfg, message):
    """Checked as `Mamba2` checks them, when the config is made: before `to_hf` writes one or a checkpoint is
    read against it."""
    with pytest.raises(ValueError, match=rf"^Mamba2Config: {message}"):
        mamba2_130m(ssm_cfg={"layer": "Mamba2", **ssm_cfg})


@pytest.mark.parametrize("changes, message", [
    (dict(chunk_size=100), r"chunk_size=100 must be a power of two"),
    (dict(n_groups=5), r"nheads=d_ssm//headdim=24 must be divisible by n_groups=5"),
    (dict(head_dim=100, num_heads=None), r"head_dim=100 must divide d_inner=expand\*hidden_size=1536"),
    (dict(time_step_min=0.5), r"time_step_min=0.5, time_step_max=0.1 must satisfy"),
    (dict(A_init_range=[0, 16]), r"A_init_range=\[0, 16\] must satisfy 0.0 < low <= high"),
])
def test_config_from_hf_names_hf_s_keys_for_mixer_options_no_mixer_can_be_built_from(changes, message):
    config = {key: value for key, value in {**HF_130M, **changes}.items() if value is not None}
    with pytest.raises(ValueError, match=rf"^Mamba2Config.from_hf: {message}"):
        Mamba2Config.from_hf(config)


@pytest.mark.parametrize("changes, message", [
    (dict(ssm_cfg=[("d_state", 8)]), r"Mamba2Config: ssm_cfg=\[\('d_state', 8\)\] must be a mapping"),
    (dict(tie_embeddings="false"), r"Mamba2Config: tie_embeddings='false' must be a bool"),
    (dict(residual_in_fp32=1), r"Mamba2Config: residual_in_fp32=1 must be a bool"),
    (dict(norm_epsilon="1e-5"), r"Mamba2Config: norm_epsilon='1e-5' must be a positive finite float"),
    (dict(ssm_cfg={"rmsnorm": "false"}), r"Mamba2Config: ssm_cfg\['rmsnorm'\]='false' must be a bool"),
    (dict(ssm_cfg={"use_mem_eff_path": "no"}), r"Mamba2Config: ssm_cfg\['use_mem_eff_path'\]='no' must be a bool"),
])
def test_config_rejects_fields_of_the_wrong_type(changes, message):
    with pytest.raises(TypeError, match=message):
        mamba2_130m(**changes)


def test_config_takes_numpy_bools_and_ints_as_python_ones():
    config = mamba2_130m(tie_embeddings=np.False_, residual_in_fp32=np.True_, d_model=np.int64(256))
    assert config.tie_embeddings is False and config.residual_in_fp32 is True and type(config.d_model) is int
    hf = Mamba2Config.from_hf({"hidden_size": np.int64(64), "num_hidden_layers": 2, "vocab_size": 100,
                               "head_dim": 16, "state_size": np.int64(16), "tie_word_embeddings": np.True_})
    assert hf.d_model == 64 and hf.tie_embeddings is True and hf.ssm_cfg["d_state"] == 16


def test_config_from_hf_takes_transformers_defaults_for_keys_left_out():
    """A hand-written config.json may leave keys out: transformers' Mamba2Config reads them as its defaults
    (n_groups 8, not mamba_ssm's 1), and so does from_hf, or the weights of a grouped model would not fit."""
    sparse = {k: HF_130M[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_heads")}
    mixer = Mamba2Config.from_hf(sparse).mixer_options
    assert (mixer["ngroups"], mixer["d_state"], mixer["headdim"], mixer["d_conv"], mixer["chunk_size"]) == (
        8, 128, 64, 4, 256)


def test_config_from_dicts_rejects_what_is_not_one_and_infinite_time_steps():
    for load in (Mamba2Config.from_hf, Mamba2Config.from_mamba_ssm):
        with pytest.raises(TypeError, match=rf"Mamba2Config.{load.__name__}: config=None must be a mapping"):
            load(None)
    with pytest.raises(ValueError, match=r"Mamba2Config.from_hf: time_step_max=inf must be positive and finite"):
        Mamba2Config.from_hf({**HF_130M, "time_step_max": float("inf")})


@pytest.mark.parametrize("key, value, error", [("hidden_size", "32", TypeError), ("num_heads", 24.0, TypeError),
                                               ("expand", True, TypeError), ("unpadded_vocab_size", 0, ValueError),
                                               ("num_hidden_layers", 2 ** 40, ValueError)])
def test_config_from_hf_rejects_sizes_that_are_not_positive_ints(key, value, error):
    with pytest.raises(error, match=rf"Mamba2Config.from_hf: {key}={value!r} must be a positive int"):
        Mamba2Config.from_hf({**HF_130M, key: value})


@pytest.mark.parametrize("changes, message", [
    pytest.param(dict(n_layer=2 ** 40), r"n_layer=1099511627776 must be a positive int of at most 2\*\*31 - 1 "
                 r"\(an array axis\)", id="n_layer"),
    pytest.param(dict(d_model=2 ** 40), r"d_model=1099511627776 must be a positive int of at most 2\*\*31 - 1",
                 id="d_model"),
    pytest.param(dict(vocab_size=2 ** 31), r"vocab_size=2147483648 must be a positive int of at most 2\*\*31 - 1",
                 id="vocab_size"),
    pytest.param(dict(ssm_cfg={"layer": "Mamba2", "d_conv": 2 ** 40}), r"ssm_cfg\['d_conv'\]=1099511627776 must be a "
                 r"positive int of at most 2\*\*31 - 1", id="mixer_option"),
    pytest.param(dict(vocab_size=2 ** 31 - 1), r"vocab_size=2147483647 rounded up to a multiple of "
                 r"pad_vocab_size_multiple=16: padded_vocab_size=2147483648 must be at most 2\*\*31 - 1",
                 id="padded_vocab_size"),
    # Each axis fits int32; the weights stacked over the layers, or the embedding, hold more elements than XLA
    # can count the bytes of.
    pytest.param(dict(n_layer=2 ** 31 - 1, d_model=2 ** 20), r"in_proj.kernel of shape \(n_layer, d_model, "
                 r"d_in_proj\)=\(2147483647, 1048576, \d+\) would hold \d+ elements; an array holds at most "
                 r"2\*\*60 - 1", id="stacked_in_proj"),
    pytest.param(dict(n_layer=1, d_model=2 ** 29 + 2 ** 20, vocab_size=2 ** 31 - 16,
                      ssm_cfg={"layer": "Mamba2", "expand": 1}),
                 r"the embedding of shape \(padded_vocab_size, d_model\)=\(2147483632, 537919488\) would hold \d+ "
                 r"elements; an array holds at most 2\*\*60 - 1", id="embedding"),
])
def test_config_rejects_sizes_no_array_of_the_model_holds(changes, message):
    """A config is refused when made, naming the size and the bound, if the model it describes could not be
    built: an axis of 2^31 or more (JAX's int32 indices) or an array of more elements than XLA counts the bytes
    of, rather than the model failing deep inside JAX (random number generation, jnp.sqrt of n_layer)."""
    with pytest.raises(ValueError, match=rf"^Mamba2Config: {message}"):
        mamba2_130m(**changes)


def test_config_accepts_stacked_weights_of_more_than_int32_elements():
    """Only axes are bounded by int32: a Codestral-sized model (d_model 4096, 64 layers, 8 groups) stacks its
    in_proj weights into an array of 4.9e9 elements, which the model builds (abstractly here)."""
    config = Mamba2Config(d_model=4096, n_layer=64, vocab_size=32768, ssm_cfg={"layer": "Mamba2", "ngroups": 8})
    model = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, rngs=nnx.Rngs(0)))
    assert math.prod(model.layers.mixer.in_proj.kernel.shape) > 2 ** 31


def test_from_mamba_ssm_names_the_unknown_key_of_a_misspelt_required_one():
    """A config.json with "n_layers" for "n_layer": the message names both, not only the one it lacks."""
    config = {**{k: v for k, v in MAMBA_SSM_130M.items() if k != "n_layer"}, "n_layers": 24}
    with pytest.raises(ValueError, match=r"^Mamba2Config.from_mamba_ssm: missing required keys \['n_layer'\]; "
                                         r"unknown keys \['n_layers'\]$"):
        Mamba2Config.from_mamba_ssm(config)


def test_config_rejects_hybrid_attention_and_hf_inexpressible_options():
    with pytest.raises(ValueError, match=r"from_mamba_ssm: attn_layer_idx=\[9, 18\] must be empty"):
        Mamba2Config.from_mamba_ssm({**MAMBA_SSM_130M, "attn_layer_idx": [9, 18]})
    with pytest.raises(ValueError, match=r"to_hf: ssm_cfg options \['D_has_hdim', 'norm_before_gate'\]"):
        mamba2_130m(ssm_cfg={"norm_before_gate": True, "D_has_hdim": True}).to_hf()


def test_config_hf_dict_round_trip_keeps_unpadded_vocab_and_every_mixer_option():
    config = mamba2_130m(vocab_size=50, pad_vocab_size_multiple=16, fused_add_norm=False,
                         ssm_cfg={"A_init_range": (2.0, 8.0), "dt_limit": (0.001, 10.0), "d_conv": 3,
                                  "conv_init": 0.05})
    hf = config.to_hf()
    assert hf["vocab_size"] == 64 and hf["unpadded_vocab_size"] == 50
    assert Mamba2Config.from_hf(hf) == config
    assert Mamba2Config.from_hf(json.loads(json.dumps(hf))) == config  # through JSON (lists, not tuples)
    with pytest.raises(ValueError, match=r"from_hf: vocab_size=80 \(the embedding rows\) must equal "
                                         r"unpadded_vocab_size=50 rounded up to a multiple of "
                                         r"pad_vocab_size_multiple=16, which is 64"):
        Mamba2Config.from_hf({**hf, "vocab_size": 80})  # e.g. resized by transformers after our save


def test_config_canonical_form_drops_options_spelled_as_their_defaults():
    assert mamba2_130m(ssm_cfg={"d_ssm": 2 * 768, "dt_limit": [0.0, "inf"]}) == mamba2_130m()
    assert mamba2_130m(ssm_cfg={"dt_limit": None}).ssm_cfg == {}
    assert mamba2_130m(ssm_cfg={"d_ssm": 768}).ssm_cfg == {"d_ssm": 768}
    # A NumPy pair, as `Mamba2` and the ops take it.
    assert mamba2_130m(ssm_cfg={"dt_limit": np.array([0.0, 1.0])}).ssm_cfg == {"dt_limit": (0.0, 1.0)}


def test_config_keeps_numpy_numbers_as_python_ones_so_it_writes_as_json():
    """NumPy scalars and arrays in the fields and options become Python numbers and tuples: the config stays
    hashable and `to_hf` gives a dict json can write."""
    config = mamba2_130m(d_model=np.int64(768), norm_epsilon=np.float32(1e-5),
                         ssm_cfg={"layer": "Mamba2", "dt_min": np.float32(0.01), "A_init_range": np.array([1.0, 8.0]),
                                  "chunk_size": np.array(128)})
    assert type(config.d_model) is int and type(config.norm_epsilon) is float
    assert mamba2_130m(norm_epsilon=jnp.float32(1e-6)).norm_epsilon == float(np.float32(1e-6))  # a JAX scalar too
    assert type(config.ssm_cfg["dt_min"]) is float and config.ssm_cfg["chunk_size"] == 128
    assert config.ssm_cfg.get("A_init_range", (1.0, 16.0)) == (1.0, 8.0)
    json.dumps(config.to_hf())
    hash(config)


def test_the_mixer_norm_takes_hf_s_layer_norm_epsilon_and_hf_cannot_hold_two_epsilons():
    """HF's Mamba2 normalizes the mixer's gated norm with `layer_norm_epsilon`, mamba_ssm's with a fixed 1e-5:
    an HF config sets the mixer's `norm_eps` too, and a config whose two epsilons differ has no HF form."""
    config = Mamba2Config.from_hf({**HF_130M, "layer_norm_epsilon": 1e-6})
    assert config.norm_epsilon == config.mixer_options["norm_eps"] == 1e-6
    model = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, rngs=nnx.Rngs(0)))
    assert model.layers.mixer.norm.eps == model.layers.norm.eps == 1e-6
    with pytest.raises(ValueError, match=r"Mamba2Config: ssm_cfg\['norm_eps'\]=0.0 must be a positive finite float"):
        mamba2_130m(ssm_cfg={"layer": "Mamba2", "norm_eps": 0.0})
    assert Mamba2Config.from_hf(config.to_hf()) == config
    assert "norm_eps" not in Mamba2Config.from_hf(HF_130M).ssm_cfg  # 1e-5: mamba_ssm's, the default
    with pytest.raises(ValueError, match=r"to_hf: ssm_cfg options \['norm_eps'\] \(norm_eps=1e-05; "
                                         r"norm_epsilon=1e-06\) have no HF transformers equivalent"):
        mamba2_130m(norm_epsilon=1e-6).to_hf()
