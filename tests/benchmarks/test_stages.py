"""benchmarks/stages.py builds the forward and backward plans of every grid shape (timing needs a GPU)."""
import pytest

pytest.importorskip("cuda.tile")

from benchmarks import stages  # noqa: E402
from benchmarks.ssd import GRID, Shape  # noqa: E402
from jax_mamba2.kernels import backward, forward  # noqa: E402


@pytest.mark.parametrize("shape", [Shape(*s) for s in GRID], ids=lambda s: s.label())
def test_stages_plans_cover_every_grid_shape(shape):
    dims = stages.dims_of(shape, 64)
    assert (dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.dstate, dims.ngroups) == tuple(shape)
    fwd, bwd = forward.forward_plan(dims), backward.backward_plan(dims)
    assert len(fwd.launches) == len(forward.FORWARD_LAYOUTS[forward.forward_layout(dims)])
    assert len(bwd.launches) == 7
    assert all(min(launch.grid) >= 1 for launch in fwd.launches + bwd.launches)
