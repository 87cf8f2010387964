"""Head (tensor) parallelism of the Mamba2 mixer: where its arrays live and the collectives between them.

The mixer's fused axes (in_proj's output [z0, x0, z, x, B, C, dt], conv1d's channels [x, B, C]) interleave
head-sharded segments (z0, x0, z, x, dt: split over the "model" mesh axis) with B/C, which are split only when
ngroups % model_size == 0 and otherwise replicated. A contiguous split of a fused axis cannot follow these
segments, so the mixer keeps the mamba_ssm layout and partitions differently:

- in_proj.kernel (d_model, d_in_proj) is split over its *input* rows. `HeadShard.project` gives each device
  exactly its heads' z, x, dt (and its groups' B, C, or all of them) in one of two ways, whichever moves
  fewer bytes: for inputs of fewer tokens than d_model (decode steps, short prefills) each device multiplies
  its rows of d_model and the partial products are reduce-scattered segment by segment (`reduce_split`);
  for more tokens (training, long prefills) the kernel's columns are brought to the devices that need them
  (weights move, activations do not) and each device multiplies the whole input. The latter also keeps the
  backward free of an all-gather of activations (the transpose of a reduce-scatter).
- out_proj.kernel (d_inner, d_model) is split over its input rows (= heads); its partial products are summed.
- conv1d (tiny) is replicated; A_log, dt_bias, D and norm.scale are split over heads.

`HeadShard` describes one device's part. `HeadShard()` (size 1) is the single-device case, in which every
helper is the identity or a plain split, so the mixer has one code path.
"""
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_mamba2.projection import project


def mixer_param_spec(path: tuple[str, ...], model_axis: str) -> P:
    """PartitionSpec of a `Mamba2` parameter (path relative to the mixer, e.g. ("in_proj", "kernel")) under
    head parallelism (see `partition`): in_proj/out_proj kernels split over their input rows, per-head
    parameters over heads, the rest replicated."""
    if path in (("in_proj", "kernel"), ("out_proj", "kernel")):
        return P(model_axis, None)
    if path in (("dt_bias",), ("A_log",), ("D",), ("norm", "scale")):
        return P(model_axis)
    return P()


