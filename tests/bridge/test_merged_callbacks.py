"""bridge/merged_callbacks.py on the CPU: the LM's token step on the callback backend, its kernel plans merged
into one buffer callback (on a GPU one CUDA graph, replayed) whose launches run block by block on the
NumPy emulator, against the same model on xla, token after token; what is merged and what is not (a plan whose
in-place write would clobber a value read later, an XLA operation reading a plan's result); and the launches'
programmatic-dependent form, and the CUDA graphs that the merged callback replays."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ct = pytest.importorskip("cuda.tile")

from jax_mamba2 import backends, decode  # noqa: E402
from jax_mamba2.bridge import callback, decode_ops, merged_callbacks  # noqa: E402
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel  # noqa: E402
from jax_mamba2.kernels import decode_mixer, decode_projection  # noqa: E402
from jax_mamba2.kernels._common import (DEPENDENT, INDEPENDENT, WAITS, WAITS_AND_RELEASES, Buffer, Launch,  # noqa: E402
                                        Plan, wait_for_predecessor)
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels._decode_checks import PROJECTION_CASES, assert_lm_steps_match, projection_inputs  # noqa: E402

CONFIG = Mamba2Config(d_model=64, n_layer=2, vocab_size=128, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
# Wide enough that out_proj's K splits at two rows (its partial sums go to the next layer's norm kernel).
SPLIT_CONFIG = Mamba2Config(d_model=128, n_layer=2, vocab_size=256, ssm_cfg=dict(d_state=16, headdim=16,
                                                                                   chunk_size=8))


@pytest.fixture
def launches(monkeypatch):
    """backend="cutile_callback" of the decode ops as if on a GPU, every callback's launches (merged or not) run on
    the emulator (in the arrays' own dtypes); returns the (kernel name, programmatic) of every launch run."""
    monkeypatch.setitem(backends._REGISTRY[decode.OP], "cutile_callback", backends.LayerBackend(
        "cutile_callback", decode_ops.make_kernels(callback.run_plan), decode_ops.unsupported_reason))
    monkeypatch.setattr(decode_ops, "gpu_unavailable_reason", lambda: None)
    ran = []

    def launch(ctx, launch, args, programmatic):
        del ctx
        ran.append((launch.kernel._annotated_function.pyfunc.__name__, programmatic))
        emulator.launch_blocks(launch, [np.asarray(a) if hasattr(a, "__array__") else a for a in args])
    monkeypatch.setattr(callback, "cuda_launch", launch)
    # No CUDA graph on the CPU: each call launches directly.
    monkeypatch.setattr(callback, "replay", lambda ctx, launches, buffers, record: record(ctx))
    monkeypatch.setattr(callback, "replay_unavailable_reason", lambda: None)
    return ran


def _callbacks(jaxpr) -> list:
    """The buffer_callback equations of a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "buffer_callback":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    found += _callbacks(getattr(sub, "jaxpr", sub))
    return found


@pytest.mark.parametrize("config, batch", [(CONFIG, 2), (SPLIT_CONFIG, 2), (CONFIG, 9)],
                         ids=["one_k_step", "k_split", "norm_launch"])
def test_the_token_step_is_one_callback_with_the_xla_path_s_values(launches, config, batch):
    models = {"cutile": Mamba2LMHeadModel(config, backend="cutile_callback", rngs=nnx.Rngs(0)),
              "xla": Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))}
    tokens = jax.random.randint(jax.random.key(2), (3, batch), 0, config.vocab_size)
    assert_lm_steps_match(models, {b: m.init_cache(batch) for b, m in models.items()}, tokens, 2e-5)

    graphdef, state = nnx.split(models["cutile"])
    jaxpr = jax.make_jaxpr(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))(
        state, tokens[0], models["cutile"].init_cache(batch)).jaxpr
    calls = _callbacks(jaxpr)
    assert len(calls) == 1
    # Few buffers (the callback's Python receives each at every call), however many layers: in the stacked
    # parameters, the token's embedding and one array of every small constant (layer indices, placeholders); out
    # the logits, each layer's B and C windows, the two state stacks (in place) and one workspace for every array
    # that the kernels alone read.
    n_in, n_out = len(calls[0].invars), len(calls[0].params["result_avals"])
    assert n_in <= 16 and n_out == config.n_layer + 4, (n_in, n_out)
    assert calls[0].invars[-1].aval.dtype == calls[0].params["result_avals"][-1].dtype == jnp.uint8
    # The conv and SSM state stacks are written in place: inputs aliased to outputs.
    cache = models["cutile"].init_cache(batch)
    written_in_place = [calls[0].params["result_avals"][o].shape for _, o in calls[0].params["input_output_aliases"]]
    assert cache.conv_state.shape in written_in_place and cache.ssm_state.shape in written_in_place
    # Every launch after the first waits for its predecessor and lets its successor start.
    per_step = len(launches) // len(tokens)
    assert [p for _, p in launches[:per_step]] == [False] + [True] * (per_step - 1)
    kernels = {name for name, _ in launches}
    assert {"decode_norm_kernel", "decode_project_kernel", "mixer_step_kernel"} <= kernels


def _add_one(x, y, TILE: ct.Constant[int], DEPENDENT: ct.Constant[int]):
    """y = x + 1, one TILE per block."""
    wait_for_predecessor(DEPENDENT)
    block = ct.bid(0)
    ct.store(y, index=(block,), tile=ct.load(x, index=(block,), shape=(TILE,)) + 1.0)


ADD_ONE = Plan(inputs=("x",), buffers={"y": Buffer((8,), "float32")},
               launches=(Launch(ct.kernel(_add_one), (2,), ("x", "y", 4, INDEPENDENT), ("y",)),), outputs=("y",))


def test_an_xla_operation_on_a_plan_s_result_ends_the_run_and_independent_ones_do_not(launches):
    def fn(x, w):
        a = callback.run_plan(ADD_ONE, {"x": x})["y"]
        v = jnp.sin(w)  # independent of the plans: evaluated before the merged callback
        b = callback.run_plan(ADD_ONE, {"x": a})["y"]
        c = b * 2.0  # reads a plan's result: the first run ends here
        d = callback.run_plan(ADD_ONE, {"x": c + v})["y"]
        return d, a

    x, w = jnp.arange(8, dtype=jnp.float32), jnp.ones(8, jnp.float32)
    merged = merged_callbacks.merge_plan_callbacks(fn, dependent=WAITS)
    assert len(_callbacks(jax.make_jaxpr(merged)(x, w).jaxpr)) == 2
    d, a = jax.jit(merged)(x, w)
    np.testing.assert_allclose(a, x + 1)
    np.testing.assert_allclose(d, (x + 2) * 2 + np.sin(1.0) + 1, rtol=1e-6)
    assert [p for _, p in launches] == [False, True, False]


ADD_ONE_IN_PLACE = Plan(inputs=("x",), buffers={}, outputs=("x",),
                        launches=(Launch(ct.kernel(_add_one), (2,), ("x", "x", 4, INDEPENDENT), ("x",)),))


def test_a_plan_writing_in_place_a_value_read_later_runs_alone(launches):
    def fn(x):
        a = callback.run_plan(ADD_ONE, {"x": x})["y"]
        b = callback.run_plan(ADD_ONE_IN_PLACE, {"x": a})["x"]  # overwrites a's buffer, which c reads after
        c = a * 3.0
        return b, c

    x = jnp.arange(8, dtype=jnp.float32)
    merged = merged_callbacks.merge_plan_callbacks(fn)
    calls = _callbacks(jax.make_jaxpr(merged)(x).jaxpr)
    assert len(calls) == 2 and dict(calls[1].params["input_output_aliases"]) == {0: 0}
    b, c = jax.jit(merged)(x)
    np.testing.assert_allclose(b, x + 2)
    np.testing.assert_allclose(c, (x + 1) * 3)


def test_launch_dependent_sets_the_kernel_s_constant_only():
    # The norm, a product of K split over blocks, and their sum: every launch of a projection.
    dims = decode_projection.ProjectionDims(rows=1, features=2048, out_features=1024, has_norm=True,
                                            weight_dtype="bfloat16")
    plan_launches = decode_projection.norm_project_plan(dims).launches
    assert len(plan_launches) == 3
    for launch in plan_launches:
        assert launch.can_be_dependent
        at = list(launch.kernel._annotated_function.pysig.parameters).index(DEPENDENT)
        waiting = launch.dependent(WAITS_AND_RELEASES)
        assert (launch.args[at], waiting.args[at]) == (INDEPENDENT, WAITS_AND_RELEASES)
        assert waiting.args[:at] + waiting.args[at + 1:] == launch.args[:at] + launch.args[at + 1:]
    assert all(DEPENDENT in k._annotated_function.pysig.parameters for k in decode_mixer.MIXER_STEP_KERNELS)


def test_vmap_folds_the_rows_then_merges_and_grad_is_the_ops_own(launches):
    """Under vmap each op's batching rule folds the items into its rows, and the batched plans are merged into one
    callback again; grad differentiates the ops themselves (their VJP is the reference's)."""
    case = PROJECTION_CASES["add_norm_in_proj"]
    a = {k: None if v is None else jnp.asarray(v) for k, v in projection_inputs(case, seed=35).items()}

    def one(x, residual, backend="cutile_callback"):
        def project(x, residual):
            return decode.norm_project(x, a["weight"], norm_weight=a["norm_weight"], residual=residual,
                                       residual_dtype=jnp.float32, layer=case.layer, backend=backend)
        return decode.token_step(project, backend)(x, residual)

    xs, residuals = jnp.stack([a["x"], -a["x"]]), jnp.stack([a["residual"], 0.5 * a["residual"]])
    batched = jax.jit(jax.vmap(one))
    assert len(_callbacks(jax.make_jaxpr(batched)(xs, residuals).jaxpr)) == 1
    got = batched(xs, residuals)
    for i in range(2):
        for g, w in zip(got, one(xs[i], residuals[i], "xla")):
            assert rel_l2(g[i], w) < 1e-6

    def loss(backend):
        return jax.jit(jax.grad(lambda x, r: jnp.sum(jnp.sin(one(x, r, backend)[0])), argnums=(0, 1)))
    for g, w in zip(loss("cutile_callback")(a["x"], a["residual"]), loss("xla")(a["x"], a["residual"])):
        assert rel_l2(g, w) < 1e-5


class _FakeBuffer:
    def __init__(self, address):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (1,), "typestr": "<f4", "version": 2}


def test_replay_captures_at_the_first_call_of_a_set_of_addresses_and_launches_the_graph_after(monkeypatch):
    """callback.replay with a stand-in for CuPy's streams and graphs: the first call of (launches, addresses)
    launches directly on XLA's stream and captures the same launches on a side stream of the buffers' device (not
    CuPy's current one); later calls launch the graph there; other addresses capture again; the cache keeps the
    GRAPH_CACHE_SIZE most recently used."""
    events = []

    class Graph:
        def __init__(self, n):
            self.n, self.graphExec = n, None

        def upload(self, stream):
            events.append(("upload", stream.ptr))
            self.graphExec = self.n  # instantiated

    class Stream:
        count = 0

        def __init__(self, non_blocking=False):
            Stream.count += 1
            self.ptr = 1000 + Stream.count

        def begin_capture(self, mode=None):
            events.append(("begin", self.ptr))

        def end_capture(self):
            events.append(("end", self.ptr))
            return Graph(self.ptr)

        def synchronize(self):
            events.append(("synchronize", self.ptr))

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            events.append(("device", self.device))

        def __exit__(self, *exc):
            return False

    def pointer_attributes(address):
        return type("attributes", (), {"device": 1})  # the buffers lie on the second GPU

    def graph_launch(graph_exec, stream):
        assert graph_exec is not None, "launched before it was instantiated"
        events.append(("graph", graph_exec, stream))

    runtime = type("runtime", (), {"streamCaptureModeRelaxed": 2,
                                   "pointerGetAttributes": staticmethod(pointer_attributes),
                                   "graphLaunch": staticmethod(graph_launch)})
    cuda = type("cuda", (), {"Stream": Stream, "Device": Device, "runtime": runtime})
    monkeypatch.setitem(sys.modules, "cupy", type("cupy", (), {"cuda": cuda}))
    monkeypatch.setattr(callback, "_GRAPHS", type(callback._GRAPHS)())
    monkeypatch.setattr(callback, "GRAPH_CACHE_SIZE", 2)
    ctx = type("ctx", (), {"stream": 7})()

    def record(ctx):
        events.append(("launch", ctx.stream))

    token = object()
    callback.replay(ctx, token, [_FakeBuffer(1), _FakeBuffer(2)], record)
    # Captured on a stream of the buffers' device.
    assert events == [("launch", 7), ("device", 1), ("begin", 1001), ("launch", 1001), ("end", 1001), ("upload", 1001),
                      ("synchronize", 1001)]
    events.clear()
    callback.replay(ctx, token, [_FakeBuffer(1), _FakeBuffer(2)], record)
    assert events == [("device", 1), ("graph", 1001, 7)]
    events.clear()
    callback.replay(ctx, token, [_FakeBuffer(3), _FakeBuffer(2)], record)  # other addresses: captured again
    callback.replay(ctx, object(), [_FakeBuffer(1), _FakeBuffer(2)], record)  # other launches: too
    assert [e[0] for e in events] == ["launch", "device", "begin", "launch", "end", "upload", "synchronize"] * 2
    assert len(callback._GRAPHS) == 2  # the first graph, least recently used, was dropped
    events.clear()
    callback.replay(ctx, token, [_FakeBuffer(1), _FakeBuffer(2)], record)
    assert events[0] == ("launch", 7)


def test_replay_s_graphs_are_released_at_exit_before_jax_s_teardown():
    """CuPy destroys a CUDA graph when it is collected, which at interpreter exit must come before JAX's and
    cuda.tile's teardown: an exit handler registered before the bridge's import (as JAX's and cuda.tile's are)
    runs after the graphs are gone."""
    script = textwrap.dedent("""
        import atexit
        atexit.register(print, "teardown")  # registered first, as JAX's own exit handlers are
        from jax_mamba2.bridge import callback

        class Graph:
            def __del__(self):
                print("graph released", flush=True)

        callback._GRAPHS["key"] = Graph(), 0
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["graph released", "teardown"], done.stdout


def test_the_callback_backend_s_token_step_without_cupy_says_why(monkeypatch):
    monkeypatch.setattr(callback, "replay_unavailable_reason", lambda: "CuPy is not installed")
    with pytest.raises(ValueError, match="backend='cutile_callback'.*CuPy is not installed"):
        decode.token_step(lambda x: x, "cutile_callback")
    assert decode.token_step(abs, "cutile") is abs  # other backends: the function itself


def test_views_give_the_launches_part_of_a_buffer_as_an_array():
    """A reshape keeps the buffer's own type description; a typed view into a byte buffer (the workspace, the
    constants' input) states its offset address and NumPy dtype; on the CPU both read the same elements."""
    base = _FakeBuffer(4096)
    base.__cuda_array_interface__.update(descr=[("", "<f4")], shape=(8,))
    reshaped = merged_callbacks._View(base, 0, (2, 4)).__cuda_array_interface__
    assert reshaped["shape"] == (2, 4) and reshaped["data"] == (4096, False) and reshaped["descr"] == [("", "<f4")]
    typed = merged_callbacks._View(base, 256, (3,), np.int32).__cuda_array_interface__
    assert typed == {"version": 2, "typestr": "<i4", "data": (4096 + 256, False), "shape": (3,), "strides": None}
    workspace = np.arange(512, dtype=np.uint8)
    values = np.asarray(merged_callbacks._View(workspace, 256, (2, 2), np.int32))
    np.testing.assert_array_equal(values.reshape(-1), workspace[256:272].view(np.int32))


def test_small_numeric_constants_are_told_apart_by_content_in_the_dtype_jax_gives_them():
    flat = merged_callbacks._Flat()
    signature = {name: flat.signatures[flat.new(value, known=True)] for name, value in {
        "python int": 3, "int32": np.int32(3), "zeros": jnp.zeros((1, 1)), "key": jax.random.key(0),
        "bfloat16": jnp.ones(2, jnp.bfloat16), "large": np.arange(100)}.items()}
    assert signature["python int"] == signature["int32"] == ("constant", "<i4", (), np.int32(3).tobytes())
    assert signature["zeros"][:3] == ("constant", "<f4", (1, 1))
    assert [signature[k][0] for k in ("key", "bfloat16", "large")] == ["id"] * 3  # kept as inputs of their own
