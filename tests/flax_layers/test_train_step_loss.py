"""The XLA program around the loss's softmax kernels in the LM's training step (traced for sm_90 on the CPU, no
GPU): Mamba2LMHeadModel(backend="cutile").loss runs one forward and one backward kernel per chunk, each taking
the chunk's logits straight from the head product (bf16, no conversion or masking pass before the launch) and
returning dlogits in the matmul dtype straight to the backward's head products."""
import jax
import jax.extend
import jax.numpy as jnp
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from tests.flax_layers._programs import walk

aot = pytest.importorskip("jax_mamba2.bridge.aot")

BATCH, SEQLEN = 3, 40
LOSS_KERNELS = ("cross_entropy_fwd_kernel", "cross_entropy_bwd_kernel")


def _kernel_names(jaxpr) -> list[str]:
    return [eqn.params["kernel"]._annotated_function.pyfunc.__name__
            for eqn, _ in walk(jaxpr) if eqn.primitive.name == "cutile_call_ffi"]


def _loss_calls(jaxpr):
    """(kernel name, producers of its operands, consumers of its results) of every custom_vmap_call that
    launches a loss kernel, within its enclosing jaxpr."""
    jaxprs = [jaxpr] + [sub for eqn, _ in walk(jaxpr) for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
    for sub in jaxprs:
        sub = getattr(sub, "jaxpr", sub)
        producers = {v: e for e in sub.eqns for v in e.outvars}
        for inner in sub.eqns:
            names = [n for n in _kernel_names(inner.params["call"]) if n in LOSS_KERNELS] \
                if inner.primitive.name == "custom_vmap_call" else []
            if names:
                outs = set(inner.outvars)
                consumers = [e for e in sub.eqns
                             if any(isinstance(v, jax.extend.core.Var) and v in outs for v in e.invars)]
                yield names[0], [producers.get(v) for v in inner.invars if isinstance(v, jax.extend.core.Var)], \
                    consumers


def test_lm_training_step_runs_the_loss_softmax_on_its_kernels():
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=61, pad_vocab_size_multiple=8,
                          ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    with aot.cuda_target("sm_90"):
        model = Mamba2LMHeadModel(config, backend="cutile", loss_backend="cutile", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        ids = jax.random.randint(jax.random.key(0), (BATCH, SEQLEN), 0, config.vocab_size)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(
            lambda p: nnx.merge(graphdef, p, rest).loss(ids, chunk_tokens=64, logits_dtype=jnp.bfloat16)))(params)
    assert model.loss_backend == "cutile"
    # The chunk loops (lax.map forward, lax.scan backward) trace one launch of each kernel.
    assert sorted(n for n in _kernel_names(jaxpr) if n in LOSS_KERNELS) == sorted(LOSS_KERNELS)
    calls = {name: (producers, consumers) for name, producers, consumers in _loss_calls(jaxpr)}
    assert set(calls) == set(LOSS_KERNELS)
    for name, (producers, consumers) in calls.items():
        logits = [e for e in producers if e is not None and e.primitive.name == "dot_general"]
        assert len(logits) == 1, name  # the head product feeds the kernel directly
        assert logits[0].outvars[0].aval.dtype == jnp.bfloat16
        assert logits[0].outvars[0].aval.shape == (64, config.padded_vocab_size)
    dlogits_users = {e.primitive.name for e in calls["cross_entropy_bwd_kernel"][1]}
    assert dlogits_users == {"dot_general"}  # dh and the weight gradient's step
