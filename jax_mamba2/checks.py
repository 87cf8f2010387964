"""The argument checks the ops share (`op`, `conv1d`, `norm`, `decode`).

Each raises before anything runs, as "<api>: <name>... must be <requirement>", naming the argument and what it
must be: TypeError for a wrong type or dtype, ValueError for a wrong shape or value. An "array" is anything
with .shape and .dtype (also a ShapeDtypeStruct).
"""
from __future__ import annotations

import math
from numbers import Real

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
_FLOAT_NAMES = "bfloat16, float16, float32, float64"

# The longest array axis the package builds: JAX indexes and counts in int32 by default (x64 off: token ids into
# the vocabulary, a key split into one per layer, a size turned into an array), and the cuTile kernels take each
# dimension and stride as int32.
INT32_MAX = 2**31 - 1
_INT32_MAX_TEXT = "2**31 - 1"
# The most elements an array of the widest dtype the package builds (float64, 8 bytes) can hold: XLA computes an
# array's byte size in int64 and aborts the process, raising nothing, where it overflows. (Arrays of more than
# INT32_MAX elements are fine: the kernels then index in int64.)
MAX_ELEMENTS = (2**63 - 1) // 8
_MAX_ELEMENTS_TEXT = "2**60 - 1"


def check_float(api: str, name: str, arr) -> None:
    """arr.dtype is one of FLOAT_DTYPES."""
    if not any(arr.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"{api}: {name}.dtype={arr.dtype} must be one of {_FLOAT_NAMES}")


def check_ndim(api: str, name: str, arr, ndim: int, axes: str) -> tuple[int, ...]:
    """`arr` is an array (TypeError else) of `ndim` axes, named in the error by `axes` (e.g. "(batch, seqlen,
    channels)"); returns its shape."""
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{api}: {name} must be an array of shape {axes}, got {type(arr).__name__}")
    shape = arr.shape
    if len(shape) != ndim:
        raise ValueError(f"{api}: {name}.shape={shape} must be {axes}")
    return tuple(shape)


def check_array(api: str, name: str, arr, want_desc: str = "", *want: tuple[int, ...], floating: bool = True) -> None:
    """`arr` is an array whose shape is one of `want` (any shape when none is given), described by `want_desc`
    (e.g. "(batch, seqlen, nheads)"), and floating unless `floating` is False."""
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{api}: {name} must be an array, got {type(arr).__name__}")
    if want and tuple(arr.shape) not in [tuple(w) for w in want]:
        raise ValueError(f"{api}: {name}.shape={tuple(arr.shape)} must be {want_desc}="
                         f"{' or '.join(str(tuple(w)) for w in want)}")
    if floating:
        check_float(api, name, arr)


def check_seq_idx(api: str, seq_idx, batch: int, seqlen: int) -> None:
    """seq_idx is a (batch, seqlen) integer array (the ids of packed sequences) of ids JAX keeps as given."""
    check_array(api, "seq_idx", seq_idx, "(batch, seqlen)", (batch, seqlen), floating=False)
    if not jnp.issubdtype(seq_idx.dtype, jnp.integer):
        raise TypeError(f"{api}: seq_idx.dtype={seq_idx.dtype} must be an integer dtype (int32)")
    check_seq_idx_range(api, seq_idx)


def check_seq_idx_range(api: str, seq_idx) -> None:
    """A concrete `seq_idx` whose dtype JAX narrows (int64 and uint64 with x64 off, to int32 and uint32) holds no
    id the narrower dtype cannot: the conversion would wrap it onto another sequence's and join the two. (The ops
    compare ids in their own dtype and hand the kernels the sequences' int32 numbers, so any id JAX keeps is
    fine.) Read on the host as given (converting to a JAX array first would already have wrapped them); an array
    spread over other hosts' devices cannot be read here and is not checked."""
    if not is_concrete(seq_idx) or not getattr(seq_idx, "is_fully_addressable", True):
        return
    kept = np.dtype(jax.dtypes.canonicalize_dtype(seq_idx.dtype))
    if np.can_cast(seq_idx.dtype, kept):
        return
    ids = np.asarray(seq_idx)
    low, high = ids.min(), ids.max()
    if low < np.iinfo(kept).min or high > np.iinfo(kept).max:
        raise ValueError(f"{api}: seq_idx must hold ids {kept} holds (JAX's dtype for its {seq_idx.dtype}), in "
                         f"[{np.iinfo(kept).min}, {np.iinfo(kept).max}]; got ids from {low} to {high}")


