"""The cuTile op layer end to end on the CPU: bridge/ops.py's forward, saving forward, backward and vmap rules
(the gate outside the backward kernels, the saved chunk states, the recompute mode, the per-head dD sum) with
every kernel plan run block by block on the NumPy emulator of tests/kernels/_cutile_emulator.py, in float64,
through `jax.pure_callback`. Checked against the float64 scan oracle: what the GPU tests check of this glue,
without a GPU, to the rounding of the arrays passed between the plans and XLA (their float32 or bfloat16).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2 import backends, op, reference  # noqa: E402
from jax_mamba2.bridge import problem  # noqa: E402
from jax_mamba2.kernels import forward as forward_kernels  # noqa: E402
from jax_mamba2.kernels import fused_scan  # noqa: E402
from tests._helpers import make_ssd_args, rel_l2, to_float64  # noqa: E402
from tests.bridge._emulated_backend import EMULATED  # noqa: E402

# The arrays between the plans and XLA are float32 (the emulated kernels compute in float64): errors ~3e-7.
TOLERANCE = 2e-6
DIMS = dict(batch=2, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16)
OPTIONAL = ("D", "z", "dt_bias", "initial_states")




def _inputs(x, dt, A, B, C, *, dt_softplus=False, dt_limit=(0.0, math.inf), seq_idx=None,
            save_chunk_states=True, **optional):
    static = op.SSDStatic(64, dt_softplus, tuple(dt_limit), save_chunk_states=save_chunk_states)
    return op.SSDInputs(x, dt, A, B, C, optional.get("D"), optional.get("z"), optional.get("dt_bias"),
                        optional.get("initial_states"), seq_idx), static


def _emulated_ssd(*args, **kwargs):
    return op._run_backend(EMULATED, *_inputs(*args, **kwargs))


def _problem(seed, D="head", seq_idx=(37, 63), **dims):
    args, kwargs = make_ssd_args(seed, **{**DIMS, **dims}, D=D, z=True, dt_bias=True, dt_softplus=True,
                                 dt_limit=(1e-3, 2.0), initial_states=True,
                                 seq_idx=None if seq_idx is None else list(seq_idx))
    optional = {name: kwargs.pop(name) for name in OPTIONAL}
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), 2)
    weights = (jax.random.normal(keys[0], args[0].shape),
               jax.random.normal(keys[1], optional["initial_states"].shape))
    return args, optional, kwargs, weights


def _loss(fn, weights, kwargs):
    def loss(args, optional):
        y, final = fn(*args, **optional, **kwargs)
        return jnp.sum(y * weights[0]) + jnp.sum(final * weights[1])
    return loss


@functools.partial(jax.jit, static_argnames="static")
def _jitted_oracle(args, optional, seq_idx, weights, static):
    kwargs = dict(static, seq_idx=seq_idx)
    loss = _loss(reference.ssd_scan, weights, kwargs)
    return reference.ssd_scan(*args, **optional, **kwargs), jax.grad(loss, argnums=(0, 1))(args, optional)


def _oracle(args, optional, kwargs, weights):
    """The float64 scan's outputs and gradients, compiled as one program (op by op, the scan and its
    gradient compile each operation at every new shape, most of a check's time)."""
    kwargs = dict(kwargs)
    seq_idx = kwargs.pop("seq_idx", None)
    static = tuple(sorted((name, tuple(v) if isinstance(v, list) else v) for name, v in kwargs.items()))
    with jax.enable_x64(True):
        out = _jitted_oracle(to_float64(args), to_float64(optional), seq_idx, to_float64(weights), static)
        return jax.tree.map(np.asarray, out)


def _check_forward_and_gradients(args, optional, kwargs, weights, tolerance, ssd=_emulated_ssd):
    (want_y, want_final), (want_args, want_optional) = _oracle(args, optional, kwargs, weights)

    @jax.jit  # one program: op by op, every operation around the kernels compiles on its own
    def outputs_and_gradients(args, optional):
        return (ssd(*args, **optional, **kwargs),
                jax.grad(_loss(ssd, weights, kwargs), argnums=(0, 1))(args, optional))
    (y, final), (got_args, got_optional) = outputs_and_gradients(args, optional)
    errors = {"y": rel_l2(y, want_y), "final_states": rel_l2(final, want_final)}
    errors.update({f"d{name}": rel_l2(g, w) for name, g, w in zip("x dt A B C".split(), got_args, want_args)})
    errors.update({f"d{name}": rel_l2(got_optional[name], want_optional[name]) for name in OPTIONAL})
    assert max(errors.values()) < tolerance, errors
    for name in OPTIONAL:
        assert got_optional[name].shape == optional[name].shape, name


