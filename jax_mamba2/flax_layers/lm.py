"""`Mamba2Block` and `Mamba2LMHeadModel` (mamba_ssm `models/mixer_seq_simple.py`, `modules/block.py`).

The n_layer blocks are created once with `nnx.vmap` (every parameter gets a leading (n_layer,) axis) and run
in one loop over the layers (`layer_loop.scan_blocks` for the forward and backward, `lax.scan` for the cached
prefill and step), so the compiled program holds one block however deep the model is: compile time does not
grow with n_layer (an `nnx.List` of blocks would unroll n_layer copies into the HLO).
"""

import functools
import inspect
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_mamba2 import backends
from jax_mamba2 import cross_entropy as loss_op
from jax_mamba2 import decode as decode_op
from jax_mamba2 import norm as norm_op
from jax_mamba2.checks import check_flag, check_int, check_token_ids_in_range, float_dtype
from jax_mamba2.flax_layers import _checks
from jax_mamba2.flax_layers.cache import Mamba2Cache, stack_layers, unstack_layers
from jax_mamba2.flax_layers.config import Mamba2Config
from jax_mamba2.flax_layers.initializers import torch_normal, torch_uniform
from jax_mamba2.flax_layers.layer_loop import SCAN_COMPILER_OPTIONS, scan_blocks
from jax_mamba2.flax_layers.mamba2 import IN_PROJ_OUTPUT, Mamba2
from jax_mamba2.flax_layers.norm import RMSNorm


def remat_policy(remat: str):
    """The `jax.checkpoint` policy of a named `remat` mode: "matmuls" saves in_proj's output only."""
    if remat != "matmuls":
        raise ValueError(f'remat_policy: remat={remat!r} must be "matmuls"')
    return jax.checkpoint_policies.save_only_these_names(IN_PROJ_OUTPUT)


def _check_remat(api: str, remat) -> bool | str:
    """The `remat` option: a bool (keep everything / only the block's inputs) or "matmuls" (in_proj's output)."""
    if isinstance(remat, str):
        if remat != "matmuls":
            raise ValueError(f'{api}: remat={remat!r} must be False, "matmuls" or True')
        return remat
    if not isinstance(remat, (bool, np.bool_)):
        raise TypeError(f'{api}: remat={remat!r} must be False, "matmuls" or True')
    return bool(remat)


def _check_lm_options(api: str, scan_layers, remat, save_chunk_states, loss_backend) -> tuple:
    """The options only the LM takes, checked: (scan_layers, remat, the blocks' save_chunk_states under that remat,
    loss_backend)."""
    scan_layers = check_flag(api, "scan_layers", scan_layers)
    remat = _check_remat(api, remat)
    save_chunk_states = chunk_states_saved(save_chunk_states, remat, api)
    loss_backend = None if loss_backend is None else backends.check_name(loss_backend, api, loss_op.OP, "loss_backend")
    return scan_layers, remat, save_chunk_states, loss_backend


def check_model_options(api: str, options: Mapping) -> None:
    """`options`, keyword options of `Mamba2LMHeadModel` other than dtype, param_dtype and rngs (any of them, the
    others at the constructor's defaults), checked as the constructor checks them, for a caller that builds the
    model later (`load_pretrained` before it reads config.json). TypeError for an option the constructor does not
    take."""
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(Mamba2LMHeadModel.__init__).parameters.items()
                if parameter.kind is parameter.KEYWORD_ONLY and name not in ("dtype", "param_dtype", "rngs")}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"{api}: unknown model options {unknown}; Mamba2LMHeadModel takes {list(defaults)}")
    options = {**defaults, **options}
    _check_mixer_options(api, options["backend"], options["deterministic_backward"], options["check_finite"])
    _check_lm_options(api, options["scan_layers"], options["remat"], options["save_chunk_states"],
                      options["loss_backend"])


def _check_config(api: str, config) -> None:
    if not isinstance(config, Mamba2Config):
        raise TypeError(f"{api}: config must be a Mamba2Config (e.g. Mamba2Config.from_mamba_ssm(a config.json "
                        f"dict)), got {type(config).__name__}")