def is_concrete(a) -> bool:
    """`a` holds values that can be checked (an array with elements, not a tracer nor a shape and dtype)."""
    return a is not None and not isinstance(a, (jax.core.Tracer, jax.ShapeDtypeStruct)) and np.size(a) > 0


def check_token_ids_in_range(api: str, name: str, ids, vocab_size: int, ignore_index: int | None = None) -> None:
    """Concrete ids must lie in [0, vocab_size) (or equal `ignore_index`, where given: a target left out of a loss);
    traced ids (under jit), and arrays not all on this host's devices, cannot be read and are not checked.

    Raises:
      ValueError: naming the first offending id and its index.
    """
    if isinstance(ids, jax.core.Tracer) or not getattr(ids, "is_fully_addressable", True):
        return
    values = np.asarray(ids)
    outside = (values < 0) | (values >= vocab_size)
    if ignore_index is not None:
        outside &= values != ignore_index
    bad = np.argwhere(outside)
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        allowed = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"{api}: {name} must be in [0, vocab_size={vocab_size}){allowed}; {name}"
                         f"[{', '.join(map(str, index))}]={values[index]} ({len(bad)} ids out of range)")


def nondecreasing(seq_idx):
    """Whether the (batch, seqlen) ids in `seq_idx` are nondecreasing along seqlen, as a device scalar (compared,
    not subtracted: a difference wraps around in unsigned and narrow dtypes). For a concrete `seq_idx`, under
    `jax.ensure_compile_time_eval`."""
    return jnp.all(seq_idx[:, 1:] >= seq_idx[:, :-1])


def raise_unordered_seq_idx(api: str, seq_idx) -> None:
    """The ValueError for a concrete `seq_idx` that `nondecreasing` found decreasing, naming the first place."""
    ids = np.asarray(seq_idx)
    row, position = np.argwhere(ids[:, 1:] < ids[:, :-1])[0]
    raise ValueError(f"{api}: seq_idx must be nondecreasing along seqlen; seq_idx[{row}, {position + 1}]="
                     f"{int(ids[row, position + 1])} follows {int(ids[row, position])}")


def check_seq_idx_order(api: str, seq_idx) -> None:
    """`seq_idx`, where concrete, is nondecreasing along seqlen (else the kernels and the references would
    split sequences at different tokens); a tracer's values are unknown and pass."""
    if not is_concrete(seq_idx) or seq_idx.shape[1] < 2:
        return
    with jax.ensure_compile_time_eval():
        ordered = nondecreasing(seq_idx)
    if not jax.device_get(ordered):
        raise_unordered_seq_idx(api, seq_idx)


def as_int(value) -> int | None:
    """`value` (a size, an index or an id an option gives) as a Python int where it is a concrete integer: an int
    of Python or NumPy (not a bool), or a 0-d array, NumPy's or JAX's, of an integer dtype; None for anything else
    (a tracer has no value yet)."""
    if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if getattr(value, "shape", None) == () and jnp.issubdtype(value.dtype, jnp.integer):
        return int(value)
    return None


