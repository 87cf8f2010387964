"""`chunked_cross_entropy`: the LM head fused with a token-mean cross-entropy, never materializing the logits
of the whole batch.

The plain loss `softmax_cross_entropy(hidden @ W)` holds (tokens, vocab) logits in the compute dtype, their
float32 copy, the softmax and its gradient at once: at 8 x 2048 tokens and a 50280-word vocabulary that is
3.3 GB per float32 copy. Here the tokens are cut into chunks of `chunk_tokens`: the forward computes each
chunk's logits (float32 accumulation) and from them its logsumexp and target logit. Peak memory is one chunk's
logits and their gradient.

The gradient is taken while each chunk's logits are at hand. A mean or a sum of the tokens' losses has one
cotangent for every token (dloss / count, or dloss), so the gradient is the unit one (every token's cotangent 1)
times that scalar: under differentiation the forward also computes each chunk's logits' unit gradient and its
two products (the hidden states' gradient, the weight gradient's step, accumulated over the chunks), and the
backward only scales them. That is three (tokens x d_model x vocab) products in all, as for the plain loss, and
nothing of the logits kept (the residuals are the two unit gradients, in the accumulation dtype). Per-token
losses (reduction "none") have a cotangent per token, which the weight's step cannot take out of its sum over
the tokens: their forward keeps only the logsumexp (4 bytes per token) and their backward recomputes each
chunk's logits (a fourth product).

Padded vocabulary columns (an embedding of `padded_vocab_size` > `vocab_size` rows) are excluded from the
softmax: they are not tokens, so the loss does not depend on the padding multiple and their rows get zero
gradient; their weights (zeroed in the head's operand) reach no value, a NaN there included. (mamba_ssm's LM
returns the padded logits and leaves the loss to the user; HF transformers' Mamba2ForCausalLM takes the softmax
over all of them.)

The softmax of each chunk (its logsumexp and target logit, and its gradient in the gradient's pass) is the op
"cross_entropy" of `jax_mamba2.backends`: "xla" (the fusions below, registered here) or the cuTile kernels
("cutile", "cutile_callback": kernels/cross_entropy.py, cross_entropy_bwd.py, registered by the bridge), which
read a chunk's logits once for the loss, and read them once and write their gradient once for the gradient.
The head matmuls, the chunking and the custom VJP are the same for every backend.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import backends as registry
from jax_mamba2._vma import reduce_to_primal_axes, varying_axes
from jax_mamba2.checks import as_int, check_float, check_int, check_token_ids_in_range, float_dtype

OP = "cross_entropy"
# The head's vocabulary is padded (zero weight rows, columns outside the softmax) to a multiple of this once per
# call. XLA's GPU compiler pads the contraction dimension of the hidden states' gradient product (the vocabulary)
# to a multiple of 16 at bf16; left to it, that pad is two passes per chunk, one over the weight and one over the
# chunk's logits' gradient (docs/design.md §12 measures them). 64 covers
# every dtype's multiple at a cost of at most 63 columns.
_VOCAB_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class _LossStatic:
    chunk_tokens: int
    ignore_index: int
    vocab_size: int
    embedding_layout: bool  # weight is (vocab, d) (a tied embedding), else (d, vocab)
    dtype: str               # the matmul operands' dtype
    logits_dtype: str        # the head product's result dtype; softmax math runs in the accumulation dtype
    reduction: str = "mean"  # "mean", "sum" or "none" (the per-token losses)
    # The softmax's backends as `backends.select` chose them: [one], or "auto"'s [kernel, xla fallback].
    backends: tuple = ()


def _accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _head_logits(static: _LossStatic, hidden, weight):
    """(chunk, d) x weight -> (chunk, padded vocab) logits as the head product stores them.

    The product accumulates in float32 and is stored as `static.logits_dtype`: a bfloat16 store halves the
    bytes each chunk's logits cost to write and read back (what mixed-precision PyTorch LMs compute) and is
    widened again where the softmax is taken."""
    contract = (1,) if static.embedding_layout else (0,)
    return jax.lax.dot_general(hidden.astype(static.dtype), weight, (((1,), contract), ((), ())),
                               preferred_element_type=static.logits_dtype)


def _softmax_logits(static: _LossStatic, logits):
    """Stored logits -> the accumulation dtype, padded columns -inf (outside the softmax)."""
    logits = logits.astype(_accumulation_dtype(static.dtype))
    if static.vocab_size < logits.shape[-1]:
        columns = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        logits = jnp.where(columns < static.vocab_size, logits, -jnp.inf)
    return logits


def _label_masks(static: _LossStatic, labels):
    """(counted, out of range) per token: counted tokens enter the mean; a counted label outside
    [0, vocab_size) makes the loss (and its gradient) NaN instead of reading another column."""
    counted = labels != static.ignore_index
    return counted, counted & ((labels < 0) | (labels >= static.vocab_size))


def _chunked(static: _LossStatic, hidden, labels):
    """hidden (tokens, d) and labels (tokens,) cut into (nchunks, chunk, ...), the tail padded with ignored
    tokens."""
    tokens = hidden.shape[0]
    chunk = min(static.chunk_tokens, tokens)
    nchunks = -(-tokens // chunk)
    pad = nchunks * chunk - tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(nchunks, chunk, hidden.shape[1])
    labels = jnp.pad(labels, (0, pad), constant_values=static.ignore_index).reshape(nchunks, chunk)
    return hidden, labels


def _xla_softmax_loss(static: _LossStatic, logits, labels):
    """(chunk, padded vocab) stored logits, (chunk,) labels -> (logsumexp, per-token loss), both (chunk,) in the
    accumulation dtype; the loss 0 where the label is ignored and NaN where a counted label is out of range."""
    logits = _softmax_logits(static, logits)
    logsumexp = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.clip(labels, 0, logits.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    counted, out_of_range = _label_masks(static, labels)
    per_token = jnp.where(out_of_range, jnp.nan, logsumexp - target)
    return logsumexp, jnp.where(counted, per_token, 0.0)


def _xla_softmax_grad(static: _LossStatic, logits, labels, logsumexp, scale):
    """The gradient of sum(scale * per-token loss) in the logits: (chunk, padded vocab) in the matmul dtype,
    exact zeros in ignored rows and padded columns (a where, not a product with 0, so that a non-finite logit
    there gives no NaN), NaN rows where a counted label is out of range; scale (chunk,)."""
    logits = _softmax_logits(static, logits)
    counted, out_of_range = _label_masks(static, labels)
    columns = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    dlogits = (jnp.exp(logits - logsumexp[:, None]) - (columns == labels[:, None])) * scale[:, None]
    dlogits = jnp.where(counted[:, None] & (columns < static.vocab_size), dlogits, 0)
    return jnp.where(out_of_range[:, None], jnp.nan, dlogits).astype(static.dtype)


# The pure-JAX backend of the softmax: the two functions above.
registry.register_backend(registry.LayerBackend("xla", None, registry.always_supported), op=OP)


def _kernel_dims(static: _LossStatic, logits):
    """The kernels' description of a chunk's softmax (only a kernel backend needs it)."""
    from jax_mamba2.bridge import loss_ops  # imported by the registration of any kernel backend
    return loss_ops.loss_dims(logits, vocab_size=static.vocab_size, ignore_index=static.ignore_index,
                              grad_dtype=static.dtype)


def _softmax_loss(static: _LossStatic, backend, logits, labels):
    """(logsumexp, per-token loss) of a chunk on `backend` (a registered "cross_entropy" backend)."""
    if backend.kernels is None:
        return _xla_softmax_loss(static, logits, labels)
    return backend.kernels.forward(_kernel_dims(static, logits), logits, labels)


def _softmax_grad(static: _LossStatic, backend, logits, labels, logsumexp, scale):
    """The logits' gradient of a chunk on `backend`, as `_xla_softmax_grad`."""
    if backend.kernels is None:
        return _xla_softmax_grad(static, logits, labels, logsumexp, scale)
    return backend.kernels.backward(_kernel_dims(static, logits), logits, labels, logsumexp,
                                    scale.astype(jnp.float32))


