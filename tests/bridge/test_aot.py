"""The cuTile backend lowered for CUDA on this CPU machine (jax.export, cubins compiled by tileiras with
the constraints JAX derives): forward and backward plans, every optional input."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

import cuda.tile as ct  # noqa: E402
from cuda.tile.jax import OutputPlaceholder, cutile_call  # noqa: E402
from jaxlib import xla_client  # noqa: E402

import jax_mamba2  # noqa: E402
from jax_mamba2.bridge import _compat, aot, compile_ahead  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402


def _kernels(exported) -> list[str]:
    text = exported.mlir_module()
    return [re.sub(r"_Kt\d.*", "", name) for name in re.findall(r'function_name = "([^"]+)"', text)]


def test_aot_export_lowers_forward_and_backward_kernels_for_sm90():
    args, kwargs = make_ssd_args(0, batch=2, seqlen=100, nheads=4, headdim=32, ngroups=2, dstate=32,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[60, 40])

    def loss(x, dt, A, B, C):
        y, final = jax_mamba2.ssd(x, dt, A, B, C, 64, **kwargs, return_final_states=True)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(final)

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    kernels = _kernels(exported)
    assert kernels[:3] == ["chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]
    assert {"chunk_scan_bwd_dc_kernel", "chunk_state_bwd_kernel", "chunk_scan_bwd_dx_kernel",
            "chunk_cumsum_bwd_kernel", "param_grads_bwd_kernel"} <= set(kernels), kernels
    assert exported.platforms == ("cuda",)
    assert len(exported.serialize()) > 0
    # Every launch names the target XLA may record into a command buffer.
    assert set(re.findall(r"stablehlo.custom_call @(\w+)\(", exported.mlir_module())) == {aot.CUTILE_CUSTOM_CALL}


@pytest.mark.parametrize("arch", ["sm_80", "banana", None])
def test_aot_export_refuses_an_arch_the_kernels_do_not_support(arch):
    with pytest.raises(ValueError, match=rf"export_for_cuda: arch={re.escape(repr(arch))} must be one of \('sm_90',\)"):
        aot.export_for_cuda(lambda x: x, jnp.ones(2), arch=arch)


def test_aot_export_of_the_callback_backend_says_to_export_the_custom_calls():
    """`cutile_callback` launches from a host callback, which jax.export cannot serialize: a ValueError naming
    the backends that export, not JAX's NotImplementedError."""
    args, _ = make_ssd_args(0, batch=1, seqlen=37, nheads=2, headdim=16, ngroups=1, dstate=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"export_for_cuda: fun launches kernels from a host callback \(backend="
                                         r"'cutile_callback'\).* export it with backend='cutile' or 'auto'"):
        aot.export_for_cuda(lambda *a: jax_mamba2.ssd(*a, 64, backend="cutile_callback"), *args)


