"""The kernels of a lowered program compile once per distinct kernel, concurrently (`bridge.compile_ahead`).

The LM's training step is lowered for sm_90 on this CPU machine with a slow fake compiler (no tileiras), which
records which kernels it was asked for and how many ran at once; one test compiles a real kernel both ways
and compares the cubins byte for byte.
"""
import io
import re
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

pytest.importorskip("cuda.tile")

from jax_mamba2 import rms_norm  # noqa: E402
from jax_mamba2.bridge import _compat, aot, compile_ahead  # noqa: E402
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel  # noqa: E402

FAKE_SECONDS = 0.2


class FakeCompiler:
    """compile_fn that sleeps FAKE_SECONDS and returns a placeholder cubin under the real symbol; records the
    keys it compiled and the most compiles in flight at once."""

    def __init__(self):
        self.keys, self.peak, self._running, self._lock = [], 0, 0, threading.Lock()

    def __call__(self, kernel, constraints, arch):
        assert arch == "sm_90"
        with self._lock:
            self.keys.append(_compat.compile_key(kernel, constraints))
            self._running += 1
            self.peak = max(self.peak, self._running)
        time.sleep(FAKE_SECONDS)
        with self._lock:
            self._running -= 1
        return _compat.kernel_signature(kernel, constraints).symbol, b"not a cubin"


class NotingCompiler(compile_ahead.KernelCompiler):
    """A KernelCompiler that also records the keys noted at trace time and asked for by the lowering."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noted, self.asked = set(), []

    def note(self, kernel, args):
        self.noted.add(_compat.compile_key(kernel, _compat.launch_constraints(kernel, args)))
        super().note(kernel, args)

    def compile(self, kernel, constraints):
        self.asked.append(_compat.compile_key(kernel, constraints))
        return super().compile(kernel, constraints)


def _lower_lm_train_step(n_layer: int, compiler) -> str:
    """The HLO text of the LM's loss gradient (f32 parameters, bf16 compute) lowered for sm_90 with `compiler`."""
    config = Mamba2Config(d_model=32, n_layer=n_layer, vocab_size=64,
                          ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    with aot.cuda_target("sm_90"), compile_ahead.using(compiler):
        model = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, backend="cutile", dtype=jnp.bfloat16,
                                                         rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, ids):
            return nnx.merge(graphdef, params, rest).loss(ids)

        ids = jax.ShapeDtypeStruct((2, 40), jnp.int32)
        return jax.jit(jax.grad(loss)).trace(params, ids).lower(lowering_platforms=("cuda",)).as_text()


def test_compile_ahead_lm_step_compiles_each_kernel_once_concurrently():
    fake = FakeCompiler()
    compiler = NotingCompiler(compile_fn=fake, max_workers=4)
    text = _lower_lm_train_step(24, compiler)

    launches = len(re.findall(rf"custom_call @{aot.CUTILE_CUSTOM_CALL}\(", text))
    assert len(fake.keys) == len(set(fake.keys)), "a kernel was compiled twice"
    assert set(compiler.asked) <= set(fake.keys)
    assert len(compiler.asked) == len(set(compiler.asked))
    assert set(compiler.asked) <= compiler.noted, "the lowering needed a launch the trace did not note"
    assert 10 <= len(compiler.asked) < launches, (len(compiler.asked), launches)
    assert fake.peak > 1, "no two compiles overlapped"
    assert len(compiler.compile_log()) == len(fake.keys)
    # The loss's softmax follows the model's backend (loss_backend=None): its kernels are in the step too.
    assert {r.kernel for r in compiler.compile_log()} >= {"chunk_scan_fwd_kernel", "chunk_scan_bwd_dx_kernel",
                                                          "causal_conv1d_bwd_kernel", "rms_norm_bwd_kernel",
                                                          "cross_entropy_fwd_kernel", "cross_entropy_bwd_kernel"}


