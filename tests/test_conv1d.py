"""The conv op `causal_conv1d_silu` (jax_mamba2/conv1d.py): its checks and dispatch, and its composition (jit, grad,
vmap, shard_map, remat) on the cutile path with every kernel plan run on the NumPy emulator of
tests/kernels/_cutile_emulator.py through `jax.pure_callback` (the bridge's glue end to end, without a GPU),
against the float64 reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from jax_mamba2 import backends, conv1d, conv1d_reference
from tests._helpers import rel_l2
from tests.kernels._conv_checks import (conv_and_grads, float64_reference, make_cancelling_args, make_conv_args,
                                       reference_conv, rounding_errors)

conv_ops = pytest.importorskip("jax_mamba2.bridge.conv_ops")
from tests.kernels import _cutile_emulator as emulator  # noqa: E402

# The arrays between the plans and XLA are float32 (the emulated kernels compute in float64).
TOLERANCE = 1e-5


@pytest.fixture
def emulated(monkeypatch):
    """backend="cutile" runs the kernels on the emulator ("auto" still takes the xla branch on the CPU)."""
    kernels = conv_ops.ConvKernels("cutile_emulated", emulator.jax_run_plan)
    monkeypatch.setitem(backends._REGISTRY[conv1d.OP], "cutile",
                        backends.LayerBackend("cutile", kernels, backends.always_supported, auto_priority=2))


def _loss(fn, weights, **options):
    def loss(x, kernel, bias, init, seq_idx):
        return jnp.sum(fn(x, kernel, bias, seq_idx=seq_idx, initial_states=init, **options) * weights)
    return loss


def _check_forward_and_grads(args, fn, tolerance=TOLERANCE, **options):
    x, kernel, bias, init, seq_idx, weights = args
    want_y, want_grads = float64_reference(*args, silu=options.get("activation", "silu") == "silu")
    y = fn(x, kernel, bias, seq_idx=seq_idx, initial_states=init, **options)
    argnums = tuple(i for i, a in enumerate((x, kernel, bias, init)) if a is not None)
    grads = jax.grad(_loss(fn, weights, **options), argnums=argnums)(x, kernel, bias, init, seq_idx)
    errors = {"y": rel_l2(y, want_y)}
    errors.update({f"d{'x kernel bias init'.split()[i]}": rel_l2(g, want_grads[i]) for i, g in zip(argnums, grads)})
    assert max(errors.values()) < tolerance, errors
    for i, g in zip(argnums, grads):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype


def _cutile(x, kernel, bias=None, **options):
    return conv1d.causal_conv1d_silu(x, kernel, bias, backend="cutile", **options)


# ----------------------------------------------------------------------------------------------
# Checks and dispatch
# ----------------------------------------------------------------------------------------------

_X, _KERNEL = jnp.zeros((2, 5, 8)), jnp.zeros((4, 8))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(x=jnp.zeros((5, 8))), ValueError, r"x.shape=\(5, 8\) must be \(batch, seqlen, channels\)"),
    (dict(x=jnp.zeros((2, 5, 8), jnp.int32)), TypeError, "x.dtype=int32"),
    (dict(x=[[[0.0] * 8] * 5] * 2), TypeError, r"x must be an array of shape \(batch, seqlen, channels\), got list"),
    (dict(kernel=jnp.zeros((4, 7))), ValueError, r"kernel.shape=\(4, 7\) must be \(d_conv, channels\)"),
    (dict(kernel=jnp.zeros((0, 8))), ValueError, "kernel.shape=.* d_conv >= 1"),
    (dict(kernel=jnp.zeros((8, 4))), ValueError,
     r"kernel.shape=\(8, 4\) must be \(d_conv, channels\)=\(4, 8\): causal_conv1d's \(channels, d_conv\) weight"),
    (dict(kernel=[[0.0] * 8] * 4), TypeError, "kernel must be an array, got list"),
    (dict(bias=jnp.zeros((7,))), ValueError, r"bias.shape=\(7,\) must be \(channels,\)"),
    (dict(initial_states=jnp.zeros((2, 8, 2))), ValueError,
     r"initial_states.shape=\(2, 8, 2\) must be \(batch, channels, d_conv - 1 or d_conv\)"),
    (dict(seq_idx=jnp.zeros((2, 4), jnp.int32)), ValueError, r"seq_idx.shape=\(2, 4\) must be \(batch, seqlen\)"),
    (dict(seq_idx=jnp.zeros((2, 5))), TypeError, "seq_idx.dtype=float32 must be an integer dtype"),
    (dict(seq_idx=jnp.zeros((2, 5), jnp.int32), initial_states=jnp.zeros((2, 8, 3))), ValueError,
     "seq_idx and initial_states cannot be combined"),
    (dict(seq_idx=jnp.array([[0, 0, 1, 1, 1], [0, 0, 1, 0, 1]], jnp.int32)), ValueError,
     r"seq_idx must be nondecreasing along seqlen; seq_idx\[1, 3\]=0 follows 1"),
    (dict(activation="gelu"), ValueError, r"activation='gelu' must be 'silu', 'swish' \(the same\) or None"),
    (dict(backend="triton"), ValueError, "backend='triton' must be one of 'auto', 'xla', 'cutile', 'cutile_callback'$"),
    (dict(backend="scan"), ValueError, "backend='scan' must be one of"),
    (dict(return_final_states=1), TypeError, "return_final_states=1 must be a bool"),
])
def test_invalid_arguments_raise_naming_them(kwargs, error, message):
    args = dict(x=_X, kernel=_KERNEL, bias=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(error, match=message):
        conv1d.causal_conv1d_silu(args["x"], args["kernel"], args["bias"], **kwargs)


def test_explicit_cutile_without_a_gpu_says_why():
    with pytest.raises(ValueError, match="backend='cutile'.* cannot run this call: no CUDA device"):
        conv1d.causal_conv1d_silu(_X, _KERNEL, backend="cutile")


def test_explicit_cutile_on_float64_says_why():
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="x is float64; the kernels compute in float32"):
            conv1d.causal_conv1d_silu(_X.astype(jnp.float64), _KERNEL, backend="cutile")


def test_auto_on_the_cpu_is_the_xla_reference():
    x, kernel, bias, init, _, _ = make_conv_args(0, init_width=3)
    want = jax.jit(reference_conv, static_argnums=4)(x, kernel, bias, init, None)  # the op runs compiled
    got = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=init)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_auto_puts_the_kernels_behind_platform_dependent(emulated):
    """With a kernel backend that can run, "auto" lowers a platform switch (on the CPU its default branch)."""
    jaxpr = jax.make_jaxpr(lambda x, k: conv1d.causal_conv1d_silu(x, k, backend="auto"))(_X, _KERNEL)
    assert "platform_index" in str(jaxpr)


@pytest.mark.parametrize("init_width", [0, 3, 4])
def test_final_states_are_the_last_d_conv_input_columns(init_width):
    x, kernel, bias, init, _, _ = make_conv_args(1, seqlen=2, init_width=init_width)
    _, final = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=init, return_final_states=True,
                                         backend="xla")
    state = jnp.zeros((2, 40, 4)) if init is None else jnp.pad(init, ((0, 0), (0, 0), (4 - init_width, 0)))
    want = jnp.concatenate([state, jnp.swapaxes(x, 1, 2)], axis=-1)[..., -4:]
    np.testing.assert_array_equal(np.asarray(final), np.asarray(want))


@pytest.mark.parametrize("backend", ["xla", "cutile"])
def test_a_traced_seq_idx_whose_id_comes_back_restarts_where_it_changes(emulated, backend):
    """Ids 0, 1, 0 (traced, so their order is not checked): the conv restarts at every change of id, as the SSD's
    state does, and no tap of the last run reads the first run's tokens: the values and gradients are those of
    ids 0, 1, 2; int64 ids past int32 (under x64) keep apart."""
    x, kernel, bias, _, _, weights = make_conv_args(5, batch=2, seqlen=12)
    ids = jnp.asarray([[0] * 4 + [1] * 2 + [0] * 6, [7] * 5 + [2] * 7], jnp.int32)
    numbered = jnp.asarray([[0] * 4 + [1] * 2 + [2] * 6, [0] * 5 + [1] * 7], jnp.int32)

    conv = functools.partial(conv1d.causal_conv1d_silu, backend=backend)

    def values_and_grads(seq_idx):
        grads = jax.grad(_loss(conv, weights), argnums=(0, 1, 2))(x, kernel, bias, None, seq_idx)
        return conv(x, kernel, bias, seq_idx=seq_idx), grads

    def check(ids, numbered):
        got = jax.jit(values_and_grads)(ids)
        want = values_and_grads(numbered)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=1e-6, atol=1e-6)

    check(ids, numbered)
    with jax.enable_x64(True):  # row 0: ids 0 then 2**32, which int32 would wrap onto 0 and join to the first run
        check(jnp.asarray([[0] * 6 + [2**32] * 6, [2**33] * 5 + [2**33 + 1] * 7], jnp.int64),
              jnp.asarray([[0] * 6 + [1] * 6, [1] * 5 + [2] * 7], jnp.int32))


@pytest.mark.parametrize("split", [False, True])
def test_final_states_with_seq_idx_hold_only_the_last_sequence(split):
    """With packed sequences the state is that of each row's last sequence alone (zero columns before it, as
    its own call leaves them): a NaN of an earlier sequence is not carried on."""
    x, kernel, bias, _, _, _ = make_conv_args(3, batch=3, seqlen=9)
    x = x.at[0, 6].set(jnp.nan)  # row 0: last sequence = tokens 7, 8; row 1: one sequence; row 2: token 8 alone
    seq_idx = jnp.asarray([[0] * 7 + [1] * 2, [4] * 9, [0] * 8 + [3]], jnp.int32)

    def final(x, seq_idx):
        if not split:
            return conv1d.causal_conv1d_silu(x, kernel, bias, seq_idx=seq_idx, return_final_states=True,
                                             backend="xla")[1]
        wide = jnp.pad(x, ((0, 0), (0, 0), (2, 3)))  # the conv's channels at offset 2 of a wider array
        return conv1d.causal_conv1d_silu_split(wide, kernel, bias, channel_offset=2, split=(40,), seq_idx=seq_idx,
                                               return_final_states=True, backend="xla")[1]

    got = final(x, seq_idx)
    assert bool(jnp.all(jnp.isfinite(got)))
    for row, start in ((0, 7), (1, 0), (2, 8)):  # each last sequence convolved alone
        alone = final(x[row:row + 1, start:], seq_idx[row:row + 1, start:])
        np.testing.assert_array_equal(np.asarray(got[row]), np.asarray(alone[0]))


def test_initial_states_of_d_conv_minus_1_or_d_conv_columns_agree():
    x, kernel, bias, init, _, _ = make_conv_args(2, init_width=3)
    wide = jnp.concatenate([jnp.full(init.shape[:2] + (1,), 7.0), init], axis=-1)  # column 0 is never read
    a = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=init, backend="xla")
    b = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=wide, backend="xla")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["xla", "emulated"])
def test_swish_is_silu_as_in_causal_conv1d(emulated, backend):
    """causal_conv1d takes activation="swish" as SiLU's other name (mamba_ssm's Mamba2Simple passes it): the same
    outputs as "silu", for the plain conv and the split one."""
    name = "cutile" if backend == "emulated" else "xla"
    x, kernel, bias, _, _, _ = make_conv_args(40, seqlen=9, channels=24)
    silu = conv1d.causal_conv1d_silu(x, kernel, bias, backend=name)
    np.testing.assert_array_equal(conv1d.causal_conv1d_silu(x, kernel, bias, activation="swish", backend=name), silu)
    wide = jnp.pad(x, ((0, 0), (0, 0), (2, 1)))
    pieces = conv1d.causal_conv1d_silu_split(wide, kernel, bias, channel_offset=2, split=(16, 8), activation="swish",
                                             backend=name)
    # Two compiled programs (each call runs as one): equal up to how XLA fuses the taps.
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=-1)), np.asarray(silu), rtol=1e-6, atol=1e-7)


def test_empty_sequence_launches_nothing(emulated):
    x = jnp.zeros((2, 0, 8))
    y, final = _cutile(x, _KERNEL, return_final_states=True)
    assert y.shape == (2, 0, 8) and final.shape == (2, 8, 4)


# ----------------------------------------------------------------------------------------------
# Composition on the emulated cutile path
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(), dict(init_width=4), dict(seq_idx=[7, 12], bias=False),
                                     dict(d_conv=3, init_width=2)],
                         ids=["plain", "initial_states", "seq_idx_no_bias", "width_3"])
def test_emulated_cutile_forward_and_gradients_match_float64_reference(emulated, options):
    args = make_conv_args(3, seqlen=19, channels=24, **options)
    _check_forward_and_grads(args, jax.jit(_cutile))


def test_emulated_cutile_without_activation_matches_float64_reference(emulated):
    args = make_conv_args(4, seqlen=19, channels=24)
    _check_forward_and_grads(args, _cutile, activation=None)


@pytest.mark.parametrize("split", [False, True])
def test_emulated_width_1_with_states_of_no_columns_matches_float64_reference(emulated, split):
    """d_conv 1 takes initial_states of d_conv - 1 = 0 columns: the conv reads none of them, and their gradient
    is an empty array of their shape."""
    x, kernel, bias, _, _, weights = make_conv_args(8, seqlen=5, channels=24, d_conv=1)
    init = jnp.zeros((2, 24, 0))

    def conv(x, kernel, bias, *, seq_idx, initial_states):
        if not split:
            return _cutile(x, kernel, bias, seq_idx=seq_idx, initial_states=initial_states)
        wide = jnp.pad(x, ((0, 0), (0, 0), (1, 2)))
        return conv1d.causal_conv1d_silu_split(wide, kernel, bias, channel_offset=1, split=(24,), seq_idx=seq_idx,
                                               initial_states=initial_states, backend="cutile")[0]

    want_y, want_grads = float64_reference(x, kernel, bias, None, None, weights)
    y = conv(x, kernel, bias, seq_idx=None, initial_states=init)
    *grads, dinit = jax.grad(_loss(conv, weights), argnums=(0, 1, 2, 3))(x, kernel, bias, init, None)
    errors = [rel_l2(got, want) for got, want in zip([y, *grads], [want_y, *want_grads[:3]])]
    assert max(errors) < TOLERANCE, errors
    assert dinit.shape == init.shape


def test_emulated_cutile_under_remat_matches_float64_reference(emulated):
    """jax.checkpoint and nnx.remat around the op: the backward recomputes the forward kernel, then runs its own."""
    args = make_conv_args(5, seqlen=19, channels=24, init_width=3)
    _check_forward_and_grads(args, jax.checkpoint(_cutile))

    class Conv(nnx.Module):
        def __init__(self, kernel, bias):
            self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)

        def __call__(self, x, init):
            return _cutile(x, self.kernel[...], self.bias[...], initial_states=init)

    x, kernel, bias, init, _, weights = args
    model = Conv(kernel, bias)
    grads = nnx.grad(lambda m: jnp.sum(nnx.remat(lambda m, x: m(x, init))(m, x) * weights))(model)
    _, (_, dkernel, dbias, _) = float64_reference(*args)
    assert rel_l2(grads.kernel[...], dkernel) < TOLERANCE and rel_l2(grads.bias[...], dbias) < TOLERANCE


def test_emulated_cutile_vmap_of_gradients_folds_items_into_one_launch(emulated):
    """vmap over x: the forward folds the mapped axis into the batch and the backward sums each item's weight
    partials apart; vmap over the kernel too maps the items instead. Both equal a Python loop."""
    x, kernel, bias, _, _, weights = make_conv_args(6, seqlen=19, channels=24)
    xs, kernels = jnp.stack([x, -0.5 * x]), jnp.stack([kernel, 2.0 * kernel])

    def grads(x, kernel):
        loss = _loss(_cutile, weights)
        return jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias, None, None)

    loop = [grads(xs[i], kernels[i]) for i in range(2)]
    shared = jax.vmap(grads, in_axes=(0, None))(xs, kernel)
    mapped = jax.vmap(grads)(xs, kernels)
    for i in range(2):
        for got, want in zip(mapped, loop[i]):
            assert rel_l2(got[i], want) < 1e-6
        for got, want in zip(shared, grads(xs[i], kernel)):
            assert rel_l2(got[i], want) < 1e-6
    jaxpr = str(jax.make_jaxpr(jax.vmap(grads, in_axes=(0, None)))(xs, kernel))
    assert jaxpr.count("pure_callback") == 2  # one forward, one backward plan: no loop over items


@pytest.mark.parametrize("split", ["batch", "channels"])
def test_emulated_cutile_under_shard_map_matches_float64_reference(emulated, split):
    """Batch over "data" (the replicated kernel and bias get the shards' gradients summed) or channels over
    "model" (every parameter split with its channels), on two CPU devices."""
    mesh = jax.make_mesh((2,), ("axis",), axis_types=(AxisType.Auto,))
    if split == "batch":
        x_spec, kernel_spec, bias_spec, ids_spec = P("axis"), P(), P(), P("axis")
    else:
        x_spec, kernel_spec, bias_spec, ids_spec = P(None, None, "axis"), P(None, "axis"), P("axis"), P()

    def sharded(x, kernel, bias, *, seq_idx, initial_states):
        assert initial_states is None
        return jax.shard_map(lambda x, k, b, ids: _cutile(x, k, b, seq_idx=ids), mesh=mesh,
                             in_specs=(x_spec, kernel_spec, bias_spec, ids_spec), out_specs=x_spec)(
                                 x, kernel, bias, seq_idx)

    args = make_conv_args(7, seqlen=19, channels=32, seq_idx=[11, 8])
    _check_forward_and_grads(args, sharded)


# ----------------------------------------------------------------------------------------------
# The parameters in their own dtype
# ----------------------------------------------------------------------------------------------

def _conv_and_grads(backend, layout, args):
    """`conv_and_grads` of the plain op, or of the mixer's call on `_in_source`'s wider input."""
    if layout == "plain":
        return conv_and_grads(backend, args)
    return conv_and_grads(backend, args, _in_source(args[0]), _OFFSET, _SPLIT)


@pytest.mark.parametrize("layout", ["plain", "split_pass_through"])
@pytest.mark.parametrize("backend", ["xla", "emulated"])
def test_float32_kernel_and_bias_are_not_rounded_to_bfloat16_x(emulated, backend, layout):
    """bf16 x with a float32 kernel and bias that bf16 cannot hold: the sum takes the parameters as they are
    (causal_conv1d's numerics), so y and every gradient match the float64 reference of the float32 parameters
    within bf16's rounding of the outputs, and miss that of the parameters rounded to bf16 by far more (the
    problem makes that rounding show: `make_cancelling_args`). The gradients come back in the arguments'
    dtypes (dkernel and dbias float32)."""
    args = make_cancelling_args(50)
    got = _conv_and_grads("cutile" if backend == "emulated" else "xla", layout, args)
    errors = rounding_errors(got, args)
    for name, (error, rounded_error) in errors.items():
        assert error < 2e-2 and 8 * error < rounded_error, (name, errors)
    x, kernel, bias, init = args[:4]
    assert [a.dtype for a in got] == [x.dtype, x.dtype, kernel.dtype, bias.dtype, init.dtype]


@pytest.mark.parametrize("seed", [50, 51, 52])
def test_xla_path_sums_the_taps_cotangents_in_float32(seed):
    """The xla path's dx for bf16 x: each input column's cotangent is the sum of its d_conv taps' cotangents, added
    in float32 and rounded once (as the kernels do), not each rounded to bf16 first; on the cancelling problem (taps
    ~256 large summing to ~1) per-tap rounding shows as a dx error of ~1e-2, the rounding of dx alone ~4e-3."""
    args = make_cancelling_args(seed)
    errors = rounding_errors(_conv_and_grads("xla", "plain", args), args)
    assert errors["dx"][0] < 6e-3 and errors["dinit"][0] < 6e-3, errors


def test_xla_path_returns_a_float32_state_gradient_unrounded_to_bfloat16_x():
    """A float32 initial state under bf16 x: the forward rounds its columns to bf16 (as it rounds x), but their
    gradient is summed in float32 and returned so, as the kernels return it (not rounded to x's precision first),
    forward mode runs too; with a bf16-exact cotangent of y and no SiLU it is the float64 gradient to float32
    rounding."""
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    x = jax.random.normal(keys[0], (2, 16, 32)).astype(jnp.bfloat16)
    kernel = 0.5 * jax.random.normal(keys[1], (4, 32))
    init = jax.random.normal(keys[2], (2, 32, 4))
    dy = jax.random.normal(keys[3], x.shape).astype(jnp.bfloat16).astype(jnp.float32)

    def loss(init, kernel, x, dy):
        y = conv1d.causal_conv1d_silu(x, kernel, initial_states=init, activation=None, backend="xla")
        return jnp.sum(y.astype(dy.dtype) * dy)

    got = jax.grad(loss)(init, kernel, x, dy)
    with jax.enable_x64(True):
        want = jax.grad(loss)(*(a.astype(jnp.float64) for a in (init.astype(jnp.bfloat16), kernel, x, dy)))
    assert got.dtype == jnp.float32 and rel_l2(got, want) < 1e-6, rel_l2(got, want)
    tangent = jax.jvp(lambda i: loss(i, kernel, x, dy), (init,), (jnp.ones_like(init),))[1]
    assert np.isclose(float(tangent), float(jnp.sum(got)), rtol=1e-2)  # y and its tangent in bf16


@pytest.mark.parametrize("backend", ["xla", "emulated"])
def test_final_states_carry_a_float32_states_columns_unrounded(emulated, backend):
    """A sequence shorter than d_conv under bf16 x leaves columns of a float32 initial state in the final state:
    they are carried over as they are (x's columns converted to float32 exactly), as `causal_conv1d_step` shifts
    the state, so a two-token call and two steps leave the same state."""
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    x = jax.random.normal(keys[0], (2, 2, 16)).astype(jnp.bfloat16)
    kernel = jax.random.normal(keys[1], (4, 16))
    init = jax.random.normal(keys[2], (2, 16, 4))
    assert not bool(jnp.any(init.astype(jnp.bfloat16).astype(jnp.float32) == init))
    _, final = conv1d.causal_conv1d_silu(x, kernel, initial_states=init, return_final_states=True,
                                         backend="cutile" if backend == "emulated" else "xla")
    want = jnp.concatenate([init[..., 2:], jnp.swapaxes(x, 1, 2).astype(jnp.float32)], axis=-1)
    assert final.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(final), np.asarray(want))
    state = init
    for t in range(x.shape[1]):
        _, state = conv1d_reference.causal_conv1d_step(x[:, t], state, kernel, dtype=x.dtype)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(final))


def test_decode_step_takes_the_float32_kernel_and_bias_as_the_sequence_does():
    """`causal_conv1d_step` (the layers' composed decode step) of a bf16 token with a float32 kernel and bias that
    bf16 cannot hold: the op's output for that token after the same state, which matches the float64 reference
    of the float32 parameters and misses that of them rounded to bf16 by far more."""
    args = make_cancelling_args(51, seqlen=1)
    x, kernel, bias, init, _, _ = args
    step, _ = conv1d_reference.causal_conv1d_step(x[:, 0], init, kernel, bias, dtype=x.dtype)
    sequence = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=init, activation=None, backend="xla")
    # Two programs (the op runs compiled): equal up to how XLA fuses the taps, within a bf16 ulp.
    np.testing.assert_allclose(np.asarray(step, np.float32), np.asarray(sequence[:, 0], np.float32), rtol=2**-7)
    want = float64_reference(*args, silu=False)[0][:, 0]
    rounded = float64_reference(x, kernel.astype(jnp.bfloat16), bias.astype(jnp.bfloat16), init, None, args[-1],
                                silu=False)[0][:, 0]
    error, rounded_error = rel_l2(step, want), rel_l2(step, rounded)
    assert error < 1e-2 and 8 * error < rounded_error, (error, rounded_error)


# ----------------------------------------------------------------------------------------------
# The FFI path lowered for CUDA on this machine
# ----------------------------------------------------------------------------------------------

def test_aot_export_lowers_the_conv_kernels_for_sm90():
    """jax.export for CUDA of a value_and_grad through "auto" (cubins compiled by tileiras with the
    constraints JAX derives): the forward, backward and reduction launches, with seq_idx."""
    import re

    from jax_mamba2.bridge import aot

    x, kernel, bias, _, seq_idx, _ = make_conv_args(8, seqlen=100, channels=48, dtype=jnp.bfloat16,
                                                    seq_idx=[60, 40])

    def loss(x, kernel, bias):
        return jnp.sum(conv1d.causal_conv1d_silu(x, kernel, bias, seq_idx=seq_idx).astype(jnp.float32) ** 2)

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, kernel, bias)
    names = [re.sub(r"_Kt\d.*", "", n) for n in re.findall(r'function_name = "([^"]+)"', exported.mlir_module())]
    assert names == ["causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel", "conv_grads_reduce_kernel"], names


# ----------------------------------------------------------------------------------------------
# causal_conv1d_silu_split: a channel window of a wider input, in pieces
# ----------------------------------------------------------------------------------------------

# The mixer's layout scaled down: in_proj's [z (24), xBC (16 + 4 + 4), dt (3)], xBC at offset 24.
_OFFSET, _WIDTH, _SPLIT = 24, 51, (16, 4, 4)


def _in_source(x, seed=31):
    """x (batch, seqlen, 24) inside random channels of in_proj's width at _OFFSET."""
    wide = jax.random.normal(jax.random.key(seed), (*x.shape[:2], _WIDTH), x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(wide, x, _OFFSET, axis=-1)


def _split_cutile(source, kernel, bias=None, **options):
    return conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=_OFFSET, split=_SPLIT,
                                           backend="cutile", **options)


def _check_split(args, fn, tolerance=TOLERANCE, **options):
    """fn's pieces and the gradients of sum(concat(pieces) * weights) against the float64 reference of the
    window; the source's cotangent is zero outside it. With pass_through=True fn also returns the channels
    before and after the window, which the loss weighs too: they come back unchanged, and the source's
    cotangent there is their weights."""
    x, kernel, bias, init, seq_idx, weights = args
    source = _in_source(x)
    want_y, want_grads = float64_reference(*args)
    passed = options.get("pass_through", False)
    outside = [jax.random.normal(jax.random.key(38 + i), (*x.shape[:2], w), x.dtype)
               for i, w in enumerate((_OFFSET, _WIDTH - _OFFSET - x.shape[-1]))]

    def split_outputs(source, kernel, bias, init):
        outputs = fn(source, kernel, bias, seq_idx=seq_idx, initial_states=init, **options)
        pieces = outputs[1:-1] if passed else outputs
        assert [p.shape[-1] for p in pieces] == list(_SPLIT) and len(outputs) == len(_SPLIT) + 2 * passed
        return (outputs[0], outputs[-1]) if passed else (), pieces

    def loss(source, kernel, bias, init):
        around, pieces = split_outputs(source, kernel, bias, init)
        return (jnp.sum(jnp.concatenate(pieces, axis=-1) * weights)
                + sum(jnp.sum(a * w) for a, w in zip(around, outside)))

    around, pieces = split_outputs(source, kernel, bias, init)
    argnums = tuple(i for i, a in enumerate((source, kernel, bias, init)) if a is not None)
    grads = dict(zip(argnums, jax.grad(loss, argnums=argnums)(source, kernel, bias, init)))
    dsource = np.asarray(grads.pop(0))
    errors = {"y": rel_l2(jnp.concatenate(pieces, axis=-1), want_y),
              "dx": rel_l2(dsource[..., _OFFSET:_OFFSET + x.shape[-1]], want_grads[0])}
    errors.update({f"d{'x kernel bias init'.split()[i]}": rel_l2(g, want_grads[i]) for i, g in grads.items()})
    assert max(errors.values()) < tolerance, errors
    before, after = (outside if passed else (0.0, 0.0))
    np.testing.assert_array_equal(dsource[..., :_OFFSET], before)
    np.testing.assert_array_equal(dsource[..., _OFFSET + x.shape[-1]:], after)
    if passed:
        np.testing.assert_array_equal(around[0], source[..., :_OFFSET])
        np.testing.assert_array_equal(around[1], source[..., _OFFSET + x.shape[-1]:])


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(channel_offset=28), ValueError,
     r"channel_offset=28 must be an int in \[0, x.shape\[-1\] - channels\]=\[0, 27\]"),
    (dict(channel_offset=-1), ValueError, r"channel_offset=-1 must be an int"),
    (dict(split=(16, 4)), ValueError,
     r"split=\(16, 4\) must be a tuple of 1 to 3 positive ints summing to channels=24"),
    (dict(split=[16, 4, 4]), TypeError, r"split=\[16, 4, 4\] must be a tuple"),
    (dict(split=(8, 8, 4, 4)), ValueError, r"split=\(8, 8, 4, 4\) must be a tuple of 1 to 3"),
    (dict(channel_offset=True), TypeError, r"channel_offset=True must be an int"),
    (dict(split=(True, 23)), TypeError, r"split=\(True, 23\) must be a tuple"),
    (dict(bias=jnp.zeros((51,))), ValueError,
     r"causal_conv1d_silu_split: bias.shape=\(51,\) must be \(channels,\)=\(24,\)"),
    (dict(initial_states=jnp.zeros((2, 51, 4))), ValueError,
     r"causal_conv1d_silu_split: initial_states.shape=\(2, 51, 4\)"),
    (dict(x=[[[0.0] * _WIDTH] * 5] * 2), TypeError, r"causal_conv1d_silu_split: x must be an array, got list"),
    (dict(kernel=np.zeros((4, 24)).tolist()), TypeError, r"causal_conv1d_silu_split: kernel must be an array, got list"),
    (dict(x=jnp.zeros((5, _WIDTH))), ValueError, r"causal_conv1d_silu_split: x.shape=\(5, 51\) must be \(batch, seqlen, "
                                                 r"width\)"),
    (dict(kernel=jnp.zeros((4, 60)), split=(60,)), ValueError,  # no channel_offset fits: the kernel is named
     r"causal_conv1d_silu_split: kernel.shape=\(4, 60\) must be \(d_conv, channels\) with channels <= "
     r"x.shape\[-1\]=51"),
])
def test_split_invalid_arguments_raise_naming_them(kwargs, error, message):
    """TypeError for a layout of the wrong type (a list, a bool), ValueError for one that does not fit."""
    args = dict(x=jnp.zeros((2, 5, _WIDTH)), kernel=jnp.zeros((4, 24)), channel_offset=_OFFSET, split=_SPLIT,
                bias=None)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        conv1d.causal_conv1d_silu_split(args.pop("x"), args.pop("kernel"), args.pop("bias"), **args)


def test_split_takes_numpy_ints_for_its_layout():
    x, kernel = jax.random.normal(jax.random.key(3), (2, 5, _WIDTH)), jnp.full((4, 24), 0.25)
    plain = conv1d.causal_conv1d_silu_split(x, kernel, channel_offset=_OFFSET, split=_SPLIT, backend="xla")
    numpy_ints = conv1d.causal_conv1d_silu_split(x, kernel, channel_offset=np.int64(_OFFSET),
                                                 split=tuple(np.int64(w) for w in _SPLIT), backend="xla")
    for a, b in zip(plain, numpy_ints):
        np.testing.assert_array_equal(a, b)


def test_split_pass_through_must_be_a_bool_and_covers_an_empty_sequence():
    with pytest.raises(TypeError, match="causal_conv1d_silu_split: pass_through='yes' must be a bool"):
        conv1d.causal_conv1d_silu_split(jnp.zeros((2, 5, _WIDTH)), jnp.zeros((4, 24)), channel_offset=_OFFSET,
                                        split=_SPLIT, pass_through="yes")
    outputs = conv1d.causal_conv1d_silu_split(jnp.zeros((2, 0, _WIDTH)), jnp.zeros((4, 24)), channel_offset=_OFFSET,
                                              split=_SPLIT, pass_through=True, backend="xla")
    assert [o.shape for o in outputs] == [(2, 0, w) for w in (_OFFSET, *_SPLIT, _WIDTH - _OFFSET - 24)]


@pytest.mark.parametrize("init_width", [0, 4])
def test_split_xla_is_the_conv_of_the_window_in_pieces(init_width):
    x, kernel, bias, init, _, _ = make_conv_args(30, channels=24, init_width=init_width)
    source = _in_source(x)
    pieces, final = conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=_OFFSET, split=_SPLIT,
                                                    initial_states=init, return_final_states=True, backend="xla")
    want, want_final = conv1d.causal_conv1d_silu(x, kernel, bias, initial_states=init, return_final_states=True,
                                                 backend="xla")
    # Two compiled programs (each call runs as one): equal up to how XLA fuses the taps.
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=-1)), np.asarray(want), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(want_final))