def test_aot_export_keeps_the_static_arguments_of_a_jitted_fun():
    """A jitted `fun` is exported as it is: wrapping it in another jit would trace its static arguments."""
    args, _ = make_ssd_args(0, batch=1, seqlen=37, nheads=2, headdim=16, ngroups=1, dstate=16, dtype=jnp.bfloat16)
    fun = jax.jit(lambda chunk_size, *a: jax_mamba2.ssd(*a, chunk_size), static_argnums=0)
    exported = aot.export_for_cuda(fun, 64, *args)
    assert exported.in_avals == tuple(jax.typeof(a) for a in args)
    assert _kernels(exported) == ["chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]


def test_a_program_exported_for_cuda_still_says_why_cutile_cannot_run_on_this_machine():
    """The traces made for the target are not reused afterwards: on this CPU machine the same program, jitted
    again, raises the ValueError of `backend="cutile"`, not a lowering error of its kernels for the CPU."""
    args, _ = make_ssd_args(0, batch=1, seqlen=37, nheads=2, headdim=16, ngroups=1, dstate=16, dtype=jnp.bfloat16)

    def fun(*a):
        return jax_mamba2.ssd(*a, 64, backend="cutile")

    aot.export_for_cuda(fun, *args)
    with pytest.raises(ValueError, match=r"ssd\(backend='cutile'\) cannot run this call: no CUDA device"):
        jax.jit(fun)(*args)


def test_aot_export_with_a_symbolic_batch_runs_xla_on_auto_and_says_why_on_cutile():
    """The kernels are compiled per shape: a shape-polymorphic export takes the xla path of "auto" for the SSD, its
    decode step, the conv and the norms, and a ValueError for "cutile", not an inconclusive comparison of sizes."""
    args, _ = make_ssd_args(0, batch=2, seqlen=64, nheads=2, headdim=16, ngroups=1, dstate=16, dtype=jnp.bfloat16)
    batch, = jax.export.symbolic_shape("batch")
    x, dt, A, B, C = (jax.ShapeDtypeStruct((batch, *a.shape[1:]) if a.ndim > 1 else a.shape, a.dtype) for a in args)
    h = jax.ShapeDtypeStruct((batch, 8, 32), jnp.float32)
    state = jax.ShapeDtypeStruct((batch, 2, 16, 16), jnp.float32)
    calls = {
        "ssd": (lambda backend, *a: jax_mamba2.ssd(*a, 64, backend=backend), (x, dt, A, B, C)),
        "ssd_step": (lambda backend, s, x, dt, A, B, C: jax_mamba2.ssd_step(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0],
                                                                         backend=backend), (state, x, dt, A, B, C)),
        "causal_conv1d_silu": (lambda backend, h: jax_mamba2.causal_conv1d_silu(h, jnp.ones((4, 32)), backend=backend),
                               (h,)),
        "rms_norm": (lambda backend, h: jax_mamba2.rms_norm(h, jnp.ones((32,)), backend=backend), (h,)),
        "add_rms_norm": (lambda backend, h: jax_mamba2.add_rms_norm(h, h, jnp.ones((32,)), backend=backend), (h,)),
    }
    for api, (call, specs) in calls.items():
        exported = aot.export_for_cuda(functools.partial(call, "auto"), *specs)
        assert _kernels(exported) == [], api
        with pytest.raises(ValueError, match=rf"{api}\(backend='cutile'\) cannot run this call: symbolic sizes"):
            aot.export_for_cuda(functools.partial(call, "cutile"), *specs)


def test_each_target_arch_has_its_own_cache_of_compiled_kernels():
    """cuda.tile.jax keys its compiled kernels without the arch: a target swaps in a cache of its own, and the
    local GPU's comes back after."""
    from cuda.tile.jax import _jax as cutile_jax
    local = cutile_jax._COMPILE_CACHE
    with aot.cuda_target("sm_90"):
        sm_90 = cutile_jax._COMPILE_CACHE
        with aot.cuda_target("sm_100"):
            assert cutile_jax._COMPILE_CACHE is not sm_90 and cutile_jax._COMPILE_CACHE is not local
        assert cutile_jax._COMPILE_CACHE is sm_90
    assert cutile_jax._COMPILE_CACHE is local and sm_90 is not local


def test_aot_target_is_scoped():
    from jax_mamba2.bridge import problem
    with aot.cuda_target("sm_90"):
        assert problem.gpu_unavailable_reason() is None
    assert problem.gpu_unavailable_reason() is not None  # this CPU machine


def test_the_launch_target_is_registered_for_command_buffers():
    # On a CPU-only jaxlib the CUDA registrations wait in xla_client's queue, traits included; with the CUDA plugin
    # they went to XLA at once (the GPU tests check there that XLA records the launches).
    if "CUDA" in xla_client._custom_callback_handler:
        pytest.skip("the CUDA plugin took the registrations: their traits are XLA's, checked by the GPU tests")
    pending = {name: traits for name, _, _, traits in xla_client._custom_callback.get("CUDA", [])}
    assert pending[aot.CUTILE_CUSTOM_CALL] == xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    assert pending["cutile_launch"] == xla_client.CustomCallTargetTraits.DEFAULT  # cuda.tile.jax's own