class Segment(NamedTuple):
    """A piece of a fused axis: its global size and whether it is split over the model axis."""

    size: int
    sharded: bool


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh a sharded LM runs on (set by `shard_model` on each mixer, and with no model axis on the norms outside
    them).

    Attributes:
      mesh: a `jax.sharding.Mesh` with AxisType.Auto axes.
      data_axis: mesh axis that splits the batch.
      model_axis: mesh axis that splits the heads, or None when the heads stay whole (a model axis of size 1:
        naming it would type every value as varying over it, and `shard_map` would refuse the replicated
        outputs).
    """

    mesh: jax.sharding.Mesh
    data_axis: str = "data"
    model_axis: str | None = "model"

    @property
    def model_size(self) -> int:
        return 1 if self.model_axis is None else self.mesh.shape[self.model_axis]


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """One device's share of the heads: inside `jax.shard_map` over `axis` (size devices), or the whole
    layer when axis is None."""

    axis: str | None = None
    size: int = 1

    def rank(self):
        """This device's index along the model axis (0 on a single device)."""
        return 0 if self.axis is None else lax.axis_index(self.axis)

    def slice(self, x, axis: int = -1):
        """This device's contiguous block of a replicated array along `axis`."""
        if self.size == 1:
            return x
        block = x.shape[axis] // self.size
        return lax.dynamic_slice_in_dim(x, self.rank() * block, block, axis)

    def split(self, x, segments, axis: int = -1) -> list:
        """The local pieces of a replicated fused array: a sharded segment's block, a replicated one whole."""
        pieces = jnp.split(x, _offsets(segments), axis=axis)
        return [self.slice(p, axis) if seg.sharded else p for p, seg in zip(pieces, segments)]

    def reduce_split(self, partial, segments) -> list:
        """Sums partial products over the model axis and returns the local pieces of the fused last axis.

        Sharded segments are reduce-scattered in one `psum_scatter`: each is reshaped to (..., size, block)
        and concatenated along the block axis, so device r's blocks are contiguous (rank-major order).
        Replicated segments are summed with one `psum`.
        """
        pieces = jnp.split(partial, _offsets(segments), axis=-1)
        if self.size == 1:
            return pieces
        lead = partial.shape[:-1]
        sharded = [p for p, seg in zip(pieces, segments) if seg.sharded]
        replicated = [p for p, seg in zip(pieces, segments) if not seg.sharded]
        rank_major = jnp.concatenate([p.reshape(*lead, self.size, p.shape[-1] // self.size) for p in sharded],
                                     axis=-1)
        rank_major = rank_major.reshape(*lead, self.size * rank_major.shape[-1])  # no -1: lead may hold a 0
        local_sharded = iter(jnp.split(
            lax.psum_scatter(rank_major, self.axis, scatter_dimension=len(lead), tiled=True),
            _offsets([Segment(p.shape[-1] // self.size, True) for p in sharded]), axis=-1))
        local_replicated = iter(jnp.split(lax.psum(jnp.concatenate(replicated, axis=-1), self.axis),
                                          _offsets([Segment(p.shape[-1], False) for p in replicated]), axis=-1)
                                if replicated else [])
        return [next(local_sharded) if seg.sharded else next(local_replicated) for seg in segments]

    def project(self, inputs, kernel_rows, segments) -> list:
        """The local pieces of `inputs @ kernel` for a kernel split over its input rows (in_proj).

        Args:
          inputs: (..., d_in), whole on every device of the model axis.
          kernel_rows: (d_in / size, d_out), this device's rows, in the dtype of `inputs`.
          segments: the fused output axis (d_out).

        Returns:
          One array (..., local width) per segment: a sharded segment's block of this device, a replicated
          one whole.

        Per device, a reduce-scatter of the partial products moves ~tokens x d_out values (and its transpose,
        in the backward, all-gathers as many), while bringing the kernel's columns moves ~d_in x d_out / size
        weights (an all-to-all, whose transpose is an all-to-all of the kernel's gradient). So the weights
        move when there are more tokens than input features, the activations otherwise. Replicated segments
        (B, C when groups span devices) are summed over the model axis either way, which JAX types as
        replicated (see `gather`).
        """
        tokens = math.prod(inputs.shape[:-1])
        d_in = kernel_rows.shape[0] * self.size
        if self.size == 1 or tokens < d_in:
            return self.reduce_split(project(self.slice(inputs, axis=-1), kernel_rows),
                                     segments)
        pieces = jnp.split(kernel_rows, _offsets(segments), axis=-1)
        sharded = [p for p, seg in zip(pieces, segments) if seg.sharded]
        # Column blocks in rank-major order: the all-to-all sends block r of every segment to device r and
        # stacks the d_in / size rows received from each device in rank order, i.e. all d_in rows.
        rank_major = jnp.concatenate([p.reshape(p.shape[0], self.size, p.shape[1] // self.size) for p in sharded],
                                     axis=-1)
        local_columns = lax.all_to_all(rank_major.reshape(rank_major.shape[0], -1), self.axis, split_axis=1,
                                       concat_axis=0, tiled=True)  # (d_in, local sharded width)
        local_sharded = iter(jnp.split(project(inputs, local_columns),
                                       _offsets([Segment(p.shape[1] // self.size, True) for p in sharded]), axis=-1))
        replicated = [p for p, seg in zip(pieces, segments) if not seg.sharded]
        if replicated:
            whole = self.gather([jnp.concatenate(replicated, axis=-1)], [Segment(d_in, True)], axis=0)
            local_replicated = iter(jnp.split(project(inputs, whole),
                                              _offsets([Segment(p.shape[1], False) for p in replicated]), axis=-1))
        return [next(local_sharded) if seg.sharded else next(local_replicated) for seg in segments]

    def gather(self, pieces, segments, axis: int = -1):
        """Inverse of `split`: the replicated fused array from local pieces.

        A sharded piece is written into zeros at this device's offset and summed over the model axis: unlike
        `lax.all_gather` (typed as still varying over the axis), `psum` yields a value JAX knows to be
        replicated, which `shard_map` needs for a replicated output. Meant for small arrays (cache states).
        """
        if self.size == 1:
            return jnp.concatenate(pieces, axis=axis)
        whole = []
        for piece, seg in zip(pieces, segments):
            if seg.sharded:
                shape = list(piece.shape)
                shape[axis] = seg.size
                zeros = jnp.zeros(shape, piece.dtype)
                piece = lax.psum(lax.dynamic_update_slice_in_dim(zeros, piece, self.rank() * piece.shape[axis],
                                                                 axis), self.axis)
            whole.append(piece)
        return jnp.concatenate(whole, axis=axis)

    def psum(self, x):
        """Sum over the model axis (identity on one device)."""
        return x if self.size == 1 else lax.psum(x, self.axis)

    def sum_split_groups(self, group_size: int, local_features: int):
        """For a norm group larger than this device's features (it spans devices): a function mapping the
        local per-piece sums of squares (..., pieces) to the whole groups' sums (see `jax_mamba2.rms_norm`).
        None when every group is local."""
        if group_size <= local_features:
            return None
        pieces_per_group = group_size // local_features  # this device holds one piece of one group

        def sum_groups(local_sums):  # (..., 1)
            groups = self.size // pieces_per_group
            my_group = self.rank() // pieces_per_group
            one_hot = jax.nn.one_hot(my_group, groups, dtype=local_sums.dtype)  # (groups,)
            totals = lax.psum(local_sums * one_hot, self.axis)  # (..., groups)
            return jnp.sum(totals * one_hot, axis=-1, keepdims=True)

        return sum_groups


def _offsets(segments) -> list[int]:
    """Split points of a fused axis made of `segments`."""
    offsets, total = [], 0
    for seg in segments[:-1]:
        total += seg.size
        offsets.append(total)
    return offsets