def check_int(api: str, name: str, value, requirement: str = "a positive int", minimum: int = 1,
              maximum: int | None = None) -> int:
    """`value` is a concrete integer (`as_int`: Python's, NumPy's or a 0-d JAX array's, not a bool) in [minimum,
    maximum] (no upper bound for None); returns it as a Python int. TypeError for anything else, ValueError out
    of range, both saying "<api>: <name>=<value> must be <requirement>" (callers with further conditions raise
    the same words as a ValueError)."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{api}: {name}={value!r} must be {requirement}")
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{api}: {name}={value!r} must be {requirement}")
    return number


def check_size(api: str, name: str, value) -> int:
    """`value` is a size an array axis can have: a positive int (`check_int`) of at most INT32_MAX; returns it as a
    Python int."""
    return check_int(api, name, value, f"a positive int of at most {_INT32_MAX_TEXT} (an array axis)",
                     maximum=INT32_MAX)


def check_axis_length(api: str, name: str, length: int) -> None:
    """`length`, an axis that sizes already checked add up to (`name` says how, e.g. "d_inner=expand*d_model"), is
    at most INT32_MAX.

    Raises:
      ValueError: "<api>: <name>=<length> must be at most 2**31 - 1 ...".
    """
    if length > INT32_MAX:
        raise ValueError(f"{api}: {name}={length} must be at most {_INT32_MAX_TEXT} (an array axis)")


def check_element_count(api: str, name: str, axes: str, shape: tuple[int, ...]) -> None:
    """An array `name` of `shape` (its axes named by `axes`, e.g. "(n_layer, d_model, d_in_proj)") holds at most
    MAX_ELEMENTS elements, so that XLA can build it in any float dtype.

    Raises:
      ValueError: naming the array, its shape and the bound.
    """
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ValueError(f"{api}: {name} of shape {axes}={tuple(shape)} would hold {count} elements; an array holds "
                         f"at most {_MAX_ELEMENTS_TEXT} (its byte size, at 8 bytes an element, must fit int64)")


def is_real_scalar(value) -> bool:
    """Whether `value` is a real number whose value is known now: a Python or NumPy int or float (not a bool), or a
    concrete 0-d array, NumPy's or JAX's, of a float or integer dtype (bfloat16 too, which NumPy's number types
    leave out); not a tracer, which has no value to build a program with."""
    if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
        return False
    if isinstance(value, (Real, np.integer, np.floating)):
        return True
    return getattr(value, "shape", None) == () and (jnp.issubdtype(value.dtype, jnp.floating)
                                                    or jnp.issubdtype(value.dtype, jnp.integer))


def check_positive_float(api: str, name: str, value) -> float:
    """`value` is a positive finite number (`is_real_scalar`); returns it as a Python float. TypeError for anything
    else, ValueError out of range."""
    if not is_real_scalar(value):
        raise TypeError(f"{api}: {name}={value!r} must be a positive finite float")
    if getattr(value, "shape", None) == ():  # a 0-d array (or NumPy scalar), named in errors as its number
        value = int(value) if jnp.issubdtype(value.dtype, jnp.integer) else float(value)
    if not 0 < value < math.inf:
        raise ValueError(f"{api}: {name}={value!r} must be a positive finite float")
    return float(value)


def check_dt_limit(api: str, dt_limit, name: str = "dt_limit") -> tuple[float, float]:
    """`dt_limit`, the clip of the time step Δ, as a (min, max) pair of floats with 0 <= min <= max and min
    finite (max may be inf: no upper clip), named `name` in errors. The ops, the decode kernels, the layers and
    the configurations take the same pairs."""
    # An ordered pair (a set has no order) of real numbers (float() would also parse strings).
    pair = tuple(dt_limit) if isinstance(dt_limit, (tuple, list, np.ndarray)) else ()
    if len(pair) != 2 or not all(is_real_scalar(v) for v in pair):
        raise TypeError(f"{api}: {name}={dt_limit!r} must be a pair of floats (min, max)")
    low, high = float(pair[0]), float(pair[1])
    if not (0 <= low <= high and math.isfinite(low)):
        raise ValueError(f"{api}: {name}={dt_limit!r} must satisfy 0 <= min <= max with min finite")
    return low, high


def check_flag(api: str, name: str, value) -> bool:
    """`value` is a bool (NumPy's too); returns it as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{api}: {name}={value!r} must be a bool")
    return bool(value)


def float_dtype(api: str, name: str, dtype) -> jnp.dtype:
    """`dtype` (an option naming a dtype) as one of FLOAT_DTYPES."""
    if dtype is None:  # NumPy would read None as float64
        raise TypeError(f"{api}: {name}=None must be one of {_FLOAT_NAMES}")
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{api}: {name}={dtype!r} must be a float dtype") from None
    if not any(dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"{api}: {name}={dtype} must be one of {_FLOAT_NAMES}")
    return dtype
