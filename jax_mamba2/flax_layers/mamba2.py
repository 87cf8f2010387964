"""`Mamba2`: the Mamba-2 mixer layer (mamba_ssm `modules/mamba2.py`) as a Flax NNX module.

  zxbcdt = in_proj(u)                               # order: [z0, x0, z, xBC, dt]
  xBC    = silu(causal_conv1d(xBC))                 # xBC = [x, B, C]
  y      = ssd(x, dt, A, B, C, D, dt_bias, dt_softplus=True)
  y      = rmsnorm_gated(y, z)                      # group-wise, norm_before_gate as configured
  y      = concat([silu(z0) * x0, y])               # only when d_ssm < d_inner
  out    = out_proj(y)

Three entry points share this computation: `__call__` (training / full forward), `prefill` (the same, also
returning the decode cache) and `step` (one token in O(1) from the cache: on one device and without the MLP
branch the fused ops of `jax_mamba2.decode` (`decode_step`), else the composed ops with `ssd_step`).
"""
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jax_mamba2 import backends
from jax_mamba2 import conv1d as conv_op
from jax_mamba2 import decode as decode_op
from jax_mamba2 import norm as norm_op
from jax_mamba2.checks import check_flag, check_int, check_size, float_dtype
from jax_mamba2.conv1d import causal_conv1d_silu, causal_conv1d_silu_split
from jax_mamba2.flax_layers import _checks
from jax_mamba2.flax_layers._tree import param_path
from jax_mamba2.flax_layers.cache import Mamba2Cache
from jax_mamba2.flax_layers.conv import CausalConv1d, causal_conv1d_step
from jax_mamba2.flax_layers.initializers import A_log_init, dt_bias_init, torch_uniform
from jax_mamba2.flax_layers.mixer_options import check_mixer_options
from jax_mamba2.flax_layers.norm import RMSNorm
from jax_mamba2.flax_layers.partition import HeadShard, MeshAxes, Segment, mixer_param_spec
from jax_mamba2.projection import project
from jax_mamba2.op import ssd, ssd_step


# The checkpoint name of in_proj's output, what `Mamba2LMHeadModel(remat="matmuls")` keeps for the backward.
IN_PROJ_OUTPUT = "mamba2_in_proj_output"
# Up to this many rows the fused decode step gates and sums the gated norm's input in the mixer step, and out_proj's
# product normalizes it (one launch fewer); every column block of the product scales the rows again, which costs
# more than the norm's own launch once the rows are many (their elementwise work, per block, grows with them).
GATED_NORM_IN_MIXER_ROWS = 8


def _param(variable):
    """A parameter's value, or None for an absent one (a bias the layer was built without)."""
    return None if variable is None else variable[...]


def _silu_output(conv):
    """(silu(y), state) of a conv's (y, state)."""
    y, state = conv
    return jax.nn.silu(y), state