def _head_operand(static: _LossStatic, weight):
    """The weight in the matmul dtype, its vocabulary axis zero-padded to a multiple of _VOCAB_MULTIPLE, and its own
    padded vocabulary (columns from vocab_size on) zeroed: their logits are outside the softmax, and a non-finite
    weight there would still reach every token's hidden-state gradient (0 * inf in dlogits . weight^T)."""
    axis = 0 if static.embedding_layout else 1
    operand = weight.astype(static.dtype)
    if static.vocab_size < weight.shape[axis]:  # a select in the same pass as the pad
        columns = jax.lax.broadcasted_iota(jnp.int32, operand.shape, axis)
        operand = jnp.where(columns < static.vocab_size, operand, 0)
    pad = -weight.shape[axis] % _VOCAB_MULTIPLE
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, pad)
    return jnp.pad(operand, widths)


def _counted_tokens(counted, axis_name=None):
    """The number of counted tokens, at least 1 (the mean of no token is 0); counted: bool of any shape. With
    `axis_name` (inside `jax.shard_map`), every shard's: the maximum is taken after the sum over the shards."""
    count = jnp.sum(counted)
    return jnp.maximum(count if axis_name is None else jax.lax.psum(count, axis_name), 1)


def _reduced(static: _LossStatic, per_token, labels):
    """The chunks' per-token losses (nchunks, chunk) -> the loss as `static.reduction` asks."""
    if static.reduction == "none":
        return per_token.reshape(-1)[:labels.shape[0]]
    total = jnp.sum(per_token)
    return total / _counted_tokens(labels != static.ignore_index) if static.reduction == "mean" else total