@pytest.mark.parametrize("deterministic", [False, True])
def test_compile_ahead_notes_every_ssd_kernel_the_lowering_compiles(deterministic):
    import jax_mamba2
    from tests._helpers import make_ssd_args

    args, kwargs = make_ssd_args(0, batch=2, seqlen=100, nheads=4, headdim=32, ngroups=2, dstate=32,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[60, 40])

    def loss(x, dt, A, B, C):
        y, final = jax_mamba2.ssd(x, dt, A, B, C, 64, **kwargs, return_final_states=True,
                                  deterministic_backward=deterministic)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(final)

    fake = FakeCompiler()
    compiler = NotingCompiler(compile_fn=fake, max_workers=4)
    with aot.cuda_target("sm_90"), compile_ahead.using(compiler):
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(compiler.asked) >= 8
    assert set(compiler.asked) <= compiler.noted
    assert len(fake.keys) == len(set(fake.keys))


def test_compile_ahead_notes_the_local_launches_under_shard_map():
    import jax_mamba2
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tests._helpers import make_ssd_args

    args, _ = make_ssd_args(0, batch=4, seqlen=128, nheads=4, headdim=32, ngroups=1, dstate=32, dtype=jnp.bfloat16)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    specs = (P("data"), P("data"), P(), P("data"), P("data"))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]

    def loss(x, dt, A, B, C):
        return jnp.sum(jax_mamba2.ssd(x, dt, A, B, C, 64).astype(jnp.float32) ** 2)

    sharded = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), mesh=mesh, in_specs=specs, out_specs=specs)
    compiler = NotingCompiler(compile_fn=FakeCompiler())
    with aot.cuda_target("sm_90"), compile_ahead.using(compiler):
        aot.export_for_cuda(sharded, *args)
    assert len(compiler.asked) >= 5
    assert set(compiler.asked) <= compiler.noted


def test_compile_ahead_count_does_not_grow_with_layers():
    asked = []
    for n_layer in (2, 24):
        compiler = NotingCompiler(compile_fn=FakeCompiler(), max_workers=4)
        _lower_lm_train_step(n_layer, compiler)
        asked.append(sorted(map(repr, compiler.asked)))
    assert asked[0] == asked[1]


def test_compile_ahead_compiler_error_reaches_the_lowering():
    def failing(kernel, constraints, arch):
        raise RuntimeError(f"cannot compile {kernel._annotated_function.pyfunc.__name__}")

    x, weight = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64,), jnp.float32)
    with aot.cuda_target("sm_90"), compile_ahead.using(compile_ahead.KernelCompiler(compile_fn=failing)):
        traced = jax.jit(lambda x, w: rms_norm(x, w, backend="cutile")).trace(x, weight)
        with pytest.raises(RuntimeError, match="cannot compile rms_norm_fwd_kernel"):
            traced.lower(lowering_platforms=("cuda",))


def _rms_norm_kernel():
    """(kernel, constraints, arch, HLO text) of rms_norm's one forward kernel, lowered with a fake compiler."""
    seen = []

    def compile_fn(kernel, constraints, arch):
        seen.append((kernel, constraints, arch))
        return _compat.kernel_signature(kernel, constraints).symbol, b"not a cubin"

    x, weight = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64,), jnp.float32)
    with aot.cuda_target("sm_90"), compile_ahead.using(compile_ahead.KernelCompiler(compile_fn=compile_fn)):
        text = jax.jit(lambda x, w: rms_norm(x, w, backend="cutile")).trace(x, weight).lower(
            lowering_platforms=("cuda",)).as_text()
    (kernel, constraints, arch), = seen
    return kernel, constraints, arch, text


def _cutile_compile(kernel, constraints, arch) -> bytes:
    """The cubin cuda.tile.jax's own lowering compiles (one `export_kernel`, tileiras under cuTile's lock)."""
    from cuda.tile.compilation import export_kernel
    out = io.BytesIO()
    export_kernel(kernel, [_compat.kernel_signature(kernel, constraints)], out, gpu_code=arch, output_format="cubin")
    return out.getvalue()


