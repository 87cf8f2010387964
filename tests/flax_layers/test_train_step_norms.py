"""The XLA program around the norm kernels in the LM's training step (traced for sm_90 on the CPU, no GPU): the
kernels take the activations as they come (reshapes only: no dtype conversion, broadcast or reduction pass over
a per-row array before, inside or after a launch, not even the final norm's zero residual cotangent), and the
weight gradient's partials are summed by the kernels' own reduction, never by an XLA reduce."""
import jax
import jax.extend
import jax.numpy as jnp
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from tests.flax_layers._programs import walk

aot = pytest.importorskip("jax_mamba2.bridge.aot")

BATCH, SEQLEN = 3, 40  # no parameter has an axis of 120 = BATCH * SEQLEN rows
NORM_KERNELS = ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rms_norm_dweight_kernel")


def _kernel_names(jaxpr) -> list[str]:
    return [eqn.params["kernel"]._annotated_function.pyfunc.__name__
            for eqn, _ in walk(jaxpr) if eqn.primitive.name == "cutile_call_ffi"]


def _norm_calls(jaxpr):
    """(eqn, producers, consumers) of every custom_vmap_call that launches norm kernels, with the equations of
    its enclosing jaxpr that produce its operands and consume its results."""
    jaxprs = [jaxpr] + [sub for eqn, _ in walk(jaxpr) for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
    for sub in jaxprs:
        sub = getattr(sub, "jaxpr", sub)
        producers = {v: e for e in sub.eqns for v in e.outvars}
        for inner in sub.eqns:
            if inner.primitive.name == "custom_vmap_call" and any(
                    name in NORM_KERNELS for name in _kernel_names(inner.params["call"])):
                outs = set(inner.outvars)
                consumers = [e for e in sub.eqns
                             if any(isinstance(v, jax.extend.core.Var) and v in outs for v in e.invars)]
                yield inner, [producers.get(v) for v in inner.invars if isinstance(v, jax.extend.core.Var)], consumers


def _per_row(aval) -> bool:
    return BATCH * SEQLEN in aval.shape or (BATCH, SEQLEN) == tuple(aval.shape[:2])


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_lm_training_step_runs_its_norms_without_conversion_passes(residual_in_fp32):
    config = Mamba2Config(d_model=32, n_layer=3, vocab_size=64, residual_in_fp32=residual_in_fp32,
                          ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    with aot.cuda_target("sm_90"):
        model = Mamba2LMHeadModel(config, backend="cutile", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        ids = jax.random.randint(jax.random.key(0), (BATCH, SEQLEN), 0, config.vocab_size)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).loss(ids)))(params)
    names = [n for n in _kernel_names(jaxpr) if n in NORM_KERNELS]
    # Per layer (in the scans) and for the final norm: the add + norm and the gated norm forward; backward and
    # weight-gradient reduction each.
    assert sorted(names) == sorted(["rms_norm_fwd_kernel"] * 3 + ["rms_norm_bwd_kernel"] * 3
                                   + ["rms_norm_dweight_kernel"] * 3)
    calls = list(_norm_calls(jaxpr))
    assert len(calls) == 6  # the forward and backward custom_vmap calls of the three norms
    passes = []  # equations that write a per-row array next to a norm call
    for call, producers, consumers in calls:
        passes += [e for e in producers + consumers if e is not None
                   and e.primitive.name in ("convert_element_type", "broadcast_in_dim", "reduce_sum")
                   and any(_per_row(v.aval) for v in e.outvars)]
        inner = [e for e, _ in walk(call.params["call"]) if e.primitive.name in ("convert_element_type", "reduce_sum")]
        assert not any(_per_row(v.aval) for e in inner for v in e.outvars), inner
    # Not even the final norm's unused residual stream gets a zero cotangent array (a symbolic zero, skipped).
    assert passes == []
