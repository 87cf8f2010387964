"""The sharded LM's training step against one device, on fake CPU devices (tests/conftest.py).

The step is benchmarks/lm_train_mesh.py's (the one the GPU benchmark times): `Mamba2LMHeadModel` with f32
parameters, next-token cross-entropy, AdamW, jitted. Per mesh: the compiled HLO's collectives (data: the
gradients all-reduced, nothing gathered; model: the reduction after out_proj, the in_proj weights moved
instead of its activations, no activation all-gathered), the losses of 20 steps and the parameters after
them against one device's.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import hlo_collectives
from benchmarks.lm_train_mesh import (LOSS_RTOL_BF16, LOSS_RTOL_F32, MeshShape, build_trainer, model_config,
                                      progression_batches)
from jax_mamba2.flax_layers import Mamba2Config

GLOBAL_BATCH, SEQLEN, STEPS = 4, 36, 20  # 72 or 144 tokens per device >= d_model 64: in_proj moves weights
D_MODEL, N_LAYER = 64, 2
FAST_COMPILE = (("xla_backend_optimization_level", 0),)  # the same program, compiled in about half the time
ONE, DATA2, MODEL2, DATA2_MODEL2 = MeshShape(1, 1), MeshShape(2, 1), MeshShape(1, 2), MeshShape(2, 2)
slow = pytest.mark.slow  # each case compiles a training step or two: 10-50 s on a loaded 2-core CPU


class Setup(NamedTuple):
    """What is trained: the model, the batch and how the step is compiled."""

    config: Mamba2Config
    global_batch: int
    seqlen: int
    backend: str
    compiler_options: tuple  # (name, value) pairs


def _config(ngroups):
    return model_config(f"d{D_MODEL}-l{N_LAYER}", d_state=16, headdim=16, ngroups=ngroups, chunk_size=16,
                        vocab_size=100)


def _cpu(ngroups: int) -> Setup:
    return Setup(_config(ngroups), GLOBAL_BATCH, SEQLEN, "xla", FAST_COMPILE)


# 512 tokens per GPU >= d_model 256: in_proj moves weights, as in training at scale.
GPU = Setup(model_config("d256-l2", d_state=128, headdim=64, chunk_size=64, vocab_size=1000), 4, 512, "cutile", ())


class Run(NamedTuple):
    losses: np.ndarray  # (STEPS,)
    initial: list  # parameter leaves before and after the steps, as float64 NumPy arrays
    final: list
    hlo: str


@functools.cache
def _train(mesh: MeshShape, dtype: str, setup: Setup) -> Run:
    """STEPS AdamW steps on `mesh` (data=1,model=1: one device, no mesh)."""
    trainer = build_trainer(setup.config, mesh, global_batch=setup.global_batch, seqlen=setup.seqlen,
                            dtype=jnp.dtype(dtype), backend=setup.backend, lr=1e-3,
                            compiler_options=dict(setup.compiler_options) or None)
    params, opt_state = trainer.params, trainer.opt_state
    initial = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
    losses = []
    for tokens in progression_batches(STEPS, setup.global_batch, setup.seqlen, setup.config.vocab_size):
        params, opt_state, loss = trainer.step(params, opt_state, trainer.put(tokens))
        losses.append(float(loss))
    return Run(np.array(losses), initial, [np.asarray(p, np.float64) for p in jax.tree.leaves(params)],
               trainer.step.as_text())


def _activation_extents(mesh: MeshShape, setup: Setup):
    """batch x seqlen of the mesh and of one device."""
    return setup.global_batch * setup.seqlen, setup.global_batch // mesh.data * setup.seqlen


# ------------------------------------------------------------------------------------------------
# Collectives of the compiled step
# ------------------------------------------------------------------------------------------------

@slow
def test_data_parallel_step_all_reduces_every_gradient_once_and_gathers_nothing():
    found = hlo_collectives.collectives(_train(DATA2, "float32", _cpu(1)).hlo)
    assert {c.kind for c in found} == {"all-reduce"}, [c.describe() for c in found]
    assert {c.group_size for c in found} == {2}
    # The weight matrices' gradients are all-reduced whole (a layer's slice inside the layer loop; smaller
    # parameters may go in pieces, e.g. conv1d's x and B/C channels apart).
    reduced = {_squeeze(dims) for c in found for _, dims in c.shapes}
    d_in_proj = 2 * 2 * D_MODEL + 2 * 16 + 8
    for matrix in [(D_MODEL, d_in_proj), (2 * D_MODEL, D_MODEL), (_config(1).padded_vocab_size, D_MODEL)]:
        assert matrix in reduced, (matrix, [c.describe() for c in found])
    leaves = _train(ONE, "float32", _cpu(1)).initial
    # Bytes per step: the f32 gradients once, plus a few scalars (the loss and the chunked loss's count of
    # scored tokens), plus (on the CPU pipeline, which does not reassociate all-reduces) the tied embedding's
    # second gradient term before the two are added.
    gradient_bytes = sum(leaf.size * 4 for leaf in leaves)
    embedding_bytes = _config(1).padded_vocab_size * D_MODEL * 4
    moved = hlo_collectives.totals(found)["all-reduce"]["bytes"]
    assert gradient_bytes <= moved <= gradient_bytes + embedding_bytes + 256, (moved, gradient_bytes)


@slow
@pytest.mark.parametrize("mesh, ngroups", [
    (MODEL2, 1),  # B, C all-reduced, each device keeps its heads' group
    (MODEL2, 2),  # one group per device: B, C split like the heads
    (DATA2_MODEL2, 2),
], ids=["model=2-ngroups1", "model=2-ngroups2", "data=2,model=2-ngroups2"])
def test_head_parallel_step_reduces_after_out_proj_and_gathers_no_activation(mesh, ngroups):
    found = hlo_collectives.collectives(_train(mesh, "float32", _cpu(ngroups)).hlo)
    extents = _activation_extents(mesh, _cpu(ngroups))
    local_tokens = extents[1]
    assert hlo_collectives.with_extent(found, *extents, kind="all-gather") == []
    assert hlo_collectives.with_extent(found, *extents, kind="reduce-scatter") == []
    # out_proj's partial sums: an all-reduce of (batch, seqlen, d_model) over the model axis in every layer.
    out_proj = [c for c in found if c.kind == "all-reduce" and not c.in_backward and c.group_size == mesh.model
                and any(_squeeze(dims) == (local_tokens // SEQLEN, SEQLEN, D_MODEL) for _, dims in c.shapes)]
    assert any(c.executions == N_LAYER for c in out_proj), [c.describe() for c in found]
    # in_proj: its kernel's columns come by an all-to-all of weights (d_model / model rows), forward and
    # backward (the gradient goes back the same way), once per layer each.
    in_proj = [c for c in found if c.kind == "all-to-all"]
    assert sorted(c.in_backward for c in in_proj) == [False, True], [c.describe() for c in found]
    assert all(c.executions == N_LAYER and not c.has_extent(local_tokens) for c in in_proj)
    assert all(dims[0] == D_MODEL // mesh.model for c in in_proj for _, dims in c.shapes)


def _squeeze(dims):
    return tuple(d for d in dims if d != 1)


# ------------------------------------------------------------------------------------------------
# Losses and parameters against one device
# ------------------------------------------------------------------------------------------------

@slow
@pytest.mark.parametrize("mesh, ngroups", [
    (DATA2, 1),
    (MODEL2, 1),
    (MODEL2, 2),
    (DATA2_MODEL2, 2),
], ids=["data=2-ngroups1", "model=2-ngroups1", "model=2-ngroups2", "data=2,model=2-ngroups2"])
def test_float32_training_matches_one_device(mesh, ngroups):
    expected, sharded = _train(ONE, "float32", _cpu(ngroups)), _train(mesh, "float32", _cpu(ngroups))
    assert expected.losses[-1] < expected.losses[0] - 0.1  # the steps train: the comparison is not of noise
    np.testing.assert_allclose(sharded.losses, expected.losses, rtol=LOSS_RTOL_F32)  # seen: 3e-7
    _assert_updates_match(sharded, expected, rtol=5e-4)  # seen: 4e-6 (data), 1e-4 (model)


@slow
@pytest.mark.parametrize("mesh", [DATA2, MODEL2], ids=["data=2", "model=2"])
def test_bfloat16_training_matches_one_device_to_bf16_rounding(mesh):
    # bf16 computation, f32 parameters: the sharded step sums partial products across devices in bf16 where
    # one device accumulates them in f32 inside one matrix product, so losses agree to one bf16 rounding.
    expected, sharded = _train(ONE, "bfloat16", _cpu(1)), _train(mesh, "bfloat16", _cpu(1))
    assert expected.losses[-1] < expected.losses[0] - 0.1
    np.testing.assert_allclose(sharded.losses, expected.losses, rtol=LOSS_RTOL_BF16)  # seen: 2e-4
    _assert_updates_match(sharded, expected, rtol=5e-2)  # seen: 6e-3 (data), 2e-2 (model)


def _assert_updates_match(sharded: Run, expected: Run, *, rtol: float):
    """Relative L2 error of every parameter's change over the steps (the parameters themselves would hide
    a wrong update behind their initial values). AdamW divides each gradient element by its running RMS,
    so a rounding difference in a small gradient weighs as much in the update as in a large one."""
    for i, (start, got, want) in enumerate(zip(expected.initial, sharded.final, expected.final)):
        np.testing.assert_array_equal(sharded.initial[i], start)
        update, error = want - start, got - want
        assert np.linalg.norm(error) <= rtol * np.linalg.norm(update) + 1e-12, (i, start.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("mesh", [DATA2, MODEL2], ids=["data=2", "model=2"])
def test_two_gpus_train_like_one_with_the_cutile_backend(mesh):
    if len(jax.devices()) < 2:
        pytest.skip(f"needs 2 GPUs (the nvidia-h200-x2 machine); {len(jax.devices())} visible")
    expected, sharded = _train(ONE, "bfloat16", GPU), _train(mesh, "bfloat16", GPU)
    found = hlo_collectives.collectives(sharded.hlo)
    assert hlo_collectives.with_extent(found, *_activation_extents(mesh, GPU), kind="all-gather") == [], \
        [c.describe() for c in found]
    assert expected.losses[-1] < expected.losses[0] - 0.1
    np.testing.assert_allclose(sharded.losses, expected.losses, rtol=LOSS_RTOL_BF16)
    _assert_updates_match(sharded, expected, rtol=5e-2)
