"""The kernel options of `ssd` (deterministic_backward, save_chunk_states, check_finite) are static arguments:
each value is a program of its own, traced once and then reused; the Flax layers pass them through."""
import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2 import backends
from jax_mamba2.flax_layers import Mamba2, Mamba2Config, Mamba2LMHeadModel
from jax_mamba2.flax_layers import mamba2 as mamba2_module
from tests._helpers import make_ssd_args

DIMS = dict(batch=2, seqlen=96, nheads=4, headdim=16, ngroups=2, dstate=16)


def _cutile_calls(jaxpr) -> list[str]:
    from jax_mamba2.kernels._common import kernel_name  # needs cuda.tile, which only these programs have
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cutile_call_ffi":
            names.append(kernel_name(eqn.params["kernel"]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names.extend(_cutile_calls(sub))
    return names


def _primitives(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names.extend(_primitives(sub))
    return names


@pytest.fixture
def cutile_traced(monkeypatch) -> str:
    """The name of a backend that is the cutile one without its GPU check: its programs trace on the CPU
    (lowering them would need a GPU)."""
    pytest.importorskip("cuda.tile")
    traced_backend = dataclasses.replace(backends.get("cutile", "test"), name="cutile_traced", auto_priority=0,
                                         unsupported_reason=lambda inputs, static: None)
    monkeypatch.setitem(backends._REGISTRY["ssd"], traced_backend.name, traced_backend)
    return traced_backend.name


def test_backward_options_change_the_program_and_each_is_traced_once(monkeypatch, cutile_traced):
    """The cuTile backward traced on the CPU: a new option value is a new trace with other kernels or
    plans, a repeated one reuses the cached trace."""
    from jax_mamba2.bridge import tuning

    planned = []
    backward_configs = tuning.backward_configs
    monkeypatch.setattr(tuning, "backward_configs", lambda dims, det: planned.append(det) or
                        backward_configs(dims, det))
    args, _ = make_ssd_args(6, **DIMS, dtype=jnp.bfloat16)
    traces = []

    @functools.partial(jax.jit, static_argnames=("deterministic_backward", "save_chunk_states"))
    def grad(x, *, deterministic_backward, save_chunk_states):
        traces.append((deterministic_backward, save_chunk_states))

        def loss(x):
            y = jax_mamba2.ssd(x, *args[1:], 64, backend=cutile_traced,
                               deterministic_backward=deterministic_backward, save_chunk_states=save_chunk_states)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss)(x)

    def program(deterministic_backward, save_chunk_states):
        return grad.trace(args[0], deterministic_backward=deterministic_backward,
                          save_chunk_states=save_chunk_states).jaxpr

    default = program(False, True)
    assert str(program(False, True)) == str(default)
    deterministic, recomputing = program(True, True), program(False, False)
    assert str(program(True, True)) == str(deterministic)
    assert traces == [(False, True), (True, True), (False, False)]
    assert planned == [False, True, False]  # the backward plans follow the option
    assert str(deterministic) != str(default)
    kernels = {name: _cutile_calls(j.jaxpr) for name, j in
               (("default", default), ("recomputing", recomputing))}
    # Without saved states the backward recomputes them: one more chunk_state and chunk_cumsum launch.
    for kernel in ("chunk_state_fwd_kernel", "chunk_cumsum_fwd_kernel"):
        assert kernels["recomputing"].count(kernel) == kernels["default"].count(kernel) + 1, kernels


def test_check_finite_false_runs_the_same_kernels_without_the_check(cutile_traced):
    """With check_finite (the default) the kernels of a differentiated call take the finite part of their
    inputs and cotangents (a finiteness test of each) and no conditional; without it the same kernels take
    the arrays as they are; each value is traced once."""
    args, _ = make_ssd_args(7, **DIMS, dtype=jnp.bfloat16)
    traces = []

    @functools.partial(jax.jit, static_argnames="check_finite")
    def grad(x, *, check_finite):
        traces.append(check_finite)

        def loss(x):
            y = jax_mamba2.ssd(x, *args[1:], 64, backend=cutile_traced, check_finite=check_finite)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss)(x)

    checked, unchecked = (grad.trace(args[0], check_finite=flag).jaxpr.jaxpr for flag in (True, False))
    assert str(grad.trace(args[0], check_finite=True).jaxpr.jaxpr) == str(checked)
    assert traces == [True, False]
    checked_ops, unchecked_ops = _primitives(checked), _primitives(unchecked)
    assert "cond" not in checked_ops and "is_finite" in checked_ops
    assert "cond" not in unchecked_ops and "is_finite" not in unchecked_ops
    assert _cutile_calls(unchecked) == _cutile_calls(checked) and _cutile_calls(unchecked)


def test_layers_pass_the_kernel_options_to_ssd_and_eval_leaves_them(monkeypatch):
    """Mamba2 hands its options to every ssd call; the LM passes them to each mixer; `nnx.Module.eval()`
    (which sets attributes named `deterministic`) leaves them alone."""
    seen = []

    def recording_ssd(*args, **kwargs):
        seen.append((kwargs["deterministic_backward"], kwargs["save_chunk_states"], kwargs["check_finite"]))
        return jax_mamba2.ssd(*args, **kwargs)

    monkeypatch.setattr(mamba2_module, "ssd", recording_ssd)
    options = dict(deterministic_backward=True, save_chunk_states=False, check_finite=False)
    layer = Mamba2(32, d_state=8, headdim=8, chunk_size=16, backend="xla", **options, rngs=nnx.Rngs(0))
    layer.eval()
    assert (layer.deterministic_backward, layer.save_chunk_states, layer.check_finite) == (True, False, False)
    layer(jnp.ones((1, 8, 32)))
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=16, ssm_cfg=dict(d_state=8, headdim=8, chunk_size=16))
    model = Mamba2LMHeadModel(config, backend="xla", **options, rngs=nnx.Rngs(0))
    model(jnp.zeros((1, 8), jnp.int32))
    assert seen and set(seen) == {(True, False, False)}