def _loss_and_logsumexp(static: _LossStatic, hidden, weight, labels):
    """(the loss as `static.reduction` asks, per-token logsumexp (nchunks, chunk))."""
    weight = _head_operand(static, weight)

    def chunk_loss(args):
        h, y = args
        return registry.run_selected(list(static.backends), functools.partial(_softmax_loss, static),
                                     _head_logits(static, h, weight), y)

    logsumexp, per_token = jax.lax.map(chunk_loss, _chunked(static, hidden, labels))
    return _reduced(static, per_token, labels), logsumexp


def _head_grads(static: _LossStatic, operand, h, dlogits, acc_dtype):
    """A chunk's logits' gradient (chunk, padded vocab) -> (dh (chunk, d), the weight gradient's step in the
    operand's layout), both in acc_dtype: dh = dlogits . weight^T, step = h^T . dlogits (dlogits^T . h for the
    (vocab, d) layout)."""
    h = h.astype(static.dtype)
    dh = jax.lax.dot_general(dlogits, operand, (((1,), (0 if static.embedding_layout else 1,)), ((), ())),
                             preferred_element_type=acc_dtype)
    if static.embedding_layout:
        step = jax.lax.dot_general(dlogits, h, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
    else:
        step = jax.lax.dot_general(h, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
    return dh, step


def _weight_grad_accumulator(operand, acc_dtype, *arrays):
    """Zeros of the operand's shape in acc_dtype; under shard_map varying over the axes any of `arrays` does (the
    chunks vary over the axes the tokens do: so does their accumulated gradient)."""
    axes = tuple(sorted(set().union(*(varying_axes(a) for a in arrays))))
    dweight = jnp.zeros(operand.shape, acc_dtype)
    return jax.lax.pcast(dweight, axes, to="varying") if axes else dweight


def _weight_grad(dweight, weight):
    """The accumulated gradient of the padded operand -> the weight's: the padded vocabulary's rows dropped, the
    weight's dtype, summed over the axes the weight is replicated on."""
    dweight = dweight[:weight.shape[0], :weight.shape[1]]
    return reduce_to_primal_axes(dweight.astype(weight.dtype), weight)


def _loss_and_unit_grads(static: _LossStatic, hidden, weight, labels):
    """The loss (a mean or a sum) with the gradient of the sum of the tokens' losses, taken while each chunk's
    logits are at hand: (loss, dhidden (tokens, d), dweight (the padded operand's shape)), the gradients in the
    accumulation dtype."""
    acc_dtype = _accumulation_dtype(static.dtype)
    operand = _head_operand(static, weight)
    backends = list(static.backends)

    def chunk(dweight, args):
        h, y = args
        logits = _head_logits(static, h, operand)
        logsumexp, per_token = registry.run_selected(backends, functools.partial(_softmax_loss, static), logits, y)
        dlogits = registry.run_selected(backends, functools.partial(_softmax_grad, static), logits, y, logsumexp,
                                        jnp.ones_like(logsumexp))
        dh, step = _head_grads(static, operand, h, dlogits, acc_dtype)
        return dweight + step, (per_token, dh)

    dweight, (per_token, dhidden) = jax.lax.scan(chunk, _weight_grad_accumulator(operand, acc_dtype, hidden, labels),
                                                 _chunked(static, hidden, labels))
    return _reduced(static, per_token, labels), dhidden.reshape(-1, hidden.shape[1])[:hidden.shape[0]], dweight


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_loss(static: _LossStatic, hidden, weight, labels):
    return _loss_and_logsumexp(static, hidden, weight, labels)[0]


def _gradient_in_forward(static: _LossStatic) -> bool:
    """Whether the forward takes the gradient (see the module's docstring): a mean or a sum."""
    return static.reduction != "none"


def _chunked_loss_fwd(static, hidden, weight, labels):
    if not _gradient_in_forward(static):
        loss, logsumexp = _loss_and_logsumexp(static, hidden, weight, labels)
        return loss, (hidden, weight, labels, logsumexp)
    loss, dhidden, dweight = _loss_and_unit_grads(static, hidden, weight, labels)
    # hidden's type (its dtype and, under shard_map, the axes it varies over) rides along as an empty slice
    return loss, (dhidden, dweight, labels != static.ignore_index, weight, hidden[:0])


def _chunked_loss_bwd(static, saved, dloss):
    acc_dtype = _accumulation_dtype(static.dtype)
    if _gradient_in_forward(static):  # the forward's unit gradients, times the one cotangent of every token
        dhidden, dweight, counted, weight, hidden = saved
        scale = (dloss / _counted_tokens(counted) if static.reduction == "mean" else dloss).astype(acc_dtype)
        # Ignored tokens' gradients are exact zeros, also for a non-finite dloss (0 * inf would be NaN).
        dhidden = jnp.where(counted[:, None], dhidden * scale, 0).astype(hidden.dtype)
        dweight = jnp.where(jnp.any(counted), dweight * scale, 0)
        return reduce_to_primal_axes(dhidden, hidden), _weight_grad(dweight, weight), None
    hidden, weight, labels, logsumexp = saved  # per-token losses: a cotangent per token
    operand = _head_operand(static, weight)
    scales = dloss.astype(acc_dtype)

    def chunk_grads(dweight, args):
        h, y, lse, scale = args
        dlogits = registry.run_selected(list(static.backends), functools.partial(_softmax_grad, static),
                                        _head_logits(static, h, operand), y, lse, scale)
        dh, step = _head_grads(static, operand, h, dlogits, acc_dtype)
        return dweight + step, dh.astype(hidden.dtype)

    h_chunks, y_chunks = _chunked(static, hidden, labels)
    scale_chunks = jnp.pad(scales, (0, y_chunks.size - scales.shape[0])).reshape(y_chunks.shape)
    dweight, dhidden = jax.lax.scan(chunk_grads, _weight_grad_accumulator(operand, acc_dtype, hidden, labels, dloss),
                                    (h_chunks, y_chunks, logsumexp, scale_chunks))
    dhidden = dhidden.reshape(-1, hidden.shape[1])[:hidden.shape[0]]
    return reduce_to_primal_axes(dhidden, hidden), _weight_grad(dweight, weight), None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


def check_ignore_index(api: str, ignore_index) -> None:
    """ignore_index, the label of tokens left out of the loss, is a concrete int (`as_int`: NumPy's and a 0-d JAX
    array's too, not a bool) in int32's range (the labels' dtype in the loss)."""
    number = as_int(ignore_index)
    if number is None:
        raise TypeError(f"{api}: ignore_index={ignore_index!r} must be an int")
    if not -2 ** 31 <= number < 2 ** 31:
        raise ValueError(f"{api}: ignore_index={ignore_index} must be in int32's range")


def check_reduction(api: str, reduction) -> None:
    """reduction is one of the strings "mean", "sum" and "none"."""
    if not isinstance(reduction, str):
        raise TypeError(f'{api}: reduction={reduction!r} must be a str: "mean", "sum" or "none"')
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'{api}: reduction={reduction!r} must be "mean", "sum" or "none"')


def int32_labels(labels, ignore_index: int, padded_vocab: int):
    """labels (any shape, any integer dtype) as int32, where a label of a wider dtype that int32 cannot hold (and
    would wrap into the vocabulary or onto ignore_index) becomes a label past the weight's vocabulary
    (`padded_vocab`, its rows), and not ignore_index, so that it scores NaN like any other label out of range."""
    if jnp.iinfo(labels.dtype).max <= jnp.iinfo(jnp.int32).max:
        return labels.astype(jnp.int32)
    fits = labels <= jnp.iinfo(jnp.int32).max
    if jnp.issubdtype(labels.dtype, jnp.signedinteger):
        fits = fits & (labels >= jnp.iinfo(jnp.int32).min)
    out_of_range = padded_vocab + (ignore_index == padded_vocab)
    return jnp.where(fits, labels, out_of_range).astype(jnp.int32)


def check_arguments(api: str, hidden, labels, *, vocab_size, chunk_tokens, ignore_index, dtype, logits_dtype, reduction,
                    backend, head_weight=None, embedding=None) -> tuple[_LossStatic, jax.Array]:
    """Raises what `chunked_cross_entropy(hidden, labels, ...)` raises for its arguments (every keyword but one of
    head_weight and embedding given), naming `api`, without computing anything: `hidden` may be a
    `jax.ShapeDtypeStruct`, for a caller that checks the loss's options before it computes the hidden states.
    Returns the op's static configuration (its backends selected) and the head's weight."""
    if (head_weight is None) == (embedding is None):
        raise TypeError(f"{api}: pass exactly one of head_weight=(d, vocab) or embedding=(vocab, d)")
    weight, name = (head_weight, "head_weight") if embedding is None else (embedding, "embedding")
    for arg, arg_name in ((hidden, "hidden"), (weight, name), (labels, "labels")):
        if not hasattr(arg, "shape") or not hasattr(arg, "dtype"):
            raise TypeError(f"{api}: {arg_name} must be an array, got {type(arg).__name__}")
    for arg, arg_name in ((hidden, "hidden"), (weight, name)):
        check_float(api, arg_name, arg)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{api}: labels.dtype={labels.dtype} must be an integer dtype")
    if hidden.ndim < 1:
        raise ValueError(f"{api}: hidden.shape=() must be (..., d), the hidden states of each labelled token")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{api}: labels.shape={tuple(labels.shape)} must be hidden.shape[:-1]="
                         f"{tuple(hidden.shape[:-1])}")
    d = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1 if embedding is not None else 0] != d:
        want = "(vocab, d)" if embedding is not None else "(d, vocab)"
        raise ValueError(f"{api}: {name}.shape={tuple(weight.shape)} must be {want} with d=hidden.shape[-1]={d}")
    padded_vocab = weight.shape[0 if embedding is not None else 1]
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    requirement = f"an int in [1, {padded_vocab}] (the weight's vocabulary)"
    check_int(api, "vocab_size", vocab_size, requirement, maximum=padded_vocab)
    check_int(api, "chunk_tokens", chunk_tokens)
    check_ignore_index(api, ignore_index)
    check_reduction(api, reduction)
    dtype = jnp.result_type(hidden, weight) if dtype is None else float_dtype(api, "dtype", dtype)
    acc_dtype = _accumulation_dtype(dtype)
    logits_dtype = acc_dtype if logits_dtype is None else float_dtype(api, "logits_dtype", logits_dtype)
    tokens = int(np.prod(labels.shape))
    static = _LossStatic(int(chunk_tokens), int(ignore_index), int(vocab_size), embedding is not None,
                         jnp.dtype(dtype).name, logits_dtype.name, reduction)
    chunk_logits = jax.ShapeDtypeStruct((max(1, min(static.chunk_tokens, tokens)),
                                         padded_vocab + -padded_vocab % _VOCAB_MULTIPLE), logits_dtype)
    selected = registry.select(
        backend, api, lambda b: b.unsupported_reason(None if b.kernels is None else _kernel_dims(static, chunk_logits)),
        op=OP)
    return dataclasses.replace(static, backends=tuple(selected)), weight


