"""AdamW's update of one parameter array in one pass: read the parameter, its gradient and both moments once,
write the parameter and both moments in place.

The arithmetic of optax.adamw (chained after optax.clip_by_global_norm when grad_scale < 1), in f32 whatever
the arrays' dtypes, per element, with the step's scalars read from `hyper` (HYPER_FIELDS):

    g      = grad * grad_scale                                   (the global-norm clip's factor, or 1)
    mu'    = one_minus_b1 * g + b1 * mu
    nu'    = one_minus_b2 * g^2 + b2 * nu
    update = (mu' / bias_correction1) / (sqrt(nu' / bias_correction2 + eps_root) + eps)
             + weight_decay * param                              (DECAY only: the leaves the mask decays)
    param' = param - learning_rate * update

bias_correction1 = 1 - b1^t and bias_correction2 = 1 - b2^t at the update's step t (from 1), as optax's
`scale_by_adam` computes them; one_minus_b1 / one_minus_b2 are 1 - b1 and 1 - b2 rounded once from the exact
values (1 - float32(0.999) is 1.3e-5 off 0.001). XLA runs the same update as separate fusions that read the
moments again after writing them (or the update after writing it); here each array moves through memory once:
4 reads and 3 writes of the parameter's size, the floor of an AdamW step.

Layout: param, grad, mu, nu are flat (n,) views of one leaf (the grad and the moments may have dtypes other than
the parameter's); hyper (HYPER_SIZE,) f32. Grid (cdiv(n, BLOCK),): a block owns BLOCK consecutive elements (the
last block's past n load as zeros and are not stored). Elements are independent: a NaN gradient reaches its
own element's parameter and moments only.
"""

import dataclasses
from typing import NamedTuple, Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, Buffer, ConstBool, ConstInt, Launch, Plan, index_width_variant, int64_index_kernels, is_power_of_2)

_INT32_MAX = (1 << 31) - 1

# The step's scalars, in this order in the f32 `hyper` array.
HYPER_FIELDS = ("learning_rate", "b1", "one_minus_b1", "b2", "one_minus_b2", "eps", "eps_root", "weight_decay",
                "bias_correction1", "bias_correction2", "grad_scale")
HYPER_SIZE = len(HYPER_FIELDS)
# Elements per block in the default config: 8 KB of each f32 array, a tile the compiler keeps in registers
# (4 loads in flight per thread at 128 threads).
DEFAULT_BLOCK = 2048

ADAMW_INPUTS = ("param", "grad", "mu", "nu", "hyper")
# The parameter and the moments are written in place (the plan's outputs are its inputs).
ADAMW_OUTPUTS = ("param", "mu", "nu")


class AdamWDims(NamedTuple):
    """Static description of one leaf's update (what the kernel specialises on): `size` elements, the arrays'
    dtypes as numpy names, and whether the leaf decays (`decay`: optax.adamw's mask for it)."""

    size: int
    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    mu_dtype: str = "float32"
    nu_dtype: str = "float32"
    decay: bool = True


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """BLOCK: elements per block (a power of two); OCCUPANCY: blocks per SM the compiler budgets registers
    for (None: its choice)."""

    BLOCK: int = DEFAULT_BLOCK
    OCCUPANCY: Optional[int] = None

    def __post_init__(self):
        if not is_power_of_2(self.BLOCK) or not 128 <= self.BLOCK <= 16384:
            raise ValueError(f"AdamWConfig: BLOCK={self.BLOCK} must be a power of two in [128, 16384]")
        if self.OCCUPANCY is not None and not 1 <= self.OCCUPANCY <= 32:
            raise ValueError(f"AdamWConfig: OCCUPANCY={self.OCCUPANCY} must be None or in [1, 32]")


def needs_int64_index(dims: AdamWDims, cfg: AdamWConfig) -> bool:
    """Whether a block's element offsets can pass 2^31 - 1 (int32 offsets would overflow)."""
    return dims.size + cfg.BLOCK > _INT32_MAX


def _scalar(hyper, field):
    return ct.load(hyper, index=(field,), shape=(1,)).item()


def adamw_kernel(
    param: Big,          # (n,) written in place
    grad: Big,           # (n,)
    mu: Big,             # (n,) written in place
    nu: Big,             # (n,) written in place
    hyper,               # (HYPER_SIZE,) f32
    BLOCK: ConstInt,
    DECAY: ConstBool,    # add weight_decay * param to the update
):
    block = ct.bid(0)
    learning_rate = _scalar(hyper, 0)
    b1 = _scalar(hyper, 1)
    one_minus_b1 = _scalar(hyper, 2)
    b2 = _scalar(hyper, 3)
    one_minus_b2 = _scalar(hyper, 4)
    eps = _scalar(hyper, 5)
    eps_root = _scalar(hyper, 6)
    weight_decay = _scalar(hyper, 7)
    bias_correction1 = _scalar(hyper, 8)
    bias_correction2 = _scalar(hyper, 9)
    grad_scale = _scalar(hyper, 10)
    p = ct.load(param, index=(block,), shape=(BLOCK,), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    g = ct.load(grad, index=(block,), shape=(BLOCK,), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    m = ct.load(mu, index=(block,), shape=(BLOCK,), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    v = ct.load(nu, index=(block,), shape=(BLOCK,), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    g = g * grad_scale
    m = one_minus_b1 * g + b1 * m
    v = one_minus_b2 * (g * g) + b2 * v
    update = (m / bias_correction1) / (ct.sqrt(v / bias_correction2 + eps_root) + eps)
    if DECAY:
        update = update + weight_decay * p
    ct.store(param, index=(block,), tile=(p - learning_rate * update).astype(param.dtype))
    ct.store(mu, index=(block,), tile=m.astype(mu.dtype))
    ct.store(nu, index=(block,), tile=v.astype(nu.dtype))


# (int32-indexed, int64-indexed) entries of the one body.
ADAMW_KERNELS = int64_index_kernels(adamw_kernel)


def adamw_inputs(dims: AdamWDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it."""
    return {"param": Buffer((dims.size,), dims.param_dtype), "grad": Buffer((dims.size,), dims.grad_dtype),
            "mu": Buffer((dims.size,), dims.mu_dtype), "nu": Buffer((dims.size,), dims.nu_dtype),
            "hyper": Buffer((HYPER_SIZE,), "float32")}


def adamw_plan(dims: AdamWDims, cfg: Optional[AdamWConfig] = None) -> Plan:
    """The update of one leaf: a Plan with inputs ADAMW_INPUTS whose outputs ADAMW_OUTPUTS are the parameter and
    the moments, written in place."""
    cfg = cfg or AdamWConfig()
    launch = Launch(
        kernel=index_width_variant(ADAMW_KERNELS, needs_int64_index(dims, cfg), occupancy=cfg.OCCUPANCY),
        grid=(-(-dims.size // cfg.BLOCK),),
        args=("param", "grad", "mu", "nu", "hyper", cfg.BLOCK, dims.decay),
        writes=ADAMW_OUTPUTS,
    )
    return Plan(inputs=ADAMW_INPUTS, buffers={}, launches=(launch,), outputs=ADAMW_OUTPUTS)