class Mamba2(nnx.Module):
    """The Mamba-2 mixer, with mamba_ssm's parameters, shapes, initialization and math.

    Parameters (mamba_ssm names; Linear weights stored transposed as NNX kernels, (in, out)):
      in_proj.kernel (d_model, d_in_proj), in_proj.bias (d_in_proj,) if bias,
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + nheads;
      conv1d.kernel (d_conv, conv_dim), conv1d.bias (conv_dim,) if conv_bias, conv_dim = d_ssm + 2*ngroups*d_state;
      dt_bias (nheads,), A_log (nheads,), D (nheads,) or (d_ssm,) if D_has_hdim;
      norm.scale (d_ssm,) if rmsnorm; out_proj.kernel (d_inner, d_model), out_proj.bias (d_model,) if bias.
    with d_inner = expand * d_model, nheads = d_ssm // headdim.

    Args:
      d_model: input/output width.
      d_state: SSM state size N (default: 128).
      d_conv: causal conv width (default: 4).
      conv_init: the conv kernel starts uniform in [-conv_init, conv_init] (default: None, PyTorch's default
        U(+-1/sqrt(d_conv)), as mamba_ssm).
      expand: d_inner = expand * d_model (default: 2).
      headdim: head size P (default: 64).
      d_ssm: width of the SSM part (default: None = d_inner); the remaining d_inner - d_ssm features form a
        gated MLP branch silu(z0) * x0.
      ngroups: groups of heads sharing B and C (default: 1).
      A_init_range: A = -exp(A_log) starts uniform in -A_init_range (default: (1, 16)).
      D_has_hdim: D per (head, headdim) instead of per head (default: False).
      rmsnorm: gated RMSNorm after the SSD (default: True); if False, z gates the SSD output directly.
      norm_before_gate: RMSNorm(y) * silu(z) instead of RMSNorm(y * silu(z)) (default: False).
      norm_eps: the gated RMSNorm's epsilon (default: 1e-5, the value mamba_ssm fixes; HF transformers' Mamba2
        takes its `layer_norm_epsilon`, so HF configs set it).
      dt_min, dt_max, dt_init_floor: softplus(dt_bias) starts log-uniform in [dt_min, dt_max], at least
        dt_init_floor (defaults: 0.001, 0.1, 1e-4).
      dt_limit: clip of the time step Δ (default: (0, inf), no clip).
      bias: biases in in_proj and out_proj (default: False).
      conv_bias: bias in conv1d (default: True).
      chunk_size: chunk length of the SSD (power of two; default: 256).
      backend: SSD backend, "auto" | "cutile" | "cutile_callback" | "xla" | "scan" (default: "auto"); the
        conv and the gated norm follow it (`backends.for_op`: "xla" and "scan" keep them in pure JAX).
      deterministic_backward, save_chunk_states, check_finite: options of the SSD's cuTile backends (see
        `ssd`; defaults False, False and True). Not named `deterministic`: `nnx.Module.eval()` sets every such
        attribute. Unlike `ssd`'s, the layer's backward recomputes the chunk states by default, as mamba_ssm's
        does: in a training step that costs 1-2% of its time and saves dstate / 64 times x's bytes per layer.
      dtype: computation dtype (default: None, promoted from inputs and parameters). The dt/state math of the
        SSD and the norms always run in float32 or wider.
      param_dtype: parameter dtype (default: float32).
      rngs: parameter initialization keys.

    Raises:
      ValueError, TypeError: on an inconsistent configuration, naming the option and its value; ValueError for
        sizes no array holds, before any parameter is drawn: a size or a width it gives (d_inner, d_in_proj,
        conv_dim) over 2**31 - 1 (JAX's int32 indices, the kernels' int32 dimensions), or a weight of more than
        2**60 - 1 elements (XLA's int64 byte count).

    Example:
      >>> layer = Mamba2(64, d_state=16, headdim=16, chunk_size=16, rngs=nnx.Rngs(0))
      >>> u = jnp.ones((2, 40, 64))
      >>> layer(u).shape
      (2, 40, 64)
      >>> out, cache = layer.prefill(u)                 # also returns the decode state
      >>> out, cache = layer.step(u[:, 0], cache)       # one more token, O(1)
      >>> out.shape, cache.ssm_state.shape
      ((2, 64), (2, 8, 16, 16))
    """

    def __init__(self, d_model: int, *, d_state: int = 128, d_conv: int = 4, conv_init: float | None = None,
                 expand: int = 2, headdim: int = 64, d_ssm: int | None = None, ngroups: int = 1,
                 A_init_range=(1, 16), D_has_hdim: bool = False, rmsnorm: bool = True, norm_before_gate: bool = False,
                 norm_eps: float = 1e-5, dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_limit=(0.0, math.inf), bias: bool = False, conv_bias: bool = True, chunk_size: int = 256,
                 backend: str = "auto",
                 deterministic_backward: bool = False, save_chunk_states: bool = False, check_finite: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        _checks.check_rngs("Mamba2", rngs)
        d_model = check_size("Mamba2", "d_model", d_model)
        # Every size, the widths they give and the weights' element counts, before any parameter is drawn.
        options, (d_inner, d_ssm, nheads, d_in_proj, conv_dim) = check_mixer_options("Mamba2", d_model, dict(
            d_state=d_state, d_conv=d_conv, conv_init=conv_init, expand=expand, headdim=headdim, d_ssm=d_ssm,
            ngroups=ngroups, A_init_range=A_init_range, D_has_hdim=D_has_hdim, rmsnorm=rmsnorm,
            norm_before_gate=norm_before_gate, norm_eps=norm_eps, dt_min=dt_min, dt_max=dt_max,
            dt_init_floor=dt_init_floor, dt_limit=dt_limit, bias=bias, conv_bias=conv_bias, chunk_size=chunk_size))
        d_state, d_conv, headdim, ngroups, chunk_size = (  # as Python ints
            options[name] for name in ("d_state", "d_conv", "headdim", "ngroups", "chunk_size"))
        D_has_hdim, rmsnorm, norm_before_gate, bias, conv_bias, norm_eps, dt_limit, conv_init = (
            options[name] for name in ("D_has_hdim", "rmsnorm", "norm_before_gate", "bias", "conv_bias", "norm_eps",
                                       "dt_limit", "conv_init"))
        deterministic_backward, save_chunk_states, check_finite = (
            check_flag("Mamba2", name, value) for name, value in dict(
                deterministic_backward=deterministic_backward, save_chunk_states=save_chunk_states,
                check_finite=check_finite).items())
        dtype = None if dtype is None else float_dtype("Mamba2", "dtype", dtype)
        param_dtype = float_dtype("Mamba2", "param_dtype", param_dtype)
        backends.check_name(backend, "Mamba2")

        self.d_model, self.d_state, self.d_conv, self.headdim = d_model, d_state, d_conv, headdim
        self.d_inner, self.d_ssm, self.d_mlp = d_inner, d_ssm, d_inner - d_ssm
        self.nheads, self.ngroups = nheads, ngroups
        self.conv_dim = conv_dim
        self.D_has_hdim, self.rmsnorm, self.dt_limit = D_has_hdim, rmsnorm, dt_limit
        self.chunk_size, self.backend, self.dtype = chunk_size, backend, dtype
        self.deterministic_backward, self.save_chunk_states = deterministic_backward, save_chunk_states
        self.check_finite = check_finite
        # Set by `shard_model`: run head-parallel inside jax.shard_map over this mesh.
        self.mesh_axes: MeshAxes | None = None

        # The nnx.Linear layers hold parameters only; `_project` / `_output` take the products themselves
        # because under head parallelism the contraction is split across devices.
        self.in_proj = nnx.Linear(d_model, d_in_proj, use_bias=bias, param_dtype=param_dtype,
                                  kernel_init=torch_uniform(d_model), bias_init=torch_uniform(d_model), rngs=rngs)
        self.conv1d = CausalConv1d(self.conv_dim, d_conv, use_bias=conv_bias, kernel_bound=conv_init,
                                   param_dtype=param_dtype, rngs=rngs)
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), nheads, dt_min=dt_min, dt_max=dt_max,
                                              dt_init_floor=dt_init_floor, dtype=param_dtype))
        self.A_log = nnx.Param(A_log_init(rngs.params(), nheads, A_init_range=A_init_range, dtype=param_dtype))
        self.D = nnx.Param(jnp.ones((d_ssm,) if D_has_hdim else (nheads,), param_dtype))
        self.norm = (RMSNorm(d_ssm, eps=norm_eps, group_size=d_ssm // ngroups, norm_before_gate=norm_before_gate,
                             backend=backends.for_op(backend, norm_op.OP), param_dtype=param_dtype, rngs=rngs)
                     if rmsnorm else nnx.data(None))
        self.out_proj = nnx.Linear(d_inner, d_model, use_bias=bias, param_dtype=param_dtype,
                                   kernel_init=torch_uniform(d_inner), bias_init=torch_uniform(d_inner), rngs=rngs)

    # ------------------------------------------------------------------------------------------------
    # Public entry points
    # ------------------------------------------------------------------------------------------------
    def __call__(self, hidden_states, *, seq_idx=None):
        """Full forward.

        Args:
          hidden_states: (batch, seqlen, d_model), bfloat16, float16, float32 or float64; seqlen may be 0.
          seq_idx: optional (batch, seqlen) int32 ids of packed sequences (nondecreasing along seqlen): the
            conv and the SSM state restart at every change.

        Returns:
          (batch, seqlen, d_model) in the computation dtype.

        Raises:
          ValueError, TypeError: for arguments of the wrong shape or dtype, naming the expected one.
        """
        batch, seqlen = self._check_hidden_states("Mamba2.__call__", hidden_states)
        _checks.check_layer_seq_idx("Mamba2.__call__", seq_idx, batch, seqlen)
        out, _ = self._run(functools.partial(Mamba2._forward, want_cache=False), (hidden_states, None, seq_idx),
                           returns_cache=False)
        return out

    def prefill(self, hidden_states, cache: Mamba2Cache | None = None, *, seq_idx=None, cache_dtype=None):
        """Full forward that also returns the decode cache.

        Args:
          hidden_states: (batch, seqlen, d_model), bfloat16, float16, float32 or float64; seqlen may be 0 (the
            state passes through).
          cache: optional state left by earlier tokens (chunked prefill); None starts from zeros.
          seq_idx: optional (batch, seqlen) int ids of packed sequences, as in `__call__`, without a cache: the
            returned cache is that of each row's last sequence alone (e.g. a left-padded prompt whose padding is
            sequence 0): the SSM state restarts there, and the conv state's columns of earlier tokens are zero.
          cache_dtype: the returned cache's floating dtype, both fields (default: None, the given cache's dtypes,
            else `init_cache`'s). Rounded here, layer by layer, so that no wider copy of an LM's whole decode
            state is ever held (`Mamba2LMHeadModel.prefill`, `generate(cache_dtype=...)`).

        Returns:
          (out (batch, seqlen, d_model), cache): conv_state = the last d_conv pre-conv xBC columns
          (left-zero-padded), ssm_state = the SSD's final state; in the given cache's dtypes, else
          `init_cache`'s.

        Raises:
          ValueError, TypeError: for arguments of the wrong shape or dtype, naming the expected one.
        """
        batch, seqlen = self._check_hidden_states("Mamba2.prefill", hidden_states)
        if cache is not None:
            _checks.check_cache("Mamba2.prefill", cache, *self.cache_axes(batch))
        _checks.check_layer_seq_idx("Mamba2.prefill", seq_idx, batch, seqlen, cache)
        _checks.check_float_dtype("Mamba2.prefill", "cache_dtype", cache_dtype)
        dtypes = (self._cache_dtypes(cache_dtype) if cache is None or cache_dtype is not None
                  else tuple(a.dtype for a in cache))
        out, new_cache = self._run(functools.partial(Mamba2._forward, want_cache=True),
                                   (hidden_states, cache, seq_idx), returns_cache=True)
        return out, Mamba2Cache(*(a.astype(dtype) for a, dtype in zip(new_cache, dtypes)))

    def step(self, hidden_states, cache: Mamba2Cache):
        """One decode step in O(1) on the cached state, no padding to a chunk: the fused decode ops where they apply
        (`decodes_fused`: `decode_step`), else the composed step with `ssd_step`.

        Unlike mamba_ssm's `step`, dt_limit is applied, so that stepping equals the full forward.

        Args:
          hidden_states: (batch, d_model), bfloat16, float16, float32 or float64: one token per row.
          cache: the state after the previous tokens.

        Returns:
          (out (batch, d_model), new cache in the cache's dtypes).

        Raises:
          ValueError, TypeError: for arguments of the wrong shape or dtype, naming the expected one.
        """
        batch, _ = _checks.check_named_array("Mamba2.step", "hidden_states", hidden_states,
                                             (("batch", None), ("d_model", self.d_model)), kind="floating")
        _checks.check_batch_splits("Mamba2.step", "hidden_states", batch, self.mesh_axes)
        _checks.check_cache("Mamba2.step", cache, *self.cache_axes(batch))
        return self._run(Mamba2._step, (hidden_states, cache), returns_cache=True)

    def init_cache(self, batch_size: int, dtype=None) -> Mamba2Cache:
        """Zero decode state for `batch_size` rows.

        Args:
          batch_size: number of sequences.
          dtype: dtype of both fields (default: None: conv_state in conv1d's parameter dtype, ssm_state in
            in_proj's, as mamba_ssm allocates them).

        Raises:
          TypeError, ValueError: for a batch_size that is not an int >= 0 (0: the state of an empty batch, which
            `step` and `prefill` take as they take any) or a dtype that is not floating.
        """
        check_int("Mamba2.init_cache", "batch_size", batch_size, "an int >= 0", minimum=0)
        _checks.check_float_dtype("Mamba2.init_cache", "dtype", dtype)
        conv_axes, ssm_axes = self.cache_axes(batch_size)
        conv_dtype, ssm_dtype = self._cache_dtypes(dtype)
        return Mamba2Cache(conv_state=jnp.zeros(tuple(size for _, size in conv_axes), conv_dtype),
                           ssm_state=jnp.zeros(tuple(size for _, size in ssm_axes), ssm_dtype))

    def _cache_dtypes(self, dtype=None):
        return dtype or self.conv1d.kernel.dtype, dtype or self.in_proj.kernel.dtype

    def cache_axes(self, batch: int | None) -> tuple[_checks.Axes, _checks.Axes]:
        """The named shapes of `Mamba2Cache`'s conv_state and ssm_state for `batch` rows."""
        return ((("batch", batch), ("conv_dim", self.conv_dim), ("d_conv", self.d_conv)),
                (("batch", batch), ("nheads", self.nheads), ("headdim", self.headdim), ("d_state", self.d_state)))

    def _check_hidden_states(self, api: str, hidden_states) -> tuple[int, int]:
        """hidden_states must be (batch, seqlen, d_model), floating; returns (batch, seqlen)."""
        batch, seqlen, _ = _checks.check_named_array(api, "hidden_states", hidden_states,
                                                     (("batch", None), ("seqlen", None), ("d_model", self.d_model)),
                                                     kind="floating")
        _checks.check_batch_splits(api, "hidden_states", batch, self.mesh_axes)
        return batch, seqlen

    # ------------------------------------------------------------------------------------------------
    # One code path for one device and for one shard of the heads (see `partition`)
    # ------------------------------------------------------------------------------------------------
    def _run(self, fn, arrays: tuple, *, returns_cache: bool):
        """Calls `fn(layer, shard, *arrays) -> (out, cache or None)` on this device, or per shard of the heads
        inside `jax.shard_map` when `mesh_axes` is set. arrays = (hidden_states, cache[, seq_idx]); a None cache
        in is passed through; `returns_cache` says whether fn returns a cache (else None)."""
        if self.mesh_axes is None:
            return fn(self, HeadShard(), *arrays)
        axes = self.mesh_axes
        graphdef, state = nnx.split(self)
        state_specs = jax.tree_util.tree_map_with_path(
            lambda path, _: mixer_param_spec(param_path(path), axes.model_axis), state)
        rows = P(axes.data_axis)
        cache_specs = Mamba2Cache(conv_state=rows, ssm_state=P(axes.data_axis, axes.model_axis))
        array_specs = tuple(None if a is None else spec for a, spec in zip(arrays, (rows, cache_specs, rows)))

        def per_shard(state, *arrays):
            return fn(nnx.merge(graphdef, state), HeadShard(axes.model_axis, axes.model_size), *arrays)

        return jax.shard_map(per_shard, mesh=axes.mesh, in_specs=(state_specs, *array_specs),
                             out_specs=(rows, cache_specs if returns_cache else None))(state, *arrays)

    def _forward(self, shard: HeadShard, hidden_states, cache, seq_idx, *, want_cache: bool):
        batch, seqlen, _ = hidden_states.shape
        conv_state = None if cache is None else cache.conv_state
        z_kept_in = None  # where the gated norm's backward reads z again (in_proj's output, kept anyway)
        if shard.size == 1:
            z0, x0, z, x, B, C, dt, conv_state, zxbcdt = self._project_and_convolve(hidden_states, conv_state,
                                                                                   seq_idx)
            z_kept_in = (zxbcdt, 2 * self.d_mlp)
        else:
            z0, x0, z, x, B, C, dt = self._project(shard, hidden_states)
            x, B, C, conv_state = self._convolve(
                shard, x, B, C, conv_state, want_cache,
                lambda xBC, state, kernel, bias: causal_conv1d_silu(
                    xBC, kernel, bias, seq_idx=seq_idx, initial_states=state, return_final_states=True,
                    backend=backends.for_op(self.backend, conv_op.OP)))
        A, D, dt_bias = self._ssm_params()
        nheads, ngroups = A.shape[0], B.shape[-1] // self.d_state  # this shard's heads and groups
        y, ssm_state = ssd(
            x.reshape(batch, seqlen, nheads, self.headdim), dt, A,
            B.reshape(batch, seqlen, ngroups, self.d_state), C.reshape(batch, seqlen, ngroups, self.d_state),
            self.chunk_size, D=D, z=None if self.rmsnorm else z.reshape(batch, seqlen, nheads, self.headdim),
            dt_bias=dt_bias, dt_softplus=True, dt_limit=self.dt_limit, seq_idx=seq_idx,
            initial_states=None if cache is None else cache.ssm_state.astype(A.dtype),
            return_final_states=True, backend=self.backend, deterministic_backward=self.deterministic_backward,
            save_chunk_states=self.save_chunk_states, check_finite=self.check_finite)
        out = self._output(shard, y, z, z0, x0, z_kept_in)
        return out, (Mamba2Cache(conv_state, ssm_state) if want_cache else None)

    def _step(self, shard: HeadShard, hidden_states, cache: Mamba2Cache):
        if self.decodes_fused():
            out, _, conv_state, ssm_state = self.decode_step(hidden_states, cache.conv_state, cache.ssm_state)
            return out, Mamba2Cache(conv_state, ssm_state)
        batch, _ = hidden_states.shape
        if shard.size == 1:
            z0, x0, z, x, B, C, dt, conv_state = self._project_and_convolve_step(hidden_states, cache.conv_state)
        else:
            z0, x0, z, x, B, C, dt = self._project(shard, hidden_states)
            x, B, C, conv_state = self._convolve(
                shard, x, B, C, cache.conv_state, True,
                lambda xBC, state, kernel, bias: _silu_output(causal_conv1d_step(xBC, state, kernel, bias,
                                                                                 dtype=xBC.dtype)))
        A, D, dt_bias = self._ssm_params()
        nheads, ngroups = A.shape[0], B.shape[-1] // self.d_state  # this shard's heads and groups
        y, ssm_state = ssd_step(
            cache.ssm_state, x.reshape(batch, nheads, self.headdim), dt, A,
            B.reshape(batch, ngroups, self.d_state), C.reshape(batch, ngroups, self.d_state), D=D,
            z=None if self.rmsnorm else z.reshape(batch, nheads, self.headdim), dt_bias=dt_bias,
            dt_softplus=True, dt_limit=self.dt_limit, backend=self.backend)
        return self._output(shard, y, z, z0, x0), Mamba2Cache(conv_state, ssm_state)

    def decodes_fused(self) -> bool:
        """Whether decode steps run on the fused decode ops (`decode_step`): on one device (head parallelism takes
        the composed step) and without the gated MLP branch (d_ssm == d_inner, as in every Mamba-2 checkpoint)."""
        return self.mesh_axes is None and not self.d_mlp

    def decode_step(self, hidden_states, conv_state, ssm_state, *, layer=None, pre_norm=None, hidden_dtype=None,
                    return_partials=False, group_windows_apart=False):
        """One token through the mixer on the fused decode ops (`jax_mamba2.decode`): in_proj (after the block's
        add + norm, with `pre_norm`), the conv step + SSD state update, the gated norm + out_proj: on a GPU each
        projection's norm and product kernels and the mixer step, five launches; up to GATED_NORM_IN_MIXER_ROWS rows
        four, the mixer step gating and summing the squares of the norm's input and out_proj's product normalizing
        as it loads it. At a few rows, where out_proj's K is split over blocks, one more sums its partial products,
        unless `return_partials` leaves that to the next layer's norm. The same values as the composed step; see
        `decodes_fused` for when it applies.

        Args:
          hidden_states: (batch, d_model).
          conv_state, ssm_state: the layer's cache fields, or with `layer` the stacks of every layer's (leading
            (n_layer,) axis) of a module whose parameters are stacks (the LM's layers).
          layer: None, or which layer of the stacked parameters and cache to run (an int or an int32 scalar).
          pre_norm: None, or (norm, residual, residual_dtype): the block's `RMSNorm` (its scale a stack with
            `layer`) applied to hidden_states + residual (None: no residual yet) in the residual stream's dtype,
            fused into in_proj's launch.
          hidden_dtype: with pre_norm, hidden_states may be (parts, batch, d_model) float32 partial sums (the
            previous layer's out with return_partials) whose sum rounded to hidden_dtype is the input.
          return_partials: out as (parts, batch, d_model) float32 partial sums whose sum rounded to
            `decode_out_dtype(hidden dtype)` is out (`jax_mamba2.decode.norm_project`): the next layer's norm
            sums them, so out_proj's split K needs no launch of its own.
          group_windows_apart: with `layer`, conv_state comes back with B's and C's channels of the layer as they
            were, and their new windows apart (`jax_mamba2.decode.mixer_step`), for the caller to write.

        Returns:
          (out (batch, d_model) (partial sums with return_partials), the new residual stream (None without
          pre_norm), conv_state and ssm_state with the layer's states advanced (the whole stacks with `layer`)),
          and with group_windows_apart B's and C's new windows (batch, 2 * ngroups * d_state, d_conv) last.
        """
        backend = backends.for_op(self.backend, decode_op.OP)
        in_kernel = self.in_proj.kernel[...]
        input_dtype = hidden_states.dtype if hidden_dtype is None else hidden_dtype
        in_dtype = self.decode_in_dtype(input_dtype)
        residual = None
        if pre_norm is None:
            zxbcdt = decode_op.norm_project(hidden_states, in_kernel, bias=_param(self.in_proj.bias), layer=layer,
                                            dtype=in_dtype, backend=backend)
        else:
            norm, residual, residual_dtype = pre_norm
            zxbcdt, residual = decode_op.norm_project(
                hidden_states, in_kernel, norm_weight=norm.scale[...], residual=residual,
                residual_dtype=residual_dtype, eps=norm.eps, bias=_param(self.in_proj.bias), layer=layer,
                dtype=in_dtype, x_dtype=hidden_dtype, backend=backend)
        D = self.D[...]
        if self.D_has_hdim:
            D = D.reshape(*D.shape[:-1], self.nheads, self.headdim)
        # At a few rows, with the gated norm, the step also gates y for the norm and sums its squares (where the
        # norm's groups are whole heads, as in every Mamba-2 config): out_proj's product then normalizes its rows
        # as it loads them, with no launch of the norm. Each of its column blocks repeats that scaling of the rows,
        # which only a few rows keep cheap. A symbolic row count (a shape-polymorphic export) takes the general form.
        rows = hidden_states.shape[-2]
        sums = (self.rmsnorm and isinstance(rows, int) and rows <= GATED_NORM_IN_MIXER_ROWS
                and (self.norm.group_size or self.d_ssm) % self.headdim == 0)
        gated_norm = {} if not sums else dict(
            norm_z_offset=2 * self.d_mlp, norm_group_size=self.norm.group_size,
            norm_before_gate=self.norm.norm_before_gate)
        y, ssm_state, conv_state, *rest = decode_op.mixer_step(
            zxbcdt, conv_state, ssm_state, self.conv1d.kernel[...], _param(self.conv1d.bias), self.A_log[...],
            self.dt_bias[...], D, nheads=self.nheads, headdim=self.headdim, ngroups=self.ngroups,
            dstate=self.d_state, xbc_offset=self._xbc_offset, dt_offset=self._xbc_offset + self.conv_dim,
            z_offset=None if self.rmsnorm else 2 * self.d_mlp, dt_limit=self.dt_limit, **gated_norm, layer=layer,
            group_windows_apart=group_windows_apart, backend=backend)
        group_windows = rest[:1] if group_windows_apart else ()
        sum_squares = rest[len(group_windows):]
        out_kernel = self.out_proj.kernel[...]
        norm = {}
        if self.rmsnorm:  # with the sums, y is the norm's input, gated unless the gate follows the norm
            gate = not sums or self.norm.norm_before_gate
            norm = dict(norm_weight=self.norm.scale[...], z=zxbcdt if gate else None, z_offset=2 * self.d_mlp,
                        group_size=self.norm.group_size, norm_before_gate=self.norm.norm_before_gate,
                        eps=self.norm.eps, sum_squares=sum_squares[0] if sums else None)
        out = decode_op.norm_project(y, out_kernel, **norm, bias=_param(self.out_proj.bias), layer=layer,
                                     dtype=self.decode_out_dtype(input_dtype),
                                     return_partials=return_partials, backend=backend)
        return (out, residual, conv_state, ssm_state, *group_windows)

    def decode_in_dtype(self, hidden_dtype):
        """The dtype of `decode_step`'s in_proj output (and of its mixer step) for hidden states of hidden_dtype:
        the mixer's compute dtype, else the result type of the input and in_proj's weight."""
        return self.dtype or jnp.result_type(hidden_dtype, self.in_proj.kernel[...].dtype)

    def decode_out_dtype(self, hidden_dtype):
        """The dtype of `decode_step`'s out (of the sum of its partial sums) for hidden states of hidden_dtype: the
        mixer's compute dtype, else the result type of its input and its projections' weights."""
        return self.dtype or jnp.result_type(self.decode_in_dtype(hidden_dtype), self.out_proj.kernel[...].dtype)

    # ------------------------------------------------------------------------------------------------
    # Pieces
    # ------------------------------------------------------------------------------------------------
    def _groups_sharded(self, shard: HeadShard) -> bool:
        """B and C are split over the model axis when every device gets whole groups."""
        return self.ngroups % shard.size == 0

    def _in_proj_segments(self, shard: HeadShard):
        """in_proj's output axis: [z0, x0, z, x, B, C, dt]."""
        bc = Segment(self.ngroups * self.d_state, self._groups_sharded(shard))
        return (Segment(self.d_mlp, True), Segment(self.d_mlp, True), Segment(self.d_ssm, True),
                Segment(self.d_ssm, True), bc, bc, Segment(self.nheads, True))

    def _conv_segments(self, shard: HeadShard):
        """conv1d's channel axis: [x, B, C]."""
        bc = Segment(self.ngroups * self.d_state, self._groups_sharded(shard))
        return Segment(self.d_ssm, True), bc, bc

    def _project(self, shard: HeadShard, hidden_states):
        """in_proj, split into this shard's (z0, x0, z, x, B, C, dt), each (..., local width)."""
        kernel = self.in_proj.kernel[...]  # (d_model / shard.size, d_in_proj): this shard's input rows
        dtype = self.dtype or jnp.result_type(hidden_states, kernel)
        segments = self._in_proj_segments(shard)
        pieces = shard.project(hidden_states.astype(dtype), kernel.astype(dtype), segments)
        if self.in_proj.bias is not None:
            pieces = [p + b.astype(dtype) for p, b in zip(pieces, shard.split(self.in_proj.bias[...], segments))]
        return [checkpoint_name(p, IN_PROJ_OUTPUT) for p in pieces]

    def _project_and_convolve(self, hidden_states, conv_state, seq_idx):
        """in_proj and the causal conv + SiLU of the whole layer (one device, no head split).

        The conv reads xBC straight from in_proj's output (batch, seqlen, d_in_proj) and writes x, B and C as
        separate arrays (`causal_conv1d_silu_split`): one launch each way on the kernel backends, and no slice,
        concatenate or split copy between in_proj, the conv and the SSD. The gates and dt pass through the op
        (`pass_through`): its forward launch copies them out, and its backward kernel writes in_proj's whole
        output cotangent (no XLA slice of in_proj's output, no pad and add of three cotangents).

        Returns:
          (z0, x0, z, x, B, C, dt, conv_state, zxbcdt): (..., width) each, the new (batch, conv_dim, d_conv)
          conv state, and in_proj's whole output (which the conv's backward keeps, and where the gated norm's
          backward reads z again instead of keeping the conv's copy of it).
        """
        zxbcdt = self._in_proj_whole(hidden_states)
        bias = self.conv1d.bias
        bc = self.ngroups * self.d_state
        (gates, x, B, C, dt), conv_state = causal_conv1d_silu_split(
            zxbcdt, self.conv1d.kernel[...], None if bias is None else bias[...], channel_offset=self._xbc_offset,
            split=(self.d_ssm, bc, bc), seq_idx=seq_idx, initial_states=conv_state, return_final_states=True,
            pass_through=True, backend=backends.for_op(self.backend, conv_op.OP))
        return (*self._gates(gates), x, B, C, dt, conv_state, zxbcdt)

    def _project_and_convolve_step(self, hidden_states, conv_state):
        """`_project_and_convolve` for one token per row, (batch, d_model): the conv step runs on in_proj's
        xBC columns whole (one fused XLA pass, no concatenate of B and C), then splits them into x, B, C."""
        zxbcdt = self._in_proj_whole(hidden_states)
        bias = self.conv1d.bias
        xBC = zxbcdt[..., self._xbc_offset:self._xbc_offset + self.conv_dim]
        xBC, conv_state = _silu_output(causal_conv1d_step(xBC, conv_state, self.conv1d.kernel[...],
                                                          None if bias is None else bias[...], dtype=xBC.dtype))
        x, B, C = jnp.split(xBC, [self.d_ssm, self.d_ssm + self.ngroups * self.d_state], axis=-1)
        return (*self._gates(zxbcdt), x, B, C, zxbcdt[..., self._xbc_offset + self.conv_dim:], conv_state)

    @property
    def _xbc_offset(self) -> int:
        """Where xBC starts in in_proj's output [z0, x0, z, xBC, dt]."""
        return 2 * self.d_mlp + self.d_ssm

    def _in_proj_whole(self, hidden_states):
        """in_proj's whole output (..., d_in_proj) = [z0, x0, z, xBC, dt] in the computation dtype."""
        kernel = self.in_proj.kernel[...]
        dtype = self.dtype or jnp.result_type(hidden_states, kernel)
        zxbcdt = project(hidden_states, kernel, dtype=dtype)
        if self.in_proj.bias is not None:
            zxbcdt = zxbcdt + self.in_proj.bias[...].astype(dtype)
        return checkpoint_name(zxbcdt, IN_PROJ_OUTPUT)

    def _gates(self, zxbcdt) -> tuple:
        """(z0, x0, z) of in_proj's output (or of its columns before xBC)."""
        return tuple(jnp.split(zxbcdt[..., :self._xbc_offset], [self.d_mlp, 2 * self.d_mlp], axis=-1))

    def _convolve(self, shard: HeadShard, x, B, C, conv_state, want_state: bool, apply):
        """The causal conv + SiLU on this shard's channels [x, B, C] under head parallelism (one device takes
        `_project_and_convolve` and `_project_and_convolve_step`).

        x and [B, C] are convolved separately: under head parallelism x is split over devices while B and C
        may be replicated, and keeping them apart keeps the replicated part provably replicated.

        Args:
          x, B, C: in_proj outputs, (..., local width) each.
          conv_state: the cache's (batch, conv_dim, d_conv) state or None.
          want_state: also assemble the new full conv_state (see `HeadShard.gather`).
          apply: (inputs, local conv_state or None, kernel, bias or None) -> (silu(conv output), new local
            state).

        Returns:
          (x, B, C, conv_state): B and C reduced to the groups of this shard's heads; conv_state None unless
          want_state.
        """
        segments = self._conv_segments(shard)
        params = [shard.split(p[...], segments, axis=-1) if p is not None else [None] * 3
                  for p in (self.conv1d.kernel, self.conv1d.bias)]
        states = [None] * 3 if conv_state is None else shard.split(conv_state, segments, axis=1)

        def concat(pieces, axis):
            return None if pieces[0] is None else jnp.concatenate(pieces, axis=axis)

        x, x_state = apply(x, states[0], params[0][0], params[1][0])
        BC, BC_state = apply(jnp.concatenate([B, C], axis=-1), concat(states[1:], axis=1),
                             concat(params[0][1:], axis=-1), concat(params[1][1:], axis=-1))
        B, C = jnp.split(BC, 2, axis=-1)
        if not self._groups_sharded(shard):  # all groups here: keep the one of this shard's heads
            start = (shard.rank() // (shard.size // self.ngroups)) * self.d_state
            B, C = (jax.lax.dynamic_slice_in_dim(a, start, self.d_state, axis=-1) for a in (B, C))
        if not want_state:
            return x, B, C, None
        return x, B, C, shard.gather([x_state, *jnp.split(BC_state, 2, axis=1)], segments, axis=1)

    def _ssm_params(self):
        """A = -exp(A_log) (float32 or wider), D ((nheads,) or (nheads, headdim)) and dt_bias, this shard's heads."""
        A_log = self.A_log[...]
        A = -jnp.exp(A_log.astype(jnp.promote_types(jnp.float32, A_log.dtype)))
        D = self.D[...]
        if self.D_has_hdim:
            D = D.reshape(-1, self.headdim)
        return A, D, self.dt_bias[...]

    def _output(self, shard: HeadShard, y, z, z0, x0, z_kept_in=None):
        """Gated norm, MLP branch and out_proj; y (..., local nheads, headdim) -> (..., d_model); z_kept_in as in
        `jax_mamba2.rms_norm`."""
        y = y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])
        if self.rmsnorm:
            y = self.norm(y, z, sum_groups=shard.sum_split_groups(self.d_ssm // self.ngroups, y.shape[-1]),
                          z_kept_in=z_kept_in)
        if self.d_mlp:
            y = jnp.concatenate([jax.nn.silu(z0) * x0, y], axis=-1)
        kernel = self.out_proj.kernel[...]  # (d_inner / shard.size, d_model): this shard's heads' rows
        dtype = self.dtype or jnp.result_type(y, kernel)
        out = shard.psum(project(y, kernel, dtype=dtype))
        if self.out_proj.bias is not None:
            out = out + self.out_proj.bias[...].astype(dtype)
        return out