def chunked_cross_entropy(hidden, labels, *, head_weight=None, embedding=None, vocab_size: Optional[int] = None,
                          chunk_tokens: int = 2048, ignore_index: int = -100, dtype=None, logits_dtype=None,
                          reduction: str = "mean", backend: str = "auto"):
    """Next-token cross-entropy of `hidden @ head_weight` (or `hidden @ embedding.T`), chunk by chunk.

    Equals `optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab_size], labels)` averaged over
    the tokens whose label is not `ignore_index` (as torch's / HF's CrossEntropyLoss(ignore_index=-100)), or
    summed, or per token (`reduction`), with float32 logits, and its gradient, without holding more than one
    chunk's logits. Composes with jit, grad, vmap, jax.checkpoint and shard_map (tokens split over a data axis:
    each shard's mean; the weight gradient is summed over the shards it is replicated on). Reverse mode only, on
    every backend: the gradient is a custom VJP, of which jax.jvp and jax.linearize raise TypeError.

    Args:
      hidden: (..., d) float, the final hidden states.
      labels: (...) int, the target token of each position; `ignore_index` marks positions left out.
      head_weight: (d, padded_vocab) float, an untied LM head's kernel (NNX layout) ...
      embedding: (padded_vocab, d) float ... or a tied embedding matrix; exactly one of the two.
      vocab_size: the softmax's columns are the first vocab_size (default: all padded_vocab); the others are
        padding and excluded.
      chunk_tokens: tokens per chunk (default 2048: 412 MB of float32 logits at a 50280-word vocabulary).
      ignore_index: label of positions that do not count (default -100).
      dtype: the matmul operands' dtype (default: the result type of hidden and the weight); logits
        accumulate in float32 (float64 for float64).
      logits_dtype: the dtype each chunk's logits are stored in between the head product and the softmax
        (default: the accumulation dtype, float32). bfloat16 rounds them as a PyTorch LM under autocast does
        (logits in bf16, then `.float()` for the loss): half the logits' memory traffic; the softmax, the
        logsumexp and the gradient's arithmetic stay in float32.
      reduction: "mean" (default: over the counted tokens), "sum" (of them) or "none" (each token's loss, 0 where
        ignored: minus its log-likelihood; a sequence's log-likelihood is minus their sum), as torch's.
      backend: the softmax's backend (the op "cross_entropy" of `jax_mamba2.backends`): "auto" (default: cutile
        on a supported GPU behind `lax.platform_dependent`, else xla), "xla" (XLA fusions), "cutile" or
        "cutile_callback" (the cuTile kernels: one read of each chunk's logits for the loss, one read and one
        write of their gradient for the gradient, in the forward pass for a mean or a sum). The kernels take
        bfloat16/float16/float32 logits and dtype.

    Returns:
      The scalar mean (or sum) loss in float32 (float64 for float64), 0 when no position counts; with
      reduction="none" an array of labels' shape. NaN (for that token) when a traced label (under jit) lies
      outside [0, vocab_size) and is not ignore_index.

    Raises:
      ValueError / TypeError: on wrong shapes, dtypes or options, naming the argument; ValueError for a concrete
        label outside [0, vocab_size) that is not ignore_index, and when a named kernel backend cannot run the
        call (a float64 dtype or logits_dtype, no GPU), saying why.
    """
    static, weight = check_arguments("chunked_cross_entropy", hidden, labels, head_weight=head_weight,
                                     embedding=embedding, vocab_size=vocab_size, chunk_tokens=chunk_tokens,
                                     ignore_index=ignore_index, dtype=dtype, logits_dtype=logits_dtype,
                                     reduction=reduction, backend=backend)
    check_token_ids_in_range("chunked_cross_entropy", "labels", labels, static.vocab_size, static.ignore_index)
    return checked_cross_entropy(static, weight, hidden, labels)