def _check_constructor_options(api: str, backend, deterministic_backward, check_finite, dtype, param_dtype,
                               rngs) -> None:
    """The constructors' options that they hand to the mixers (`backend`, a known backend name; the two flags;
    `dtype`, None or a float dtype; `param_dtype`, a float dtype) and `rngs`, checked under the constructor's own
    name before the embedding or a norm is built (the mixers check them again, naming themselves)."""
    _check_mixer_options(api, backend, deterministic_backward, check_finite)
    _checks.check_float_dtype(api, "dtype", dtype)
    float_dtype(api, "param_dtype", param_dtype)
    _checks.check_rngs(api, rngs)


def _check_mixer_options(api: str, backend, deterministic_backward, check_finite) -> None:
    """The SSD options a constructor hands to every mixer: a known backend name and two flags."""
    backends.check_name(backend, api)
    check_flag(api, "deterministic_backward", deterministic_backward)
    check_flag(api, "check_finite", check_finite)


def chunk_states_saved(save_chunk_states: bool | None, remat: bool | str, api: str = "Mamba2LMHeadModel") -> bool:
    """The blocks' `save_chunk_states` under the LM's `remat`: as given, or by default (None) True under remat, where
    the backward replays each block's forward just before its backward, so kept states live within one block (a
    faster step for a few MB; docs/design.md §12), and False without it, where they would live across every layer
    (a 1-2% slower step for dstate / 64 times x's bytes less per layer)."""
    if save_chunk_states is None:
        return remat is not False
    return check_flag(api, "save_chunk_states", save_chunk_states)


