"""Cases, random inputs and the float64 oracle of the decode ops' kernels (`jax_mamba2.decode`), shared by the
emulator, op and GPU tests.

Inputs are stacks of `layers` layers (the LM's layout); the oracle is `jax_mamba2.decode_reference` on the case's
layer, in float64.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mamba2 import decode_reference


def _cast(a, dtype):
    return a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


@dataclasses.dataclass(frozen=True)
class ProjectionCase:
    rows: int
    features: int
    out_features: int
    layers: int = 3
    layer: int = 1
    norm: bool = True
    group_size: Optional[int] = None
    residual: str = "none"          # "none", "first" (no residual input, the stream written), "add"
    gate: str = "none"              # "none", "before", "after" (norm_before_gate)
    z_offset: int = 0
    transpose_weight: bool = False
    bias: bool = False
    dtype: str = "float32"          # x's, z's, the output's
    weight_dtype: str = "float32"

    @property
    def z_width(self) -> int:
        return self.z_offset + self.features + 16

    def kwargs(self) -> dict:
        """The op's static keywords (what `jax_mamba2.norm_project` takes besides the arrays)."""
        return dict(group_size=self.group_size, norm_before_gate=self.gate == "after",
                    transpose_weight=self.transpose_weight, z_offset=self.z_offset,
                    residual_dtype=None if self.residual == "none" else "float32")


PROJECTION_CASES = {
    "add_norm_in_proj": ProjectionCase(rows=3, features=64, out_features=200, residual="add"),
    "first_block_in_proj": ProjectionCase(rows=2, features=64, out_features=80, residual="first", layer=0),
    "gated_norm_out_proj": ProjectionCase(rows=3, features=64, out_features=48, group_size=32, gate="before",
                                          z_offset=32),
    "gate_after_norm": ProjectionCase(rows=1, features=96, out_features=40, gate="after", layer=2),
    "plain_with_bias": ProjectionCase(rows=5, features=48, out_features=72, norm=False, bias=True),
    "tied_head": ProjectionCase(rows=2, features=64, out_features=100, layers=1, layer=0, residual="add",
                                transpose_weight=True),
    "two_row_blocks": ProjectionCase(rows=70, features=32, out_features=24, norm=False),
    "bf16": ProjectionCase(rows=4, features=64, out_features=96, residual="add", dtype="bfloat16",
                           weight_dtype="bfloat16"),
}


def projection_inputs(case: ProjectionCase, seed: int) -> dict:
    """Random NumPy arrays of a projection case: stacked per-layer arrays, absent ones None."""
    rng = np.random.default_rng(seed)
    L, M, K, N = case.layers, case.rows, case.features, case.out_features
    weight = rng.standard_normal((L, N, K) if case.transpose_weight else (L, K, N)) / np.sqrt(K)
    return dict(
        x=_cast(rng.standard_normal((M, K)), case.dtype),
        residual=rng.standard_normal((M, K)).astype(np.float32) if case.residual == "add" else None,
        z=_cast(rng.standard_normal((M, case.z_width)), case.dtype) if case.gate != "none" else None,
        norm_weight=(1 + 0.5 * rng.standard_normal((L, K))).astype(np.float32) if case.norm else None,
        weight=_cast(weight, case.weight_dtype),
        bias=_cast(rng.standard_normal((L, N)), case.weight_dtype) if case.bias else None,
    )


def projection_oracle(case: ProjectionCase, arrays: dict) -> dict:
    """{"out", "residual_out" (when the case writes the stream)} in float64: decode_reference on the case's layer."""
    with jax.enable_x64(True):
        f64 = {k: None if v is None else jnp.asarray(np.asarray(v, np.float64)) for k, v in arrays.items()}
        layer, K, kw = case.layer, case.features, case.kwargs()
        z = f64["z"]
        out, residual_out = decode_reference.norm_project(
            f64["x"], f64["weight"][layer], norm_weight=None if f64["norm_weight"] is None else f64["norm_weight"][layer],
            residual=f64["residual"], residual_dtype=None if kw["residual_dtype"] is None else jnp.float64,
            z=None if z is None else z[:, case.z_offset:case.z_offset + K], group_size=kw["group_size"],
            norm_before_gate=kw["norm_before_gate"], eps=1e-5,
            bias=None if f64["bias"] is None else f64["bias"][layer], transpose_weight=case.transpose_weight,
            dtype=jnp.float64)
        result = {"out": np.asarray(out)}
        if residual_out is not None:
            result["residual_out"] = np.asarray(residual_out)
        return result