@pytest.mark.parametrize("save_chunk_states", [True, False], ids=["saved_states", "recomputed_states"])
@pytest.mark.parametrize("D", ["head", "headdim"], ids=["D_per_head", "D_per_headdim"])
def test_emulated_op_forward_and_gradients_match_float64_scan(save_chunk_states, D):
    """Every feature at once (gate, D, dt_bias, softplus, dt_limit, initial states, seq_idx, groups, a partial
    chunk), the custom VJP with the forward's saved states or recomputing them (the staged layout: f32)."""
    _check_forward_and_gradients(*_problem(1, D=D), TOLERANCE,
                                 ssd=functools.partial(_emulated_ssd, save_chunk_states=save_chunk_states))


def test_emulated_op_gives_initial_states_to_a_first_sequence_of_id_0_alone():
    """Row 0's first sequence has id -1, then sequence 0 starts in the same chunk: the state restarts at both, and
    sequence 0 takes no initial state (the kernels take the ids as the numbers of the sequences), as in the scan."""
    args, optional, kwargs, weights = _problem(5)
    kwargs["seq_idx"] = jnp.asarray(np.stack([np.repeat([-1, 0], [37, 63]), np.repeat([0, 1], [37, 63])]), jnp.int32)
    _check_forward_and_gradients(args, optional, kwargs, weights, TOLERANCE)


@pytest.mark.parametrize("layout,dims", [
    ("fused", dict(nheads=64)),
    ("segmented", dict(batch=1, seqlen=2048, seq_idx=[700, 1348])),  # 2 segments of 16 chunks
    ("fused", dict(nheads=64, headdim=64, dstate=64, seq_idx=None)),
], ids=["fused", "segmented", "fused_dstate_equal_chunk"])
def test_emulated_op_gradients_through_the_fused_layouts_match_float64_scan(layout, dims):
    """bf16: 128 chains run fused, 4 long ones segmented; the states the fused kernels store feed the backward
    (bf16 arrays between the plans and XLA: errors ~3e-3). At dstate = chunk without seq_idx the differentiated
    call's gate-free forward computes each chunk's output as one product (JOINT_OUTPUT), the forward alone
    (with the gate) in two."""
    args, optional, kwargs, weights = _problem(3, dtype=jnp.bfloat16, **dims)
    kernel_dims = problem.kernel_dims(*_inputs(*args, **optional, **kwargs))
    assert forward_kernels.forward_layout(kernel_dims) == layout
    joint = fused_scan.fused_scan_fwd_default_config(dataclasses.replace(kernel_dims, has_z=False)).JOINT_OUTPUT
    assert joint == (kernel_dims.dstate == 64 and not kernel_dims.has_seq_idx)
    _check_forward_and_gradients(args, optional, kwargs, weights, 1e-2)