@pytest.mark.parametrize("options", [dict(), dict(init_width=4), dict(seq_idx=[7, 12], bias=False)],
                         ids=["plain", "initial_states", "seq_idx_no_bias"])
def test_emulated_split_forward_and_gradients_match_float64_reference(emulated, options):
    _check_split(make_conv_args(32, seqlen=19, channels=24, **options), jax.jit(_split_cutile))


@pytest.mark.parametrize("backend", ["xla", "emulated"])
@pytest.mark.parametrize("options", [dict(), dict(seq_idx=[7, 12])], ids=["plain", "seq_idx"])
def test_split_passes_the_other_channels_through(emulated, backend, options):
    """pass_through: the channels outside the window come out unchanged and their cotangents go into the
    source's; on the kernels the backward plan writes the source's whole cotangent."""
    fn = _split_cutile if backend == "emulated" else functools.partial(
        conv1d.causal_conv1d_silu_split, channel_offset=_OFFSET, split=_SPLIT, backend="xla")
    _check_split(make_conv_args(39, seqlen=19, channels=24, **options), jax.jit(fn, static_argnames="pass_through"),
                 pass_through=True)


def test_emulated_split_runs_one_forward_and_one_backward_plan(emulated):
    """[x, B, C] in one launch each way: the pieces and their cotangents never meet in XLA."""
    x, kernel, bias, _, _, weights = make_conv_args(33, seqlen=19, channels=24)

    def loss(source, kernel, bias):
        return jnp.sum(jnp.concatenate(_split_cutile(source, kernel, bias), axis=-1) * weights)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(_in_source(x), kernel, bias))
    assert jaxpr.count("pure_callback") == 2


