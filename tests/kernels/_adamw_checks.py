"""Cases, inputs and the float64 oracle of AdamW's update kernel (kernels/adamw.py), shared by its emulator and GPU
tests. The oracle is `jax_mamba2.adamw_reference` in float64 on the same (rounded) arrays."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mamba2.adamw_reference import AdamWHyper, adamw_update
from jax_mamba2.kernels.adamw import HYPER_FIELDS

# A mid-training step (t = 7) with a clipping gradient scale.
STEP = 7
HYPER = dict(learning_rate=3e-3, b1=0.9, one_minus_b1=0.1, b2=0.95, one_minus_b2=0.05, eps=1e-8, eps_root=1e-12,
             weight_decay=0.1,
             bias_correction1=1 - 0.9 ** STEP, bias_correction2=1 - 0.95 ** STEP, grad_scale=0.75)


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))


def make_inputs(size: int, seed: int, dtypes=("float32",) * 4) -> dict[str, np.ndarray]:
    """Random parameter, gradient and moments (a second moment of the gradient's scale, positive), and the
    step's scalars as the kernel's float32 `hyper` array."""
    rng = np.random.default_rng(seed)
    grad_scale = rng.uniform(0.5, 2.0)
    values = dict(param=rng.standard_normal(size), grad=grad_scale * rng.standard_normal(size),
                  mu=0.1 * rng.standard_normal(size), nu=0.01 * rng.random(size) + 1e-6)
    arrays = {name: as_dtype(v, dtype) for (name, v), dtype in zip(values.items(), dtypes)}
    arrays["hyper"] = np.array([HYPER[f] for f in HYPER_FIELDS], np.float32)
    return arrays


def oracle(arrays: dict, decay: bool) -> dict[str, np.ndarray]:
    """(param, mu, nu) of one step in float64 from the arrays as stored (and the float32 scalars)."""
    with jax.enable_x64(True):
        f64 = {n: jnp.asarray(np.asarray(arrays[n], np.float64)) for n in ("param", "grad", "mu", "nu", "hyper")}
        out = adamw_update(f64["param"], f64["grad"], f64["mu"], f64["nu"], AdamWHyper(*f64["hyper"]), decay=decay)
        return {n: np.asarray(o) for n, o in zip(("param", "mu", "nu"), out)}


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def step_error(got: dict, arrays: dict, want: dict) -> float:
    """The relative L2 error of the step taken (param' - param: the update, not the parameter it is added to) and
    of the moments, the largest of the three."""
    param = np.asarray(arrays["param"], np.float64)
    return max(rel_error(np.asarray(got["param"], np.float64) - param, want["param"] - param),
               rel_error(got["mu"], want["mu"]), rel_error(got["nu"], want["nu"]))


def output_error(got: dict, want: dict) -> float:
    """The largest relative L2 error of the outputs (param', mu', nu') themselves: for arrays in a low precision,
    whose rounding can exceed a step's size."""
    return max(rel_error(got[name], want[name]) for name in ("param", "mu", "nu"))