def test_emulated_op_gradients_under_shard_map_match_float64_scan():
    """The batch split over two devices by shard_map, every feature: the kernels run per shard, the gate's VJP
    on each shard's z, and the replicated A, D and dt_bias get their gradients summed over the shards."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def sharded_ssd(x, dt, A, B, C, *, D, z, dt_bias, initial_states, seq_idx, **static):
        def per_shard(x, dt, B, C, z, initial_states, seq_idx):
            return _emulated_ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                                 seq_idx=seq_idx, **static)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
            x, dt, B, C, z, initial_states, seq_idx)

    _check_forward_and_gradients(*_problem(4), TOLERANCE, ssd=sharded_ssd)


def test_emulated_op_vmap_of_gradients_with_a_gate_matches_a_loop():
    """vmap folds the mapped axis into the kernels' batch (forward) or maps the backward items; the gate's
    VJP maps around them."""
    args, optional, kwargs, weights = _problem(2)
    x, z = args[0], optional["z"]
    xs, zs = jnp.stack([x, 0.5 * x]), jnp.stack([z, -z])

    def grad(x, z):
        def loss(x, z):
            y, _ = _emulated_ssd(x, *args[1:], **dict(optional, z=z), **kwargs)
            return jnp.sum(y * weights[0])
        return jax.grad(loss, argnums=(0, 1))(x, z)

    mapped = jax.jit(jax.vmap(grad))(xs, zs)
    for i in range(2):
        for got, want in zip(mapped, jax.jit(grad)(xs[i], zs[i])):
            assert rel_l2(got[i], want) < 1e-6



def _step_problem(seed, batch=3, D_shape="head", param_dtype=jnp.float32):
    """A decode step's arguments (state, x, dt, A, B, C) and options (D, z, dt_bias, dt_softplus, dt_limit),
    dt_bias and D in `param_dtype`."""
    nheads, headdim, ngroups, dstate = DIMS["nheads"], DIMS["headdim"], DIMS["ngroups"], DIMS["dstate"]
    args, kwargs = make_ssd_args(seed, batch=batch, seqlen=1, nheads=nheads, headdim=headdim, ngroups=ngroups,
                                 dstate=dstate, dtype=jnp.bfloat16, D=D_shape, z=True, dt_bias=True,
                                 dt_softplus=True, dt_limit=(1e-3, 2.0))
    x, dt, A, B, C = args[0][:, 0], args[1][:, 0], args[2], args[3][:, 0], args[4][:, 0]
    state = jax.random.normal(jax.random.key(seed + 7), (batch, nheads, headdim, dstate), jnp.float32)
    options = dict(D=kwargs["D"].astype(param_dtype), z=kwargs["z"][:, 0],
                   dt_bias=kwargs["dt_bias"].astype(param_dtype), dt_softplus=True, dt_limit=kwargs["dt_limit"])
    return (state, x, dt, A, B, C), options


@pytest.mark.parametrize("D_shape,param_dtype", [("head", jnp.bfloat16), ("headdim", jnp.float32)],
                         ids=["D_per_head_bf16", "D_per_channel_f32"])
def test_emulated_decode_step_matches_float64_reference_and_vmaps(D_shape, param_dtype):
    """The decode step's plan (dt_bias and D as given: per head or per channel, bf16 or f32) against the float64
    step; under vmap, mapped rows fold into one launch and a mapped per-head parameter maps the items."""
    args, options = _step_problem(4, D_shape=D_shape, param_dtype=param_dtype)

    def step(state, x, dt, A, B, C):
        return EMULATED.step(state, x, dt, A, B, C, options["D"], options["z"], options["dt_bias"],
                             options["dt_softplus"], options["dt_limit"])

    y, new_state = jax.jit(step)(*args)
    with jax.enable_x64(True):
        want_y, want_state = reference.ssd_step(*to_float64(args), **to_float64(options))
    assert rel_l2(y, want_y) < 1e-2 and rel_l2(new_state, want_state) < TOLERANCE  # y is bf16
    state, x, dt, A, B, C = args
    stacked = (jnp.stack([state, -state]), jnp.stack([x, 0.5 * x]), jnp.stack([dt, dt]), jnp.stack([A, 0.5 * A]),
               jnp.stack([B, -B]), jnp.stack([C, C]))
    for A_axis in (None, 0):
        in_axes = (0, 0, 0, A_axis, 0, 0)
        mapped_args = (*stacked[:3], A if A_axis is None else stacked[3], *stacked[4:])
        folded = "scan" not in str(jax.make_jaxpr(jax.vmap(step, in_axes))(*mapped_args))
        assert folded == (A_axis is None)  # one launch on the folded rows, else a map over the items
        mapped = jax.jit(jax.vmap(step, in_axes))(*mapped_args)
        for i in range(2):
            one = jax.jit(step)(*(a if axis is None else a[i] for a, axis in zip(mapped_args, in_axes)))
            for got, want in zip(mapped, one):
                assert rel_l2(got[i], want) < 1e-6


def test_emulated_decode_step_of_no_rows_launches_nothing(monkeypatch):
    """ssd_step at batch 0 returns the reference's empty result: a launch of no blocks is not made (as the other
    ops skip theirs), and the outputs have the dtypes of a step with rows."""
    monkeypatch.setitem(backends._REGISTRY["ssd"], EMULATED.name, EMULATED)
    args, options = _step_problem(5, batch=0)

    def step(*args):
        return jax_mamba2.ssd_step(*args, **options, backend=EMULATED.name)
    assert "pure_callback" not in str(jax.make_jaxpr(step)(*args))
    y, new_state = step(*args)
    assert (y.shape, y.dtype) == (args[1].shape, args[1].dtype)
    assert (new_state.shape, new_state.dtype) == (args[0].shape, args[0].dtype)


def test_emulated_decode_step_gradients_are_the_reference_steps(monkeypatch):
    """ssd_step on the kernels differentiates (there is no backward kernel: the reference step's VJP), under jit
    and vmap: the gradients of every float argument equal the xla step's."""
    monkeypatch.setitem(backends._REGISTRY["ssd"], EMULATED.name, EMULATED)
    args, options = _step_problem(6)
    weights = jax.random.normal(jax.random.key(3), args[1].shape, jnp.float32)

    def loss(backend, state, x, dt, A, B, C, D, z, dt_bias):
        y, new_state = jax_mamba2.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                                           dt_limit=options["dt_limit"], backend=backend)
        return jnp.sum(y.astype(jnp.float32) * weights) + jnp.sum(jnp.sin(new_state))

    operands = (*args, options["D"], options["z"], options["dt_bias"])
    grads = {backend: jax.jit(jax.grad(functools.partial(loss, backend), argnums=tuple(range(9))))(*operands)
             for backend in (EMULATED.name, "xla")}
    for got, want in zip(grads[EMULATED.name], grads["xla"]):
        assert got.dtype == want.dtype and rel_l2(got, want) < 1e-6
    per_row = jax.jit(jax.vmap(jax.grad(functools.partial(loss, EMULATED.name)), in_axes=(0,) + (None,) * 8))
    mapped = per_row(jnp.stack([args[0], -args[0]]), *operands[1:])
    for i, state in enumerate((args[0], -args[0])):
        assert rel_l2(mapped[i], jax.grad(functools.partial(loss, "xla"))(state, *operands[1:])) < 1e-6
