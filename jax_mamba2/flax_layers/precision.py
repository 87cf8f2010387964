"""`cast_params`: a model's parameters converted to another dtype once, instead of at every use.

A model whose parameters are float32 but which computes in bfloat16 (`dtype=jnp.bfloat16`) converts every
weight matrix to bfloat16 inside every call: during decoding, each token step then reads the float32
weights and writes a bfloat16 copy before the matrix products read that copy. Converting the parameters
once gives the model `param_dtype=dtype` would have built (and `load_pretrained(..., param_dtype=dtype)`
loads), whose steps read each weight once, in its own dtype.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from jax_mamba2.checks import float_dtype


def cast_params(model: nnx.Module, dtype) -> nnx.Module:
    """A copy of `model` whose floating-point `nnx.Param`s are in `dtype`; other state is shared.

    The computation dtype the model was built with (`dtype=` of its layers) is unchanged; with None it is
    inferred from the parameters, so it becomes `dtype` too. The decode cache a cast model allocates by
    default (`init_cache`) follows its parameters, as in mamba_ssm.

    Args:
      model: any NNX module, e.g. a `Mamba2LMHeadModel`, concrete or abstract (`nnx.eval_shape`'s, whose
        parameters are `jax.ShapeDtypeStruct`s: the abstract model of the cast one, e.g. to restore a checkpoint of
        it into).
      dtype: a floating dtype, e.g. jnp.bfloat16.

    Returns:
      A new module of the same structure; `model` itself is not modified.

    Raises:
      TypeError: if `model` is not an NNX module, or `dtype` not one of bfloat16, float16, float32, float64 (the
        dtypes the ops take).

    Example:
      >>> model = Mamba2LMHeadModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # doctest: +SKIP
      >>> tokens = generate(cast_params(model, jnp.bfloat16), prompt_ids, 64)      # doctest: +SKIP
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"cast_params: model must be an nnx.Module, got {type(model).__name__}")
    dtype = float_dtype("cast_params", "dtype", dtype)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def cast(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return leaf.update(dtype=dtype) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf.astype(dtype)

    return nnx.merge(graphdef, jax.tree.map(cast, params), rest)
