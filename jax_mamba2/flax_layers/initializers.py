"""Parameter initializers that reproduce mamba_ssm's (PyTorch) initialization."""
import jax
import jax.numpy as jnp


def torch_uniform(fan_in: int, bound: float | None = None):
    """PyTorch's default Linear/Conv1d init for weights and biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (kaiming_uniform with a=sqrt(5) for weights gives the same bound), or U(-bound, bound) where given (as
    `nn.init.uniform_`); drawn in float32 at least, then cast."""
    bound = 1.0 / fan_in**0.5 if bound is None else bound

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, jnp.promote_types(jnp.float32, dtype), -bound, bound).astype(dtype)

    return init


def torch_normal(stddev: float):
    """PyTorch's `nn.init.normal_(std=stddev)` (mamba_ssm's embedding init): N(0, stddev^2), drawn in float32 at
    least, then cast (a normal drawn in bfloat16 takes only 128 values, none beyond 2.9 standard deviations)."""
    def init(key, shape, dtype=jnp.float32):
        return (jax.random.normal(key, shape, jnp.promote_types(jnp.float32, dtype)) * stddev).astype(dtype)

    return init


def dt_bias_init(key, nheads: int, *, dt_min: float, dt_max: float, dt_init_floor: float, dtype):
    """mamba_ssm's dt_bias: the inverse softplus of dt ~ exp(U(log dt_min, log dt_max)), dt >= dt_init_floor,
    so that softplus(dt_bias) starts log-uniform in [dt_min, dt_max]
    (https://github.com/pytorch/pytorch/issues/72759 for the inverse: dt + log(-expm1(-dt)))."""
    wide = jnp.promote_types(jnp.float32, dtype)
    log_dt = jax.random.uniform(key, (nheads,), wide, jnp.log(dt_min), jnp.log(dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), dt_init_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def A_log_init(key, nheads: int, *, A_init_range: tuple[float, float], dtype):
    """mamba_ssm's A_log = log(A) with A ~ U(A_init_range), so A = -exp(A_log) starts in -A_init_range."""
    wide = jnp.promote_types(jnp.float32, dtype)
    low, high = A_init_range
    return jnp.log(jax.random.uniform(key, (nheads,), wide, low, high)).astype(dtype)