def test_compile_ahead_retries_a_failed_compile():
    kernel, constraints, arch, _ = _rms_norm_kernel()
    calls = []

    def flaky(kernel, constraints, arch):
        calls.append(arch)
        if len(calls) == 1:
            raise RuntimeError("tileiras timed out")
        return "symbol", b"cubin"

    compiler = compile_ahead.KernelCompiler(compile_fn=flaky)
    with aot.cuda_target(arch):
        with pytest.raises(RuntimeError, match="tileiras timed out"):
            compiler.compile(kernel, constraints)
        assert compiler.compile(kernel, constraints) == ("symbol", b"cubin")
        assert compiler.compile(kernel, constraints) == ("symbol", b"cubin")
    assert calls == [arch, arch]
    assert [r.kernel for r in compiler.compile_log()] == ["rms_norm_fwd_kernel"]


def test_compile_ahead_cubin_matches_cutile_compile(monkeypatch):
    from cuda.tile._cext import default_tile_context

    kernel, constraints, arch, text = _rms_norm_kernel()
    monkeypatch.setattr(default_tile_context.config, "cache_dir", None)  # both run tileiras
    symbol, cubin = compile_ahead.compile_cubin(kernel, constraints, arch)
    assert symbol in text
    assert cubin[:4] == b"\x7fELF"
    assert cubin == _cutile_compile(kernel, constraints, arch)


def test_compile_ahead_cubin_shares_cutile_disk_cache(monkeypatch, tmp_path):
    import cuda.tile._compile as cutile_compile
    from cuda.tile._cext import default_tile_context

    kernel, constraints, arch, _ = _rms_norm_kernel()
    monkeypatch.setattr(default_tile_context.config, "cache_dir", str(tmp_path))
    _, cubin = compile_ahead.compile_cubin(kernel, constraints, arch)

    def no_tileiras(*args, **kwargs):
        raise AssertionError("tileiras ran: the cubin was not found in the disk cache")

    monkeypatch.setattr(cutile_compile, "compile_cubin", no_tileiras)
    assert _cutile_compile(kernel, constraints, arch) == cubin
    assert compile_ahead.compile_cubin(kernel, constraints, arch)[1] == cubin


@pytest.mark.gpu
def test_compile_ahead_gpu_lm_grads_with_fresh_cubins_match_xla():
    """On the GPU: a fresh compiler (nothing memoized in the process) compiles the cubins of the LM's
    gradient concurrently, and those run to the gradients of the pure-JAX backend."""
    from tests._helpers import rel_l2

    config = Mamba2Config(d_model=256, n_layer=3, vocab_size=256, pad_vocab_size_multiple=8,
                          ssm_cfg=dict(d_state=64, headdim=64, chunk_size=64))
    ids = jax.random.randint(jax.random.key(0), (2, 150), 0, config.vocab_size)

    def grads(backend):
        model = Mamba2LMHeadModel(config, backend=backend, rngs=nnx.Rngs(0))
        return nnx.to_flat_state(nnx.jit(nnx.grad(lambda m: m.loss(ids)))(model))

    compiler = compile_ahead.KernelCompiler()
    with compile_ahead.using(compiler):
        cutile = grads("cutile")
    compiled = [record.kernel for record in compiler.compile_log()]
    assert len(compiled) >= 10 and {"chunk_scan_bwd_dx_kernel", "causal_conv1d_bwd_kernel"} <= set(compiled)
    for (path, g_cutile), (_, g_xla) in zip(cutile, grads("xla")):
        assert rel_l2(g_cutile[...], g_xla[...]) < 2e-2, path


def test_discarded_notes_of_a_program_only_traced_are_not_compiled_by_a_later_lowering():
    fake = FakeCompiler()
    compiler = NotingCompiler(compile_fn=fake, max_workers=4)
    config = Mamba2Config(d_model=32, n_layer=1, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    with aot.cuda_target("sm_90"), compile_ahead.using(compiler):
        model = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, backend="cutile", rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        ids = jax.ShapeDtypeStruct((2, 40), jnp.int32)
        jax.make_jaxpr(jax.grad(lambda p, i: nnx.merge(graphdef, p, rest).loss(i)))(params, ids)
        assert compiler.noted, "tracing the step noted no launch"
        compiler.discard_pending()
        jax.jit(lambda p, i: nnx.merge(graphdef, p, rest)(i)).trace(params, ids).lower(
            lowering_platforms=("cuda",))
    assert set(fake.keys) == set(compiler.asked), "a launch of the discarded program was compiled"
