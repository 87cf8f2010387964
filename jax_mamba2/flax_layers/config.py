"""`Mamba2Config`: the language-model configuration, with mamba_ssm field names and published presets.

The fields are those of mamba_ssm's `MambaConfig` (the `config.json` of the `state-spaces/mamba2-*`
checkpoints); `ssm_cfg` holds the keyword arguments of the `Mamba2` mixer. `from_mamba_ssm` reads such a
`config.json` dict, `from_hf` reads a HuggingFace transformers `Mamba2Config` dict, and `to_hf` writes one.
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
from flax.core import FrozenDict

from jax_mamba2.checks import (as_int, check_axis_length, check_dt_limit, check_element_count, check_flag,
                               check_positive_float, check_size)
from jax_mamba2.flax_layers.mixer_options import check_mixer_options

# Keyword arguments of `Mamba2.__init__` that may appear in `ssm_cfg` (all but d_model and the dtype/backend
# options, which belong to the model rather than the checkpoint).
MIXER_OPTIONS = (
    "d_state", "d_conv", "conv_init", "expand", "headdim", "d_ssm", "ngroups", "A_init_range", "D_has_hdim", "rmsnorm",
    "norm_before_gate", "norm_eps", "dt_min", "dt_max", "dt_init_floor", "dt_limit", "bias", "conv_bias",
    "chunk_size",
)
# Keyword arguments of mamba_ssm's `Mamba2` that choose how it computes, not what: accepted in `ssm_cfg` and
# dropped, so that a config.json saved with them (e.g. use_mem_eff_path=False for its unfused path) loads.
MIXER_IMPLEMENTATION_OPTIONS = ("use_mem_eff_path", "sequence_parallel")
# mamba_ssm's `Mamba2` defaults, used when `ssm_cfg` does not set an option (`norm_eps`, the gated norm's
# epsilon, is not an option of mamba_ssm's, which fixes it at 1e-5; HF's Mamba2 takes `layer_norm_epsilon`).
MIXER_DEFAULTS = FrozenDict(
    d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None, ngroups=1, A_init_range=(1.0, 16.0),
    D_has_hdim=False, rmsnorm=True, norm_before_gate=False, norm_eps=1e-5, dt_min=0.001, dt_max=0.1,
    dt_init_floor=1e-4, dt_limit=(0.0, math.inf), bias=False, conv_bias=True, chunk_size=256,
)


# HF transformers' names of the mixer options `from_hf` reads (the others keep their names), and of the sizes
# the mixer's weights are checked with.
_HF_MIXER_NAMES = dict(
    d_state="state_size", d_conv="conv_kernel", headdim="head_dim", ngroups="n_groups", dt_min="time_step_min",
    dt_max="time_step_max", dt_init_floor="time_step_floor", dt_limit="time_step_limit", bias="use_bias",
    conv_bias="use_conv_bias", norm_eps="layer_norm_epsilon", d_model="hidden_size", n_layer="num_hidden_layers",
)

# How config.json files encode the unbounded upper end of `time_step_limit` (HF) / `ssm_cfg["dt_limit"]`
# (mamba_ssm): Python's json (mamba_ssm, transformers 4.x) writes the non-standard literal `Infinity`, which
# json.loads reads as inf; transformers 5.x writes standard JSON, {"__float__": "Infinity"}; JSON sanitizers
# write a string ("inf", "Infinity"), null, or a huge number (1e308, float32's largest value).
_FLOAT_TAG = "__float__"
_FLOAT32_MAX = 3.4028234663852886e38


def _parse_limit_bound(value, default: float, api: str, key: str) -> float:
    if value is None:
        return default
    if isinstance(value, Mapping) and set(value) == {_FLOAT_TAG}:
        value = value[_FLOAT_TAG]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{api}: {key} has the entry {value!r}; each must be a number, null, or an encoding of "
                     "infinity ('inf', 'Infinity', {'__float__': 'Infinity'})")


def parse_dt_limit(value, api: str, key: str) -> tuple[float, float]:
    """The time-step clip (low, high) from any of its config.json encodings (see above).

    None, or a null entry, means no clip on that side; an upper bound of at least float32's largest value clips
    nothing (the time step is computed in float32 or wider) and is read as inf, so equal models compare equal.

    Raises:
      ValueError: naming `key`, for anything but a pair of such bounds that `checks.check_dt_limit` takes (0 <= low
        <= high, low finite).
    """
    if value is None:
        return 0.0, math.inf
    if isinstance(value, np.ndarray) and value.ndim == 1:  # as `Mamba2` and the ops take it
        value = value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{api}: {key}={value!r} must be a pair [low, high]")
    low, high = (_parse_limit_bound(v, default, api, key) for v, default in zip(value, (0.0, math.inf)))
    try:
        return check_dt_limit(api, (low, math.inf if high >= _FLOAT32_MAX else high), name=key)
    except ValueError:  # named as the file spells it
        raise ValueError(f"{api}: {key}={value!r} must satisfy 0 <= min <= max with min finite") from None


def _require_keys(config: Mapping[str, Any], keys: Sequence[str], api: str, unknown: Sequence[str] = ()) -> None:
    """Raises ValueError naming the `keys` that `config` lacks, and the `unknown` keys it has instead (a misspelt
    required key is both: "n_layers" for "n_layer")."""
    missing = [key for key in keys if key not in config]
    if missing:
        instead = f"; unknown keys {list(unknown)}" if unknown else ""
        raise ValueError(f"{api}: missing required keys {missing}{instead}")


def _require_positive_ints(config: Mapping[str, Any], keys: Sequence[str], api: str) -> None:
    """Each of `keys` that `config` has must be a positive int an array axis can be (`checks.check_size`; checked
    before sizes are multiplied)."""
    for key in keys:
        check_size(api, key, config.get(key, 1))


def _require_bools(config: Mapping[str, Any], keys: Sequence[str], api: str) -> None:
    """Each of `keys` that `config` has must be a bool (a JSON "false" string must not read as true)."""
    for key in keys:
        if key in config and not isinstance(config[key], (bool, np.bool_)):
            raise TypeError(f"{api}: {key}={config[key]!r} must be a bool")


def _require_positive_numbers(config: Mapping[str, Any], keys: Sequence[str], api: str) -> None:
    """Each of `keys` that `config` has must be a positive finite int or float."""
    for key in keys:
        if key not in config:
            continue
        value = config[key]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
            raise TypeError(f"{api}: {key}={value!r} must be a number")
        if not 0 < value < math.inf:
            raise ValueError(f"{api}: {key}={value!r} must be positive and finite")


def _freeze(value):
    """JSON lists (and NumPy arrays) become tuples and NumPy scalars Python numbers, so that the config stays
    hashable (it is static data under jit) and writes as JSON."""
    if isinstance(value, np.ndarray):
        value = value.tolist()  # nested lists, or a Python number for a 0-d array
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


@dataclasses.dataclass(frozen=True, slots=True)
class Mamba2Config:
    """Configuration of `Mamba2LMHeadModel` (mamba_ssm `MambaConfig` field names).

    Attributes:
      d_model: width of the residual stream.
      n_layer: number of `Mamba2Block`s.
      vocab_size: number of tokens; the embedding has `padded_vocab_size` rows.
      ssm_cfg: keyword arguments of the `Mamba2` mixer (see `MIXER_OPTIONS`); missing ones take mamba_ssm's
        defaults. Stored without the options equal to those defaults. The mamba_ssm key "layer" is accepted
        only as "Mamba2" and dropped, as are `MIXER_IMPLEMENTATION_OPTIONS` (booleans).
      d_intermediate: width of an MLP after each mixer; only 0 (no MLP, as in all Mamba-2 checkpoints).
      rms_norm: block and final norms are RMSNorm; only True (as in all Mamba-2 checkpoints).
      residual_in_fp32: keep the residual stream in float32 (or float64 for float64 models).
      fused_add_norm: accepted for config.json compatibility; XLA fuses the add and the norm either way.
      pad_vocab_size_multiple: the embedding rows are rounded up to a multiple of this.
      tie_embeddings: the LM head reuses the embedding matrix.
      norm_epsilon: epsilon of the block and final RMSNorms.

    Raises:
      ValueError, TypeError: for a field of the wrong type or value, naming it (a mixer option as
        `ssm_cfg['name']`, checked as `Mamba2` checks it). Every size, and every width and weight they give, must
        fit the arrays the model is built of: a size, padded_vocab_size or a mixer width (d_inner, d_in_proj,
        conv_dim) at most 2**31 - 1 (JAX's int32 indices, the kernels' int32 dimensions), the embedding and each
        mixer weight stacked over the n_layer layers at most 2**60 - 1 elements (XLA's int64 byte count).
    """

    d_model: int
    n_layer: int
    vocab_size: int
    ssm_cfg: Mapping[str, Any] = FrozenDict()
    d_intermediate: int = 0
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            object.__setattr__(self, name, check_size("Mamba2Config", name, getattr(self, name)))
        if not isinstance(self.ssm_cfg, Mapping):
            raise TypeError(f"Mamba2Config: ssm_cfg={self.ssm_cfg!r} must be a mapping of Mamba2 options (a JSON "
                            "object)")
        for name in ("rms_norm", "residual_in_fp32", "fused_add_norm", "tie_embeddings"):
            object.__setattr__(self, name, check_flag("Mamba2Config", name, getattr(self, name)))
        object.__setattr__(self, "norm_epsilon", check_positive_float("Mamba2Config", "norm_epsilon",
                                                                      self.norm_epsilon))
        d_intermediate = as_int(self.d_intermediate)
        if d_intermediate is None:
            raise TypeError(f"Mamba2Config: d_intermediate={self.d_intermediate!r} must be the int 0")
        if d_intermediate != 0:
            raise ValueError(f"Mamba2Config: d_intermediate={self.d_intermediate!r} must be 0 (MLP sub-blocks "
                             "are not supported)")
        if not self.rms_norm:
            raise ValueError("Mamba2Config: rms_norm=False must be True (LayerNorm blocks are not supported)")
        object.__setattr__(self, "d_intermediate", d_intermediate)
        ssm_cfg = dict(self.ssm_cfg)
        layer = ssm_cfg.pop("layer", "Mamba2")
        if layer != "Mamba2":
            raise ValueError(f"Mamba2Config: ssm_cfg['layer']={layer!r} must be 'Mamba2'")
        for name in MIXER_IMPLEMENTATION_OPTIONS:
            if name in ssm_cfg:
                check_flag("Mamba2Config", f"ssm_cfg[{name!r}]", ssm_cfg.pop(name))
        unknown = sorted(set(ssm_cfg) - set(MIXER_OPTIONS))
        if unknown:
            raise ValueError(f"Mamba2Config: ssm_cfg has unknown keys {unknown}; allowed: {list(MIXER_OPTIONS)}")
        if "dt_limit" in ssm_cfg:
            ssm_cfg["dt_limit"] = parse_dt_limit(ssm_cfg["dt_limit"], "Mamba2Config", "ssm_cfg['dt_limit']")
        expand, d_ssm = ssm_cfg.get("expand", MIXER_DEFAULTS["expand"]), ssm_cfg.get("d_ssm")
        if None not in (as_int(expand), as_int(d_ssm)) and d_ssm == expand * self.d_model:  # else checked below
            del ssm_cfg["d_ssm"]  # the default (d_inner) spelled out
        ssm_cfg = {k: _freeze(v) for k, v in sorted(ssm_cfg.items())}
        # By value too, as the mixers will be built from them: a config no model can be made of fails here.
        check_mixer_options("Mamba2Config", self.d_model, {**MIXER_DEFAULTS, **ssm_cfg},
                            {name: f"ssm_cfg[{name!r}]" for name in MIXER_OPTIONS}, n_layer=self.n_layer)
        check_axis_length("Mamba2Config", f"vocab_size={self.vocab_size} rounded up to a multiple of "
                          f"pad_vocab_size_multiple={self.pad_vocab_size_multiple}: padded_vocab_size",
                          self.padded_vocab_size)
        check_element_count("Mamba2Config", "the embedding", "(padded_vocab_size, d_model)",
                            (self.padded_vocab_size, self.d_model))
        # Canonical form: only options that differ from mamba_ssm's defaults, so equal models compare equal.
        options = {k: v for k, v in ssm_cfg.items() if v != MIXER_DEFAULTS[k]}
        object.__setattr__(self, "ssm_cfg", FrozenDict(options))

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the LM head: vocab_size rounded up to pad_vocab_size_multiple."""
        multiple = self.pad_vocab_size_multiple
        return -(-self.vocab_size // multiple) * multiple

    @property
    def mixer_options(self) -> dict[str, Any]:
        """All `Mamba2` keyword options: `ssm_cfg` completed with mamba_ssm's defaults."""
        return {**MIXER_DEFAULTS, **self.ssm_cfg}

    def replace(self, **changes) -> "Mamba2Config":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mamba_ssm(cls, config: Mapping[str, Any]) -> "Mamba2Config":
        """From a mamba_ssm `config.json` dict (the `state-spaces/mamba2-*` format).

        Raises:
          ValueError: for a missing d_model, n_layer or vocab_size (naming the unknown keys too: one may be a
            misspelling of it), for attention layers (`attn_layer_idx`), which this package does not implement,
            for keys that are not `MambaConfig` fields, or for an `ssm_cfg` without "layer", which mamba_ssm
            reads as a Mamba-1 model.
          TypeError: for an `ssm_cfg["use_mem_eff_path"]` or `["sequence_parallel"]` that is not a bool (the
            options are read and dropped: they pick mamba_ssm's kernels, not the model).
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"Mamba2Config.from_mamba_ssm: config={config!r} must be a mapping (a config.json dict)")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields - {"attn_layer_idx", "attn_cfg"})
        _require_keys(config, ("d_model", "n_layer", "vocab_size"), "Mamba2Config.from_mamba_ssm", unknown)
        config = dict(config)
        attn_layer_idx = config.pop("attn_layer_idx", [])
        config.pop("attn_cfg", None)
        if attn_layer_idx:
            raise ValueError(f"Mamba2Config.from_mamba_ssm: attn_layer_idx={attn_layer_idx} must be empty "
                             "(hybrid attention models are not supported)")
        if unknown:
            raise ValueError(f"Mamba2Config.from_mamba_ssm: unknown keys {unknown}")
        ssm_cfg = config.get("ssm_cfg", {})
        if isinstance(ssm_cfg, Mapping) and "layer" not in ssm_cfg:  # mamba_ssm's create_block: Mamba1 then
            raise ValueError(f"Mamba2Config.from_mamba_ssm: ssm_cfg={dict(ssm_cfg)!r} has no 'layer', which "
                             "mamba_ssm reads as 'Mamba1' (a Mamba-1 checkpoint); this package runs Mamba-2 only "
                             "(ssm_cfg['layer'] must be 'Mamba2')")
        return cls(**config)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Mamba2Config":
        """From a HuggingFace transformers `Mamba2Config` dict (`model_type` "mamba2").

        HF stores the padded vocabulary size in `vocab_size`; it is kept as is (with
        `pad_vocab_size_multiple` when the dict has it) unless the dict also has `to_hf`'s extra keys
        (`unpadded_vocab_size`, ...), which restore the exact configuration. `time_step_limit` may be in any
        of its encodings (see `parse_dt_limit`). A key the dict leaves out takes transformers' default (n_groups
        8, state_size 128, head_dim 64, ...). HF's gated norm is full-width in its PyTorch path even for
        n_groups > 1; this package follows mamba_ssm (group-wise), as HF's CUDA path does.

        Raises:
          TypeError: naming HF's key, for a flag that is not a bool (use_bias, tie_word_embeddings, ...), a
            time step / epsilon that is not a number or a size that is not an int (hidden_size,
            num_hidden_layers, vocab_size, expand, head_dim, num_heads, state_size, conv_kernel, n_groups,
            chunk_size, ...).
          ValueError: for a missing hidden_size, num_hidden_layers or vocab_size, a size under 1 or over 2**31 - 1
            (an array axis), sizes whose weights no array holds (those a `Mamba2Config` refuses, see there, named
            by HF's keys: a mixer's weights stacked over num_hidden_layers, the embedding of vocab_size rows of
            hidden_size), a time step or epsilon that is not positive, a model_type other than "mamba2",
            `num_heads * head_dim != expand * hidden_size` (HF's own invariant), mixer options no `Mamba2` can be
            built from (named by HF's keys: a chunk_size that is not a power of two, n_groups not dividing the
            heads, ...), or an unpadded_vocab_size that does not pad to vocab_size.
        """
        api = "Mamba2Config.from_hf"
        if not isinstance(config, Mapping):
            raise TypeError(f"{api}: config={config!r} must be a mapping (a config.json dict)")
        _require_keys(config, ("hidden_size", "num_hidden_layers", "vocab_size"), api)
        # Checked under HF's own key names, before they are renamed into the mixer's options.
        _require_positive_ints(config, ("hidden_size", "num_hidden_layers", "vocab_size", "expand", "head_dim",
                                        "num_heads", "unpadded_vocab_size", "pad_vocab_size_multiple",
                                        "state_size", "conv_kernel", "n_groups", "chunk_size"), api)
        _require_bools(config, ("use_bias", "use_conv_bias", "rms_norm", "residual_in_fp32", "fused_add_norm",
                                "tie_word_embeddings"), api)
        _require_positive_numbers(config, ("time_step_min", "time_step_max", "time_step_floor",
                                           "layer_norm_epsilon"), api)
        if config.get("model_type", "mamba2") != "mamba2":
            raise ValueError(f"{api}: model_type={config['model_type']!r} must be 'mamba2'")
        if config.get("hidden_act", "silu") not in ("silu", "swish"):  # HF's conv activation; mamba_ssm's is SiLU
            raise ValueError(f"{api}: hidden_act={config['hidden_act']!r} must be 'silu' (or 'swish')")
        get = config.get
        # Python ints: the weights' element counts checked below are products of them, which NumPy ints of a
        # config built in Python (not read from JSON) could wrap around.
        d_model, n_layer = as_int(config["hidden_size"]), as_int(config["num_hidden_layers"])
        expand, head_dim = get("expand", 2), get("head_dim", 64)
        if "num_heads" in config and config["num_heads"] * head_dim != expand * d_model:
            raise ValueError(f"Mamba2Config.from_hf: num_heads={config['num_heads']} * head_dim={head_dim} "
                             f"must equal expand={expand} * hidden_size={d_model}")
        ssm_cfg = dict(
            d_state=get("state_size", 128), d_conv=get("conv_kernel", 4), expand=expand, headdim=head_dim,
            ngroups=get("n_groups", 8), dt_min=get("time_step_min", 0.001), dt_max=get("time_step_max", 0.1),
            dt_init_floor=get("time_step_floor", 1e-4),
            dt_limit=parse_dt_limit(get("time_step_limit"), api, "time_step_limit"),
            bias=get("use_bias", False), conv_bias=get("use_conv_bias", True), chunk_size=get("chunk_size", 256),
            norm_eps=get("layer_norm_epsilon", 1e-5),  # HF's mixer norm takes the blocks' epsilon
            A_init_range=get("A_init_range", MIXER_DEFAULTS["A_init_range"]),
            conv_init=get("conv_init", MIXER_DEFAULTS["conv_init"]),
        )
        # The sizes `Mamba2Config` checks again, checked first under HF's keys (the weights stacked over
        # num_hidden_layers, the embedding of vocab_size rows), so that an error names what config.json spells.
        check_mixer_options(api, d_model, {**MIXER_DEFAULTS, **ssm_cfg}, _HF_MIXER_NAMES, n_layer=n_layer)
        vocab_size, multiple = get("unpadded_vocab_size", config["vocab_size"]), get("pad_vocab_size_multiple", 1)
        padded_vocab_size = -(-vocab_size // multiple) * multiple
        if padded_vocab_size != config["vocab_size"]:
            unpadded_key = "unpadded_vocab_size" if "unpadded_vocab_size" in config else "vocab_size"
            raise ValueError(f"{api}: vocab_size={config['vocab_size']} (the embedding rows) must equal "
                             f"{unpadded_key}={vocab_size} rounded up to a multiple of "
                             f"pad_vocab_size_multiple={multiple}, which is {padded_vocab_size}")
        check_element_count(api, "the embedding", "(vocab_size, hidden_size)", (config["vocab_size"], d_model))
        return cls(
            d_model=d_model, n_layer=n_layer, vocab_size=vocab_size, ssm_cfg=ssm_cfg,
            rms_norm=get("rms_norm", True), residual_in_fp32=get("residual_in_fp32", True),
            fused_add_norm=get("fused_add_norm", True), pad_vocab_size_multiple=multiple,
            tie_embeddings=get("tie_word_embeddings", False), norm_epsilon=get("layer_norm_epsilon", 1e-5),
        )

    def to_hf(self) -> dict[str, Any]:
        """A HuggingFace transformers `Mamba2Config` dict (for `config.json`), vocabulary padded, plus the
        keys HF has no field for (`unpadded_vocab_size`, `pad_vocab_size_multiple`, `A_init_range`,
        `conv_init`, `fused_add_norm`), so that `from_hf(to_hf(config)) == config`.

        Raises:
          ValueError: for mixer options HF's Mamba2 cannot express (norm_before_gate=True, D_has_hdim=True,
            d_ssm != expand * d_model, rmsnorm=False, a norm_eps other than norm_epsilon).
        """
        mixer = self.mixer_options
        d_inner = mixer["expand"] * self.d_model
        unsupported = {
            "norm_before_gate": mixer["norm_before_gate"], "D_has_hdim": mixer["D_has_hdim"],
            "rmsnorm": not mixer["rmsnorm"], "d_ssm": mixer["d_ssm"] not in (None, d_inner),
            # HF's one `layer_norm_epsilon` serves the blocks' norms and the mixer's gated norm
            "norm_eps": not math.isclose(mixer["norm_eps"], self.norm_epsilon, rel_tol=1e-6),  # float32 rounding
        }
        bad = sorted(name for name, is_bad in unsupported.items() if is_bad)
        if bad:
            values = ", ".join(f"{name}={mixer[name]!r}" for name in bad)
            raise ValueError(f"Mamba2Config.to_hf: ssm_cfg options {bad} ({values}; norm_epsilon="
                             f"{self.norm_epsilon!r}) have no HF transformers equivalent; keep mamba_ssm defaults "
                             "for them (norm_eps: equal to norm_epsilon) or checkpoint with Orbax")
        return {
            "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
            "hidden_size": self.d_model, "num_hidden_layers": self.n_layer, "vocab_size": self.padded_vocab_size,
            "state_size": mixer["d_state"], "conv_kernel": mixer["d_conv"], "expand": mixer["expand"],
            "head_dim": mixer["headdim"], "num_heads": d_inner // mixer["headdim"], "n_groups": mixer["ngroups"],
            "time_step_min": mixer["dt_min"], "time_step_max": mixer["dt_max"],
            "time_step_floor": mixer["dt_init_floor"], "time_step_limit": list(mixer["dt_limit"]),
            "use_bias": mixer["bias"], "use_conv_bias": mixer["conv_bias"], "chunk_size": mixer["chunk_size"],
            "rms_norm": self.rms_norm, "residual_in_fp32": self.residual_in_fp32,
            "tie_word_embeddings": self.tie_embeddings, "layer_norm_epsilon": self.norm_epsilon,
            "hidden_act": "silu",
            # Fields HF's Mamba2Config lacks (its vocab_size is the padded one): HF keeps unknown config.json
            # keys as attributes and writes them back, and `from_hf` reads them.
            "unpadded_vocab_size": self.vocab_size, "pad_vocab_size_multiple": self.pad_vocab_size_multiple,
            "A_init_range": list(mixer["A_init_range"]), "conv_init": mixer["conv_init"],
            "fused_add_norm": self.fused_add_norm,
        }


def _preset(d_model: int, n_layer: int):
    def preset(**override) -> Mamba2Config:
        fields = dict(d_model=d_model, n_layer=n_layer, vocab_size=50277, ssm_cfg={"layer": "Mamba2"},
                      pad_vocab_size_multiple=16, tie_embeddings=True)
        return Mamba2Config(**{**fields, **override})

    preset.__doc__ = (f"`state-spaces/mamba2` preset: d_model={d_model}, n_layer={n_layer}, vocab 50277 padded "
                      "to 50288, mixer defaults (d_state 128, headdim 64, expand 2, ngroups 1). Fields in "
                      "`override` replace the preset's.")
    return preset


mamba2_130m = _preset(768, 24)
mamba2_370m = _preset(1024, 48)
mamba2_780m = _preset(1536, 48)
mamba2_1_3b = _preset(2048, 48)
mamba2_2_7b = _preset(2560, 64)
