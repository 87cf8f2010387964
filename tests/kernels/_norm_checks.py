"""Cases, inputs and the float64 oracle of the RMSNorm kernels (kernels/rms_norm.py, rms_norm_bwd.py), shared by
their emulator and GPU tests."""
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import norm_reference
from jax_mamba2.bridge import norm_ops
from jax_mamba2.kernels.rms_norm import NormDims

EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class NormCase:
    """One norm problem: `gate` None, "before" (x * silu(z) is normalized, Mamba-2's default) or "after"
    (norm_before_gate); `residual`: the add + norm (ungated, one group), the residual stream in float32;
    `weight_dtype`: the weight's (a bf16 model's parameters)."""

    rows: int
    features: int
    group_size: Optional[int] = None
    gate: Optional[str] = None
    residual: bool = False
    dtype: str = "float32"
    weight_dtype: str = "float32"

    @property
    def norm_before_gate(self) -> bool:
        return self.gate == "after"

    @property
    def out_dtype(self) -> str:
        return self.dtype

    def dims(self) -> NormDims:
        shape_only = jax.ShapeDtypeStruct((self.rows, self.features), jnp.dtype(self.dtype))
        residual = jax.ShapeDtypeStruct(shape_only.shape, jnp.float32) if self.residual else None
        weight = jax.ShapeDtypeStruct((self.features,), jnp.dtype(self.weight_dtype))
        return norm_ops.norm_dims(shape_only, shape_only if self.gate else None, residual, weight,
                                  group_size=self.group_size or self.features, norm_before_gate=self.norm_before_gate,
                                  eps=EPS, out_dtype=self.out_dtype, residual_dtype="float32")


# Odd row counts (a partial last row block), every gate placement, several groups, a group that is not a power
# of two (zero-padded tiles), the add + norm.
CASES = {
    "plain_odd_rows": NormCase(rows=37, features=48),
    "gate_before_groups3": NormCase(rows=37, features=48, group_size=16, gate="before"),
    "gate_after_groups3": NormCase(rows=37, features=48, group_size=16, gate="after"),
    "gate_before_group24": NormCase(rows=19, features=48, group_size=24, gate="before"),
    "gate_after_one_group": NormCase(rows=5, features=64, gate="after"),
    "add_norm": NormCase(rows=37, features=40, residual=True),
}


def make_inputs(case: NormCase, seed: int) -> dict[str, np.ndarray]:
    """Fresh random operands and output cotangents (no zeros): x, z, residual, weight, dout, dresidual_out."""
    keys = jax.random.split(jax.random.key(seed), 6)
    shape = (case.rows, case.features)
    normal = lambda key, shape, dtype: np.asarray(jax.random.normal(key, shape, jnp.float32).astype(dtype))  # noqa
    arrays = dict(x=normal(keys[0], shape, case.dtype),
                  weight=np.asarray((1.0 + 0.2 * jax.random.normal(keys[2], (case.features,)))
                                    .astype(case.weight_dtype)),
                  dout=normal(keys[4], shape, case.out_dtype))
    if case.gate:
        arrays["z"] = normal(keys[1], shape, case.dtype)
    if case.residual:
        arrays["residual"] = normal(keys[3], shape, np.float32)
        arrays["dresidual_out"] = normal(keys[5], shape, np.float32)
    return arrays


def oracle(case: NormCase, arrays: dict) -> dict[str, np.ndarray]:
    """The float64 reference's outputs ("out", and "residual_out" for the add + norm) and the gradients ("dx",
    "dz", "dresidual", "dweight") of sum(out * dout) (+ sum(residual_out * dresidual_out))."""
    with jax.enable_x64(True):
        a = {k: jnp.asarray(v, jnp.float64) for k, v in arrays.items()}

        def forward(x, z, residual, weight):
            if case.residual:
                return norm_reference.add_rms_norm(x, residual, weight, eps=EPS, residual_dtype=jnp.float64,
                                                   out_dtype=jnp.float64)
            return norm_reference.rms_norm(x, weight, z, eps=EPS, group_size=case.group_size,
                                           norm_before_gate=case.norm_before_gate), None

        primals = (a["x"], a.get("z"), a.get("residual"), a["weight"])
        (out, residual_out), vjp = jax.vjp(forward, *primals)
        dx, dz, dresidual, dweight = vjp((a["dout"], a.get("dresidual_out")))
        result = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
        return {k: np.asarray(v) for k, v in result.items() if v is not None}

