"""The `Mamba2` mixer's shape and initialization options, checked one way for the layer and for `Mamba2Config`.

A config whose `ssm_cfg` no mixer can be built from fails when the config is made (and so before `to_hf` writes
it or a checkpoint is read against it), with the same requirement `Mamba2` states.
"""
import math
from collections.abc import Mapping
from numbers import Real
from typing import NamedTuple

from jax_mamba2.checks import (check_axis_length, check_dt_limit, check_element_count, check_flag, check_int,
                               check_positive_float, check_size)
from jax_mamba2.flax_layers import _checks


class MixerShape(NamedTuple):
    """What the checked options make of the mixer's widths."""
    d_inner: int    # expand * d_model
    d_ssm: int      # the SSM's width (d_inner unless given)
    nheads: int     # d_ssm // headdim
    d_in_proj: int  # in_proj's outputs: 2 * d_inner + 2 * ngroups * d_state + nheads
    conv_dim: int   # the conv's channels: d_ssm + 2 * ngroups * d_state


def check_mixer_options(api: str, d_model: int, options: Mapping, names: Mapping[str, str] | None = None, *,
                        n_layer: int | None = None) -> tuple[dict, MixerShape]:
    """Checks the mixer `options` (every key of `config.MIXER_OPTIONS`) for a mixer of width `d_model`.

    Args:
      api: the caller named in errors ("Mamba2", "Mamba2Config").
      d_model: the residual stream's width (checked by the caller, `checks.check_size`).
      options: the options by name, all present.
      names: how the caller spells an option, for the errors (e.g. "ssm_cfg['d_state']", or HF's
        "state_size"), and d_model and n_layer (HF's "hidden_size", "num_hidden_layers"); a name not in it is
        used as it is.
      n_layer: the layers the LM stacks the mixer's parameters over (each gets a leading (n_layer,) axis), whose
        element counts are checked; None for one mixer.

    Returns:
      The options with flags as bools, norm_eps a float and dt_limit a (low, high) pair of floats, and the
      widths they give.

    Raises:
      ValueError / TypeError naming the option: a size that is not a positive int of at most 2**31 - 1, a width it
      gives (d_inner, d_in_proj, conv_dim) over 2**31 - 1 or a weight of more than 2**60 - 1 elements (with
      n_layer: stacked), a flag that is not a bool,
      d_ssm not a multiple of headdim within d_inner, nheads not divisible by ngroups, a chunk_size that is not
      a power of two, an A_init_range other than 0 < low <= high < inf, dt_min / dt_max / dt_init_floor not
      0 < dt_min <= dt_max with dt_init_floor >= 0, a dt_limit that `checks.check_dt_limit` refuses, a conv_init
      that is neither None nor a positive finite number.
    """
    def label(name):
        return (names or {}).get(name, name)

    options = dict(options)
    for name in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size"):
        options[name] = check_size(api, label(name), options[name])
    for name in ("D_has_hdim", "rmsnorm", "norm_before_gate", "bias", "conv_bias"):
        options[name] = check_flag(api, label(name), options[name])
    options["norm_eps"] = check_positive_float(api, label("norm_eps"), options["norm_eps"])
    headdim, ngroups, chunk_size = options["headdim"], options["ngroups"], options["chunk_size"]
    d_inner = options["expand"] * d_model
    check_axis_length(api, f"d_inner={label('expand')}*{label('d_model')}", d_inner)
    d_ssm = d_inner if options["d_ssm"] is None else options["d_ssm"]
    if options["d_ssm"] is None and d_inner % headdim:
        raise ValueError(f"{api}: {label('headdim')}={headdim} must divide d_inner={label('expand')}*"
                         f"{label('d_model')}={d_inner}")
    requirement = (f"a positive multiple of {label('headdim')}={headdim} and at most d_inner={label('expand')}*"
                   f"{label('d_model')}={d_inner}")
    d_ssm = check_int(api, label("d_ssm"), d_ssm, requirement)  # an axis: at most d_inner (below)
    if d_ssm > d_inner or d_ssm % headdim:
        raise ValueError(f"{api}: {label('d_ssm')}={d_ssm!r} must be {requirement}")
    nheads = d_ssm // headdim
    if nheads % ngroups:
        raise ValueError(f"{api}: nheads=d_ssm//headdim={nheads} must be divisible by {label('ngroups')}={ngroups}")
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"{api}: {label('chunk_size')}={chunk_size} must be a power of two")
    d_in_proj, conv_dim = _check_weights(api, label, d_model, options, d_inner, d_ssm, nheads, n_layer)
    A_init_range = options["A_init_range"]
    if not math.isfinite(_checks.check_range(api, label("A_init_range"), A_init_range, low_min=0.0,
                                             strict_low=True)[1]):
        raise ValueError(f"{api}: {label('A_init_range')}={A_init_range!r} must be finite")
    for name in ("dt_min", "dt_max", "dt_init_floor"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{api}: {label(name)}={value!r} must be a number")
        if not math.isfinite(value):
            raise ValueError(f"{api}: {label(name)}={value!r} must be finite")
    dt_min, dt_max = options["dt_min"], options["dt_max"]
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"{api}: {label('dt_min')}={dt_min}, {label('dt_max')}={dt_max} must satisfy 0 < dt_min "
                         "<= dt_max")
    if not options["dt_init_floor"] >= 0:
        raise ValueError(f"{api}: {label('dt_init_floor')}={options['dt_init_floor']} must be >= 0")
    options["dt_limit"] = check_dt_limit(api, options["dt_limit"], name=label("dt_limit"))
    if options["conv_init"] is not None:
        options["conv_init"] = check_positive_float(api, label("conv_init"), options["conv_init"])
    return options, MixerShape(d_inner, d_ssm, nheads, d_in_proj, conv_dim)


def _check_weights(api: str, label, d_model: int, options: Mapping, d_inner: int, d_ssm: int, nheads: int,
                   n_layer: int | None) -> tuple[int, int]:
    """(d_in_proj, conv_dim): in_proj's outputs and the conv's channels, each checked to fit an array axis, and the
    mixer's two largest weights (in_proj's and the conv's; out_proj's is smaller than in_proj's) checked to fit an
    array, stacked over `n_layer` layers where given. The vectors (biases, dt_bias, A_log, D, the norm's scale)
    are no longer than these axes."""
    groups = 2 * options["ngroups"] * options["d_state"]
    d_in_proj = 2 * d_inner + groups + nheads
    conv_dim = d_ssm + groups
    check_axis_length(api, f"d_in_proj=2*d_inner+2*{label('ngroups')}*{label('d_state')}+nheads", d_in_proj)
    check_axis_length(api, f"conv_dim=d_ssm+2*{label('ngroups')}*{label('d_state')}", conv_dim)
    layers, layer_axes = ((), "") if n_layer is None else ((n_layer,), f"{label('n_layer')}, ")
    check_element_count(api, "in_proj.kernel", f"({layer_axes}{label('d_model')}, d_in_proj)",
                        (*layers, d_model, d_in_proj))
    check_element_count(api, "conv1d.kernel", f"({layer_axes}{label('d_conv')}, conv_dim)",
                        (*layers, options["d_conv"], conv_dim))
    return d_in_proj, conv_dim
