"""Paths into NNX state pytrees."""
import jax


def param_path(tree_path) -> tuple[str, ...]:
    """Attribute names of a pytree path into an nnx.State, e.g. ("mixer", "in_proj", "kernel") (the
    Variable's trailing `.value` step is dropped)."""
    return tuple(str(k.key) for k in tree_path if isinstance(k, jax.tree_util.DictKey))