def checked_cross_entropy(static: _LossStatic, weight, hidden, labels, *, axis_name=None):
    """`chunked_cross_entropy` of arguments already checked: `(static, weight)` from `check_arguments` on
    hidden's shape and dtype and these labels (whose concrete ids the caller has checked against the
    vocabulary), for a caller that checks before it computes `hidden`.

    axis_name: None, or inside `jax.shard_map` the mesh axis (or tuple of axes) that splits the tokens: a mean or
    a sum then covers every shard's tokens (the mean divides the sum over all shards by all their counted tokens,
    not each shard's by its own), the same on every shard; per-token losses stay each shard's."""
    tokens, d = int(np.prod(labels.shape)), hidden.shape[-1]
    if axis_name is not None and static.reduction != "none":
        total = checked_cross_entropy(dataclasses.replace(static, reduction="sum"), weight, hidden, labels)
        total = jax.lax.psum(total, axis_name)
        if static.reduction == "sum":
            return total
        return total / _counted_tokens(labels != static.ignore_index, axis_name)
    if tokens == 0:
        return jnp.zeros(labels.shape if static.reduction == "none" else (), _accumulation_dtype(static.dtype))
    padded_vocab = weight.shape[0 if static.embedding_layout else 1]
    loss = _chunked_loss(static, hidden.reshape(tokens, d), weight,
                         int32_labels(labels.reshape(tokens), static.ignore_index, padded_vocab))
    return loss.reshape(labels.shape) if static.reduction == "none" else loss