def copy_kernel(x, out, TILE: ct.Constant[int]):
    """A cuTile kernel of another package (this module): out = x."""
    ct.store(out, index=(ct.bid(0),), tile=ct.load(x, index=(ct.bid(0),), shape=(TILE,)))


COPY_KERNEL = ct.kernel(copy_kernel)


def test_a_cutile_kernel_of_another_package_keeps_cutile_s_own_target():
    def compile_fn(kernel, constraints, arch):
        return _compat.kernel_signature(kernel, constraints).symbol, b"not a cubin"

    x = jnp.ones((64,), jnp.float32)
    with aot.cuda_target("sm_90"), compile_ahead.using(compile_ahead.KernelCompiler(compile_fn=compile_fn)):
        text = jax.jit(lambda x: cutile_call((4,), COPY_KERNEL, (x, OutputPlaceholder((64,), jnp.float32), 16))
                       ).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @(\w+)\(", text) == ["cutile_launch"]


def _second_order_cases():
    """(name, f(a, b) -> scalar, a, b) of each kernel op: f's gradient in b depends on a."""
    keys = jax.random.split(jax.random.key(7), 4)
    ssd_args, _ = make_ssd_args(1, batch=1, seqlen=64, nheads=2, headdim=16, ngroups=1, dstate=16,
                                dtype=jnp.bfloat16)
    x, dt, A, B, C = ssd_args
    rows = jax.random.normal(keys[0], (64, 32), jnp.bfloat16)
    conv_x = jax.random.normal(keys[1], (1, 64, 32), jnp.bfloat16)
    embedding = jax.random.normal(keys[2], (128, 32), jnp.float32)
    labels = jax.random.randint(keys[3], (64,), 0, 128)

    def total(y):
        return jnp.sum(y.astype(jnp.float32))

    return [
        ("ssd", lambda backend, a, b: total(jax_mamba2.ssd(a, dt, A, b, C, 64, backend=backend)), x, B),
        ("rms_norm", lambda backend, a, b: total(jax_mamba2.rms_norm(a, b, backend=backend)),
         rows, jnp.ones(32, jnp.float32)),
        ("causal_conv1d_silu", lambda backend, a, b: total(jax_mamba2.causal_conv1d_silu(a, b, backend=backend)),
         conv_x, jax.random.normal(keys[0], (4, 32), jnp.float32)),
        ("chunked_cross_entropy", lambda backend, a, b: jax_mamba2.chunked_cross_entropy(
            a, labels, embedding=b, backend=backend), rows, embedding),
    ]


@pytest.mark.parametrize("case", range(4), ids=[case[0] for case in _second_order_cases()])
def test_a_derivative_of_a_kernel_op_s_derivative_says_which_backends_take_one(case):
    """The kernel ops differentiate once (custom VJPs of kernel plans): a gradient of a gradient, or forward mode
    over one, raises a TypeError naming the backends that can, not JAX's missing rule of the launch primitive (the
    first derivatives lower: the tests above); on "xla" the second derivative runs."""
    name, f, a, b = _second_order_cases()[case]

    def second(backend, a):
        return jax.grad(lambda a: jnp.sum(jax.grad(functools.partial(f, backend), argnums=1)(a, b) ** 2))(a)

    message = r"the cuTile kernels \(backends 'cutile', 'cutile_callback'\) differentiate once.* needs backend='xla'"
    for backend in ("cutile", "cutile_callback"):
        with pytest.raises(TypeError, match=message):
            aot.export_for_cuda(functools.partial(second, backend), a)
    with pytest.raises(TypeError, match=message):
        aot.export_for_cuda(lambda a: jax.jvp(lambda a: jax.grad(functools.partial(f, "cutile"), argnums=1)(a, b),
                                              (a,), (a,)), a)
    assert bool(jnp.all(jnp.isfinite(jax.jit(second, static_argnums=0)("xla", a).astype(jnp.float32)))), name