class Mamba2Block(nnx.Module):
    """Add -> RMSNorm -> Mamba2 (mamba_ssm `Block` with fused_add_norm semantics).

    `(hidden, residual) -> (mixer(norm(hidden + residual)), hidden + residual)`: the residual stream is carried
    separately and kept in float32 when `residual_in_fp32`; the add and the norm are one `add_rms_norm`. A residual
    of None (the first block's, as mamba_ssm's `Block(hidden_states, residual=None)`) starts the stream at hidden.

    Args:
      config: model configuration (d_model, norm_epsilon, residual_in_fp32 and the mixer's `ssm_cfg`).
      backend, deterministic_backward, save_chunk_states, check_finite: the mixer's SSD options (see
        `Mamba2`); the norms follow the backend (see `backends.for_op`).
      dtype: computation dtype (default: None, inferred).
      param_dtype: parameter dtype (default: float32).
      rngs: parameter initialization keys.
    """

    def __init__(self, config: Mamba2Config, *, backend: str = "auto", deterministic_backward: bool = False,
                 save_chunk_states: bool = False, check_finite: bool = True, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        _check_config("Mamba2Block", config)
        _check_constructor_options("Mamba2Block", backend, deterministic_backward, check_finite, dtype, param_dtype,
                                   rngs)
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.d_model, eps=config.norm_epsilon, backend=backends.for_op(backend, norm_op.OP),
                            dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mixer = Mamba2(config.d_model, **config.mixer_options, backend=backend,
                            deterministic_backward=deterministic_backward, save_chunk_states=save_chunk_states,
                            check_finite=check_finite, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def residual_dtype(self, hidden_dtype, residual_dtype):
        """The dtype of the residual stream hidden + residual: float32 or wider with residual_in_fp32."""
        dtype = jnp.result_type(hidden_dtype, residual_dtype)
        return jnp.promote_types(jnp.float32, dtype) if self.residual_in_fp32 else dtype

    def _add_norm(self, hidden_states, residual):
        stream = hidden_states if residual is None else residual
        normed, residual = self.norm.add_norm(hidden_states, residual,
                                              residual_dtype=self.residual_dtype(hidden_states.dtype, stream.dtype))
        return normed.astype(hidden_states.dtype), residual

    def _check_inputs(self, api: str, hidden_states, residual, cache, *, sequence: bool) -> None:
        """hidden_states and residual (or None): (batch, seqlen, d_model) (or (batch, d_model) for a step),
        floating; cache (unless None where a sequence is given) of the mixer's shapes for that batch."""
        names = ("batch", "seqlen", "d_model") if sequence else ("batch", "d_model")
        shape = _checks.check_named_array(api, "hidden_states", hidden_states,
                                          tuple((n, self.mixer.d_model if n == "d_model" else None) for n in names),
                                          kind="floating")
        if residual is not None:
            _checks.check_named_array(api, "residual", residual, tuple(zip(names, shape)), kind="floating")
        _checks.check_batch_splits(api, "hidden_states", shape[0], self.mixer.mesh_axes)
        if cache is not None or not sequence:  # a step needs one
            _checks.check_cache(api, cache, *self.mixer.cache_axes(shape[0]))

    def __call__(self, hidden_states, residual, *, seq_idx=None):
        """hidden_states, residual: (batch, seqlen, d_model) -> (hidden_states, residual); residual may be None
        (the first block); seq_idx: optional (batch, seqlen) int ids of packed sequences (see `Mamba2.__call__`)."""
        self._check_inputs("Mamba2Block.__call__", hidden_states, residual, None, sequence=True)
        normed, residual = self._add_norm(hidden_states, residual)
        return self.mixer(normed, seq_idx=seq_idx), residual

    def prefill(self, hidden_states, residual, cache: Mamba2Cache | None = None, *, seq_idx=None, cache_dtype=None):
        """As `__call__`, also returning the mixer's cache (see `Mamba2.prefill`)."""
        self._check_inputs("Mamba2Block.prefill", hidden_states, residual, cache, sequence=True)
        normed, residual = self._add_norm(hidden_states, residual)
        out, cache = self.mixer.prefill(normed, cache, seq_idx=seq_idx, cache_dtype=cache_dtype)
        return out, residual, cache

    def step(self, hidden_states, residual, cache: Mamba2Cache):
        """One token: hidden_states, residual (batch, d_model) (residual may be None) -> (hidden_states, residual,
        cache)."""
        self._check_inputs("Mamba2Block.step", hidden_states, residual, cache, sequence=False)
        normed, residual = self._add_norm(hidden_states, residual)
        out, cache = self.mixer.step(normed, cache)
        return out, residual, cache


class Mamba2LMHeadModel(nnx.Module):
    """Mamba-2 language model: embedding, n_layer `Mamba2Block`s, final RMSNorm, LM head.

    Parameters (mamba_ssm `backbone.` prefix dropped): `embedding.embedding` (padded_vocab, d_model),
    `layers.*` (one `Mamba2Block` whose parameters have a leading (n_layer,) axis), `norm_f.scale` (d_model,),
    `lm_head.kernel` (d_model, padded_vocab) unless `tie_embeddings`. Initialization follows mamba_ssm's
    `_init_weights`: embedding N(0, 0.02), Linear biases zero, out_proj kernels divided by sqrt(n_layer).

    Logits cover the padded vocabulary (as in mamba_ssm); `generate` samples from the first `vocab_size`, and
    `loss` (the training objective: the LM head fused with a chunked cross-entropy) normalizes over them only.

    Args:
      config: the model configuration.
      backend, deterministic_backward, check_finite: every mixer's SSD options (see `Mamba2`); the norms follow
        the backend (see `backends.for_op`).
      save_chunk_states: every mixer's (see `Mamba2`); by default (None) True under `remat` (the replayed forward
        writes the chunk states just before the block's backward reads them) and False without it
        (`chunk_states_saved`).
      loss_backend: where `loss` takes the softmax over each chunk's logits (`chunked_cross_entropy`'s
        backend): "xla" (XLA fusions), "auto", "cutile" or "cutile_callback"; by default (None) the cuTile
        kernels where they can run the call ("auto") under a kernel backend or "auto", XLA under "xla" or
        "scan" and in a model that `shard_model` sharded (the kernels have no partitioning rule: XLA would
        gather each chunk's logits onto every device).
      remat: what each block keeps for the backward pass (`nnx.remat`), trading compute for memory: False
        (default) everything its backward reads; "matmuls" only in_proj's output besides the block's inputs,
        the norms, the conv and the SSD forward recomputed in the backward (no matrix product is; a few times
        less activation memory, see docs/design.md §12); True only the block's inputs, the whole block
        recomputed.
      scan_layers: run the blocks as one loop over the stacked layers (default: XLA compiles one block; on a
        process with one device the backward's per-layer activations are stacked into buffers the loop writes
        without filling them first, `layer_loop.scan_blocks`; compile a step with `compiler_options()`), or
        unrolled, each block on its slice of the stacked parameters (False: XLA compiles every block, so
        compiling takes longer; the program has no layer loop, so the activations the backward keeps need not be
        copied into per-layer stacks, and a decode step is one straight-line program).
      dtype: computation dtype (default: None, inferred; e.g. jnp.bfloat16 with float32 parameters).
      param_dtype: parameter dtype (default: float32).
      rngs: parameter initialization keys.

    Example:
      >>> config = Mamba2Config(d_model=64, n_layer=2, vocab_size=100,
      ...                       ssm_cfg=dict(d_state=16, headdim=16, chunk_size=16))
      >>> model = Mamba2LMHeadModel(config, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 10), jnp.int32)).shape
      (2, 10, 104)
    """

    def __init__(self, config: Mamba2Config, *, backend: str = "auto", deterministic_backward: bool = False,
                 save_chunk_states: bool | None = None, check_finite: bool = True, remat: bool | str = False,
                 scan_layers: bool = True, loss_backend: str | None = None, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        _check_config("Mamba2LMHeadModel", config)
        _check_constructor_options("Mamba2LMHeadModel", backend, deterministic_backward, check_finite, dtype,
                                   param_dtype, rngs)
        scan_layers, remat, save_chunk_states, loss_backend = _check_lm_options(
            "Mamba2LMHeadModel", scan_layers, remat, save_chunk_states, loss_backend)
        self.config, self.remat, self.scan_layers, self.dtype = config, remat, scan_layers, dtype
        self.loss_backend = loss_backend
        vocab = config.padded_vocab_size
        self.embedding = nnx.Embed(vocab, config.d_model, dtype=dtype, param_dtype=param_dtype,
                                   embedding_init=torch_normal(0.02), rngs=rngs)
        # nnx.Embed fixes a None dtype to its table's at construction; None here follows the table as it is at each
        # call, as the layers' None does (a model whose parameters `cast_params` converted computes in their dtype).
        self.embedding.dtype = dtype

        @nnx.split_rngs(splits=config.n_layer)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            block = Mamba2Block(config, backend=backend, deterministic_backward=deterministic_backward,
                                save_chunk_states=save_chunk_states, check_finite=check_finite, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
            out_proj = block.mixer.out_proj
            out_proj.kernel[...] = out_proj.kernel[...] / jnp.sqrt(config.n_layer).astype(param_dtype)
            for linear in (block.mixer.in_proj, out_proj):
                if linear.bias is not None:
                    linear.bias[...] = jnp.zeros_like(linear.bias[...])
            return block

        self.layers = make_layers(rngs)
        self.norm_f = RMSNorm(config.d_model, eps=config.norm_epsilon, backend=backends.for_op(backend, norm_op.OP),
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = (nnx.data(None) if config.tie_embeddings else
                        nnx.Linear(config.d_model, vocab, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   kernel_init=torch_uniform(config.d_model),
                                   rngs=rngs))

    def __call__(self, input_ids, *, seq_idx=None):
        """input_ids (batch, seqlen) int -> logits (batch, seqlen, padded_vocab).

        Concrete ids are range-checked; traced ones (under jit) cannot be read: there an id past the embedding's
        rows gives NaN logits and a negative one counts from the end of its rows (id -1 takes the row
        padded_vocab - 1, a real token's unless the vocabulary is padded).

        Args:
          input_ids: (batch, seqlen) int, in [0, vocab_size).
          seq_idx: optional (batch, seqlen) int ids of the sequences packed into each row, nondecreasing along
            it (mamba_ssm's `seq_idx`): every mixer's conv and SSM state restart where the id changes, so a
            token sees nothing of the sequences before its own.

        Raises:
          ValueError, TypeError: for input_ids that are not a 2-D integer array or (concrete) hold an id outside
            [0, vocab_size), or a seq_idx of another shape.
        """
        self._check_inputs("Mamba2LMHeadModel.__call__", input_ids, None, sequence=True, seq_idx=seq_idx)
        return self._head(self._final_hidden(input_ids, seq_idx))

    def loss(self, input_ids, labels=None, *, shift_labels=None, seq_idx=None, chunk_tokens: int = 2048,
             ignore_index: int = -100, logits_dtype=None, reduction: str = "mean"):
        """Next-token cross-entropy, never materializing the whole batch's logits (`chunked_cross_entropy`).

        As HF transformers' causal-LM loss: `labels` (default: input_ids) are aligned with input_ids and shifted
        here, so position t is scored on labels[:, t + 1] (the last position on nothing); `shift_labels` gives
        the targets already shifted instead (shift_labels[:, t] scores position t; e.g. input_ids =
        tokens[:, :-1] with shift_labels = tokens[:, 1:]). Positions whose target is `ignore_index` do not count.
        The softmax runs over the first `config.vocab_size` columns (the padding columns are excluded).

        Args:
          input_ids: (batch, seqlen) int.
          labels: optional (batch, seqlen) int, unshifted: ids in [0, vocab_size) or ignore_index (a concrete
            array is checked, as input_ids are; a traced one's id past the vocabulary scores NaN).
          shift_labels: optional (batch, seqlen) int, already shifted; not together with labels; ids as labels'.
          seq_idx: optional (batch, seqlen) int ids of packed sequences (see `__call__`). The target of a
            sequence's last token is the next sequence's first: set that label to ignore_index to leave it out.
          chunk_tokens: tokens per chunk of the fused head + loss (default 2048).
          ignore_index: target value of positions left out (default -100).
          logits_dtype: dtype the logits are stored in before the float32 softmax (default float32, float64
            for a float64 model, whose softmax is float64; `jnp.bfloat16` halves the loss's memory traffic, as an
            autocast PyTorch LM rounds its logits).
          reduction: "mean" (default) over the scored positions, "sum", or "none": (batch, seqlen), each
            position's loss (0 where not scored), minus the log-likelihood of its target; a sequence's
            log-likelihood is minus the sum of its row.

        Returns:
          The scalar mean (or sum) loss, or the (batch, seqlen) losses (float32; float64 for a float64 model).
        """
        self._check_inputs("Mamba2LMHeadModel.loss", input_ids, None, sequence=True, seq_idx=seq_idx)
        loss_op.check_reduction("Mamba2LMHeadModel.loss", reduction)
        if labels is not None and shift_labels is not None:
            raise ValueError("Mamba2LMHeadModel.loss: pass labels (unshifted) or shift_labels, not both")
        loss_op.check_ignore_index("Mamba2LMHeadModel.loss", ignore_index)
        name, labels = ("labels", input_ids if labels is None else labels) if shift_labels is None else (
            "shift_labels", shift_labels)
        _checks.check_named_array("Mamba2LMHeadModel.loss", name, labels,
                                  tuple(zip(("batch", "seqlen"), input_ids.shape)), kind="integer")
        # Of unshifted labels only [:, 1:] are targets: the first column scores nothing, so it may hold anything.
        scored, scored_name = (labels, name) if shift_labels is not None else (labels[:, 1:], f"{name}[:, 1:]")
        if labels is not input_ids:  # (input_ids were checked above) a target past the vocabulary would score NaN
            check_token_ids_in_range("Mamba2LMHeadModel.loss", scored_name, scored, self.config.vocab_size,
                                     ignore_index)
        if shift_labels is not None:
            targets = labels
        else:
            # Shifted in int32: an unsigned dtype could not hold a negative ignore_index in the padded last column
            # (none for an empty sequence). A traced label int32 cannot hold becomes one past the vocabulary, as
            # `chunked_cross_entropy` makes it of shift_labels: a plain cast would wrap it onto ignore_index (left
            # out) or into the vocabulary (scored as another token) instead of scoring NaN.
            shifted = loss_op.int32_labels(scored, ignore_index, self.config.padded_vocab_size)
            targets = jnp.pad(shifted, ((0, 0), (0, labels.shape[1] - shifted.shape[1])), constant_values=ignore_index)
        weight = (dict(embedding=self.embedding.embedding[...]) if self.lm_head is None else
                  dict(head_weight=self.lm_head.kernel[...]))
        options = dict(**weight, vocab_size=self.config.vocab_size, chunk_tokens=chunk_tokens,
                       ignore_index=ignore_index, dtype=self.dtype, logits_dtype=logits_dtype, reduction=reduction,
                       backend=self.loss_softmax_backend())
        # The loss's own options (and whether its backend can run) before the forward pass, not after it.
        hidden_like = jax.eval_shape(self.embedding, input_ids)
        static, weight = loss_op.check_arguments("Mamba2LMHeadModel.loss", hidden_like, targets, **options)
        hidden = self._final_hidden(input_ids, seq_idx)
        axes = self.norm_f.mesh_axes
        if axes is None or axes.mesh.shape[axes.data_axis] == 1:
            return loss_op.checked_cross_entropy(static, weight, hidden, targets)
        # Rows split over a data axis (`shard_model`): each device takes the loss of its rows, inside a shard_map over
        # that axis alone (the weight's vocabulary split over the model axis stays XLA's to partition). Left to XLA,
        # a loss of more than one chunk would gather every row's hidden states onto every device: its loop over
        # the chunks steps along the token axis, which the data axis splits. A data axis of size 1 splits nothing
        # (and XLA's partitioner rejects the psum over such a manual axis beside a vocabulary-split head).
        rows = P(axes.data_axis)
        return jax.shard_map(
            functools.partial(loss_op.checked_cross_entropy, static, axis_name=axes.data_axis), mesh=axes.mesh,
            in_specs=(P(), rows, rows), out_specs=rows if reduction == "none" else P(),
            axis_names=frozenset({axes.data_axis}))(weight, hidden, targets)

    def compiler_options(self) -> dict:
        """XLA compiler options for the jit of a training step or a full forward of this model, e.g.
        `jax.jit(train_step, compiler_options=model.compiler_options())`. With `scan_layers`, the matrix products
        as cuBLAS calls rather than Triton GEMM fusions, which copies fewer of the layer loop's stacked activations
        (`layer_loop.SCAN_COMPILER_OPTIONS`; GPU options, ignored elsewhere); unrolled, none (no stacks). A new
        dict each call."""
        return dict(SCAN_COMPILER_OPTIONS) if self.scan_layers else {}

    def loss_softmax_backend(self) -> str:
        """The backend `loss` gives its softmax now: `loss_backend`, or its default (see the class)."""
        if self.loss_backend is not None:
            return self.loss_backend
        mixer = self.layers.mixer
        follows = backends.for_op(mixer.backend, loss_op.OP)
        return "xla" if follows == "xla" or mixer.mesh_axes is not None else "auto"

    def _final_hidden(self, input_ids, seq_idx=None):
        """input_ids (batch, seqlen) -> the final norm's output (batch, seqlen, d_model)."""
        hidden, residual = self._embed(input_ids)

        def block_forward(carry, block, seq_idx):
            return block(*carry, seq_idx=seq_idx)

        if self.remat:
            block_forward = nnx.remat(block_forward, policy=None if self.remat is True else remat_policy(self.remat))
        if self.scan_layers:
            graphdef, stacked = nnx.split(self.layers)
            hidden, residual = scan_blocks(
                lambda layer, carry, seq_idx: block_forward(carry, nnx.merge(graphdef, layer), seq_idx), stacked,
                (hidden, residual), seq_idx)
        else:
            hidden, residual = self._unrolled(lambda carry, block: (block_forward(carry, block, seq_idx), None),
                                              (hidden, residual))[0]
        return self._final_norm(hidden, residual)

    def prefill(self, input_ids, cache: Mamba2Cache | None = None, *, seq_idx=None, cache_dtype=None):
        """Forward that also fills the cache.

        Args:
          input_ids: (batch, seqlen) int.
          cache: optional per-layer state (leading (n_layer,) axis) from earlier tokens; None = empty.
          seq_idx: optional (batch, seqlen) int ids of packed sequences, without a cache (see
            `Mamba2.prefill`): the cache continues each row's last sequence.
          cache_dtype: the returned cache's floating dtype (default: None, the given cache's dtypes, else
            `init_cache`'s), each layer's state rounded to it as the layer returns it (see `Mamba2.prefill`).

        Returns:
          (logits (batch, seqlen, padded_vocab), cache with a leading (n_layer,) axis).

        Raises:
          ValueError, TypeError: for input_ids or a cache of the wrong shape or dtype.
        """
        self._check_inputs("Mamba2LMHeadModel.prefill", input_ids, cache, sequence=True, seq_idx=seq_idx)
        _checks.check_float_dtype("Mamba2LMHeadModel.prefill", "cache_dtype", cache_dtype)
        hidden, residual, cache = self._scan_layers_with_cache("prefill", input_ids, cache, seq_idx=seq_idx,
                                                               cache_dtype=cache_dtype)
        return self._logits(hidden, residual), cache

    def step(self, input_ids, cache: Mamba2Cache):
        """One token per row: input_ids (batch,) int -> (logits (batch, padded_vocab), new cache).

        Raises:
          ValueError, TypeError: for input_ids or a cache of the wrong shape or dtype.
        """
        self._check_inputs("Mamba2LMHeadModel.step", input_ids, cache, sequence=False)
        if self.layers.mixer.decodes_fused():
            return self._decode_step(input_ids, cache)
        hidden, residual, cache = self._scan_layers_with_cache("step", input_ids, cache)
        return self._logits(hidden, residual), cache

    def _decode_step(self, input_ids, cache: Mamba2Cache):
        """`step` on the fused decode ops: per layer the block's add + norm with in_proj, the mixer's conv step
        and state update, its gated norm with out_proj (`Mamba2.decode_step`: four kernel launches on a GPU up to
        GATED_NORM_IN_MIXER_ROWS rows, five beyond; out_proj returns its partial products, which the next layer's
        norm kernel sums), then the final add + norm with the LM head (two more). The layers run one after the
        other on their entries of the stacked parameters and cache, read in place: no layer loop, no slice of a
        weight, the SSM state stack updated in place (when XLA may reuse its buffer: inside `generate`'s loop, or
        donated). On the callback backend the whole step's kernels are one callback (`decode_op.token_step`).
        The same values as the composed step (`_scan_layers_with_cache`)."""
        backend = backends.for_op(self.layers.mixer.backend, decode_op.OP)
        step = decode_op.token_step(functools.partial(self._decode_layers_and_head, backend), backend)
        logits, conv_state, ssm_state, group_windows = step(input_ids, cache.conv_state, cache.ssm_state)
        # Every layer's B and C windows in one pass over their channels, once no kernel reads them any more.
        conv_state = decode_op.write_group_windows(conv_state, group_windows, self.layers.mixer.d_ssm)
        return logits, Mamba2Cache(conv_state, ssm_state)

    def _decode_layers_and_head(self, backend, input_ids, conv_state, ssm_state):
        """`_decode_step`'s kernels, the head's on the decode ops' `backend`: (logits, conv_state and ssm_state as
        the layers leave them, every layer's new B and C windows (n_layer, batch, 2 * ngroups * d_state, d_conv))."""
        hidden, residual = self.embedding(input_ids), None
        hidden_dtype = None  # after the first layer: hidden holds out_proj's partial sums of this dtype
        residual_dtype = self._embed_residual_dtype(hidden.dtype)
        group_windows = []
        mixer = self.layers.mixer
        for layer in range(self.config.n_layer):
            input_dtype = hidden.dtype if hidden_dtype is None else hidden_dtype
            residual_dtype = self.layers.residual_dtype(input_dtype, residual_dtype)
            hidden, residual, conv_state, ssm_state, windows = mixer.decode_step(
                hidden, conv_state, ssm_state, layer=layer, pre_norm=(self.layers.norm, residual, residual_dtype),
                hidden_dtype=hidden_dtype, return_partials=True, group_windows_apart=True)
            hidden_dtype = mixer.decode_out_dtype(input_dtype)
            group_windows.append(windows)
        head = (dict(weight=self.embedding.embedding[...], transpose_weight=True) if self.lm_head is None
                else dict(weight=self.lm_head.kernel[...]))
        logits, _ = decode_op.norm_project(
            hidden, **head, norm_weight=self.norm_f.scale[...], residual=residual,
            residual_dtype=jnp.result_type(hidden_dtype, residual), eps=self.norm_f.eps,
            dtype=self.dtype or jnp.result_type(hidden_dtype, head["weight"]), x_dtype=hidden_dtype,
            backend=backend)
        return logits, conv_state, ssm_state, jnp.stack(group_windows)

    def init_cache(self, batch_size: int, dtype=None) -> Mamba2Cache:
        """Zero decode state of all layers: conv_state (n_layer, batch, conv_dim, d_conv), ssm_state
        (n_layer, batch, nheads, headdim, d_state); dtype as in `Mamba2.init_cache`."""
        check_int("Mamba2LMHeadModel.init_cache", "batch_size", batch_size, "an int >= 0", minimum=0)  # 0: no rows
        _checks.check_float_dtype("Mamba2LMHeadModel.init_cache", "dtype", dtype)
        per_layer = self.layers.mixer.init_cache(batch_size, dtype)
        return jax.tree.map(lambda a: jnp.zeros((self.config.n_layer, *a.shape), a.dtype), per_layer)

    def _check_inputs(self, api: str, input_ids, cache, *, sequence: bool, seq_idx=None) -> None:
        """input_ids: (batch, seqlen) (or (batch,) for a step), integer, in [0, vocab_size) where concrete (read
        on the host, a sync of an eager call; a traced id cannot be read, and the embedding's lookup gives NaN for
        one past its rows and counts a negative one from their end); cache (unless None where a sequence is given)
        of the stacked mixers' shapes (leading (n_layer,) axis) for that batch; seq_idx, unless None, as input_ids
        and not with a cache."""
        axes = (("batch", None), ("seqlen", None)) if sequence else (("batch", None),)
        shape = _checks.check_named_array(api, "input_ids", input_ids, axes, kind="integer")
        _checks.check_batch_splits(api, "input_ids", shape[0], self.layers.mixer.mesh_axes)
        check_token_ids_in_range(api, "input_ids", input_ids, self.config.vocab_size)
        if cache is not None or not sequence:  # a step needs one
            layer_axes = (("n_layer", self.config.n_layer),)
            conv_axes, ssm_axes = self.layers.mixer.cache_axes(shape[0])
            _checks.check_cache(api, cache, layer_axes + conv_axes, layer_axes + ssm_axes)
        if sequence:
            _checks.check_layer_seq_idx(api, seq_idx, *shape, cache)

    def _scan_layers_with_cache(self, method: str, input_ids, cache, **block_kwargs):
        """Embeds, then runs `Mamba2Block.<method>` ("prefill" or "step", with `block_kwargs`) over the stacked
        layers, each with its slice of the cache; returns (hidden, residual, new cache)."""
        hidden, residual = self._embed(input_ids)
        block_call = _cached_block_call(method, **block_kwargs)
        if self.scan_layers:
            # Each layer's block is merged from its slice inside the loop (not `nnx.scan` over the module, which
            # refuses Variables made outside the transformation it runs in: a model closed over by jax.jit, vmap,
            # checkpoint or eval_shape, as `__call__` and `loss` take it).
            graphdef, stacked = nnx.split(self.layers)

            def layer_call(carry, layer_and_cache):
                layer, layer_cache = layer_and_cache
                return block_call(carry, nnx.merge(graphdef, layer), layer_cache)

            (hidden, residual), cache = jax.lax.scan(layer_call, (hidden, residual), (stacked, cache))
        else:
            layer_caches = [None] * self.config.n_layer if cache is None else unstack_layers(cache)
            (hidden, residual), layer_caches = self._unrolled(block_call, (hidden, residual), layer_caches)
            cache = stack_layers(layer_caches)
        return hidden, residual, cache

    def _step_unstacked(self, input_ids, layer_caches: list):
        """`step` with the blocks unrolled and the cache as one `Mamba2Cache` per layer: the form of
        `generate`'s decode loop for a model with scan_layers=False, which then never stacks (copies) the
        whole decode state at a token. Returns (logits, the new per-layer caches)."""
        hidden, residual = self._embed(input_ids)
        (hidden, residual), layer_caches = self._unrolled(_cached_block_call("step"), (hidden, residual),
                                                          layer_caches)
        return self._logits(hidden, residual), layer_caches

    def _unrolled(self, fn, carry, per_layer=None):
        """`fn(carry, block[, item]) -> (carry, out)` for each layer in turn, `block` built on the layer's
        slice of the stacked parameters and `item` the layer's entry of the list `per_layer`; returns (carry,
        the list of outs)."""
        graphdef, state = nnx.split(self.layers)
        outs = []
        for layer in range(self.config.n_layer):
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
            carry, out = fn(carry, block) if per_layer is None else fn(carry, block, per_layer[layer])
            outs.append(out)
        return carry, outs

    def _embed(self, input_ids):
        hidden = self.embedding(input_ids)
        return hidden, jnp.zeros_like(hidden, self._embed_residual_dtype(hidden.dtype))  # hidden's varying axes too

    def _embed_residual_dtype(self, hidden_dtype):
        """The dtype of the residual stream before the first block (zeros)."""
        return jnp.promote_types(jnp.float32, hidden_dtype) if self.config.residual_in_fp32 else hidden_dtype

    def _final_norm(self, hidden, residual):
        return self.norm_f.add_norm(hidden, residual, return_residual=False).astype(hidden.dtype)

    def _head(self, hidden):
        if self.lm_head is None:
            return self.embedding.attend(hidden)
        return self.lm_head(hidden)

    def _logits(self, hidden, residual):
        return self._head(self._final_norm(hidden, residual))


def _cached_block_call(method: str, **block_kwargs):
    """(carry, block, layer cache) -> (carry, new layer cache) of `Mamba2Block.<method>` ("prefill" or "step"),
    carry = (hidden, residual): the body of the loops over layers."""
    def block_call(carry, block, layer_cache):
        hidden, residual, layer_cache = getattr(block, method)(*carry, layer_cache, **block_kwargs)
        return (hidden, residual), layer_cache
    return block_call