def test_emulated_split_under_remat_matches_float64_reference(emulated):
    args = make_conv_args(34, seqlen=19, channels=24, init_width=3)
    _check_split(args, jax.checkpoint(_split_cutile))

    class Conv(nnx.Module):
        def __init__(self, kernel, bias):
            self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)

        def __call__(self, source, init):
            return jnp.concatenate(_split_cutile(source, self.kernel[...], self.bias[...], initial_states=init), -1)

    x, kernel, bias, init, _, weights = args
    grads = nnx.grad(lambda m: jnp.sum(nnx.remat(lambda m, s: m(s, init))(m, _in_source(x)) * weights))(
        Conv(kernel, bias))
    _, (_, dkernel, dbias, _) = float64_reference(*args)
    assert rel_l2(grads.kernel[...], dkernel) < TOLERANCE and rel_l2(grads.bias[...], dbias) < TOLERANCE


@pytest.mark.parametrize("pass_through", [False, True])
def test_emulated_split_vmap_of_gradients_matches_a_loop(emulated, pass_through):
    x, kernel, bias, _, _, weights = make_conv_args(35, seqlen=19, channels=24)
    sources = jnp.stack([_in_source(x), -0.5 * _in_source(x, seed=36)])

    def grads(source):
        def loss(source, kernel, bias):
            outputs = _split_cutile(source, kernel, bias, pass_through=pass_through)
            pieces = outputs[1:-1] if pass_through else outputs
            around = jnp.sum(outputs[0] ** 2) - jnp.sum(outputs[-1]) if pass_through else 0.0
            return jnp.sum(jnp.concatenate(pieces, axis=-1) * weights) + around
        return jax.grad(loss, argnums=(0, 1, 2))(source, kernel, bias)

    mapped = jax.vmap(grads)(sources)
    for i in range(2):
        for got, want in zip(mapped, grads(sources[i])):
            assert rel_l2(got[i], want) < 1e-6
    assert str(jax.make_jaxpr(jax.vmap(grads))(sources)).count("pure_callback") == 2


def test_emulated_split_under_shard_map_over_the_batch_matches_float64_reference(emulated):
    """The layer's data-parallel path: rows over "data", the kernel and bias replicated (their gradients are
    the shards' sum)."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def sharded(source, kernel, bias, *, seq_idx, initial_states):
        assert initial_states is None
        return jax.shard_map(lambda s, k, b, ids: _split_cutile(s, k, b, seq_idx=ids), mesh=mesh,
                             in_specs=(P("data"), P(), P(), P("data")), out_specs=P("data"))(
                                 source, kernel, bias, seq_idx)

    _check_split(make_conv_args(37, seqlen=19, channels=24, seq_idx=[11, 8]), sharded)