@dataclasses.dataclass(frozen=True)
class MixerCase:
    rows: int = 2
    nheads: int = 8
    headdim: int = 16
    ngroups: int = 2
    dstate: int = 16
    d_conv: int = 4
    layers: int = 3
    layer: int = 1
    gate: bool = False              # the step applies silu(z) (a mixer without the gated norm)
    d_per_channel: bool = False
    conv_bias: bool = True
    dt_limit: tuple = (0.0, float("inf"))
    dtype: str = "float32"          # zxbcdt's
    state_dtype: str = "float32"

    @property
    def d_ssm(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.ngroups * self.dstate

    def layout(self) -> dict:
        """The op's layout keywords: in_proj's output [z, xBC, dt] (z present either way, as in the mixer)."""
        return dict(nheads=self.nheads, headdim=self.headdim, ngroups=self.ngroups, dstate=self.dstate,
                    xbc_offset=self.d_ssm, dt_offset=self.d_ssm + self.conv_dim,
                    z_offset=0 if self.gate else None, dt_limit=self.dt_limit)

    @property
    def in_width(self) -> int:
        return 2 * self.d_ssm + 2 * self.ngroups * self.dstate + self.nheads


MIXER_CASES = {
    "gated_norm_mixer": MixerCase(),
    "gate_in_step": MixerCase(gate=True, d_per_channel=True, conv_bias=False, dt_limit=(0.01, 0.5), layer=2),
    "one_head_per_group": MixerCase(nheads=4, ngroups=4, headdim=32, dstate=32, layer=0),
    "conv_width_3": MixerCase(d_conv=3, rows=3),
    "bf16": MixerCase(dtype="bfloat16", state_dtype="bfloat16", rows=3),
}


def mixer_inputs(case: MixerCase, seed: int) -> dict:
    """Random NumPy arrays of a mixer case, stacked over layers (conv_bias None without one)."""
    rng = np.random.default_rng(seed)
    L, M, H, P, N = case.layers, case.rows, case.nheads, case.headdim, case.dstate
    return dict(
        zxbcdt=_cast(rng.standard_normal((M, case.in_width)), case.dtype),
        conv_state=_cast(rng.standard_normal((L, M, case.conv_dim, case.d_conv)), case.state_dtype),
        conv_weight=(rng.standard_normal((L, case.d_conv, case.conv_dim)) / case.d_conv).astype(np.float32),
        conv_bias=rng.standard_normal((L, case.conv_dim)).astype(np.float32) if case.conv_bias else None,
        A_log=rng.uniform(-1.0, 1.5, (L, H)).astype(np.float32),
        dt_bias=rng.uniform(-3.0, 0.0, (L, H)).astype(np.float32),
        D=rng.standard_normal((L, H, P) if case.d_per_channel else (L, H)).astype(np.float32),
        ssm_state=_cast(rng.standard_normal((L, M, H, P, N)), case.state_dtype),
    )


def mixer_oracle(case: MixerCase, arrays: dict) -> dict:
    """{"y", "ssm_state" (the stack, the case's layer advanced), "new_conv_state"} in float64."""
    with jax.enable_x64(True):
        f64 = {k: None if v is None else jnp.asarray(np.asarray(v, np.float64)) for k, v in arrays.items()}
        layer = case.layer
        y, state, conv = decode_reference.mixer_step(
            f64["zxbcdt"], *(None if f64[k] is None else f64[k][layer] for k in (
                "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")), **case.layout())
        stack = np.array(np.asarray(arrays["ssm_state"], np.float64))
        stack[layer] = np.asarray(state)
        return {"y": np.asarray(y), "ssm_state": stack, "new_conv_state": np.asarray(conv)}


def assert_lm_steps_match(models: dict, caches: dict, tokens, tolerance: float, donate: bool = False) -> None:
    """Feeds the same tokens (steps, batch) through the `step` of `models["cutile"]` and `models["xla"]` from their
    `caches`: the logits of every step and the final decode states agree within `tolerance` (relative L2)."""
    from flax import nnx

    from tests._helpers import rel_l2

    steps = {b: nnx.jit(lambda m, t, c: m.step(t, c), donate_argnums=2 if donate else ()) for b in models}
    caches = dict(caches)
    for token in tokens:
        logits = {}
        for b, model in models.items():
            logits[b], caches[b] = steps[b](model, token, caches[b])
        assert rel_l2(logits["cutile"], logits["xla"]) < tolerance
    for got, want in zip(caches["cutile"], caches["xla"]):
        assert rel_l2(got, want) < tolerance
