"""The Mamba2 mixer's causal conv on the kernel path (conv and SSD plans on the NumPy emulator of
tests/kernels/_cutile_emulator.py, through `jax.pure_callback`): one device convolves [x, B, C] in one launch
each way, straight from in_proj's output into the SSD's inputs (pinned on the compiled HLO of the layer's
forward + backward); head parallelism keeps x and [B, C] apart. Both against the xla layer."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jax_mamba2 import backends, conv1d
from jax_mamba2.flax_layers import Mamba2, shard_model
from tests._helpers import rel_l2

conv_ops = pytest.importorskip("jax_mamba2.bridge.conv_ops")
from tests.bridge._emulated_backend import EMULATED  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402

# 8 heads of 16, d_ssm 128, one group of d_state 16: conv_dim 160, d_in_proj 2 * 128 + 32 + 8 = 296. No
# gated norm: its kernels are not emulated here (z gates the SSD's output inside the SSD instead).
MIXER = dict(d_state=16, headdim=16, chunk_size=16, rmsnorm=False)
D_MODEL, BATCH, SEQLEN = 64, 2, 32


@pytest.fixture
def emulated(monkeypatch):
    """backend="cutile" runs the conv and SSD plans on the emulator."""
    kernels = conv_ops.ConvKernels("cutile_emulated", emulator.jax_run_plan)
    monkeypatch.setitem(backends._REGISTRY[conv1d.OP], "cutile",
                        backends.LayerBackend("cutile", kernels, backends.always_supported, auto_priority=2))
    monkeypatch.setitem(backends._REGISTRY["ssd"], "cutile", dataclasses.replace(EMULATED, name="cutile"))


def _layer(backend, **options):
    return Mamba2(D_MODEL, **{**MIXER, **options}, backend=backend, rngs=nnx.Rngs(0))


def _inputs():
    u = jax.random.normal(jax.random.key(1), (BATCH, SEQLEN, D_MODEL))
    return u, jax.random.normal(jax.random.key(2), u.shape)


def _loss(layer, u, weights):
    return jnp.sum(layer(u) * weights)


# ----------------------------------------------------------------------------------------------
# The compiled program: what lies between in_proj, the conv and the SSD
# ----------------------------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


def _instructions(hlo: str, computation: str = "ENTRY") -> dict[str, dict]:
    """name -> {shape, op, operands, calls, line} of the instructions of one computation of HLO text."""
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(computation + " ") or
                 line.startswith(f"%{computation} "))
    out = {}
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        rest = line[match.end():]
        depth, end = 0, 0
        for end, ch in enumerate(rest):  # the shape: a tuple in parentheses, or up to the first space
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and ch in (")", " "):
                break
        shape, rest = rest[:end + 1].strip(), rest[end + 1:].lstrip()
        op = rest[:rest.index("(")]
        args = rest[rest.index("(") + 1:]
        depth = 1
        for end, ch in enumerate(args):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        calls = re.search(r"calls=%([\w.\-]+)", line)
        out[match.group(1)] = dict(shape=shape, op=op, operands=re.findall(r"%([\w.\-]+)", args[:end]),
                                   calls=calls.group(1) if calls else None, line=line)
    return out


def _elements(shape: str) -> int:
    """Elements of the largest array of an HLO shape (a tuple's largest)."""
    return max((int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", shape)),
               default=0)


def _copies(hlo: str, entry: dict, name: str, min_elements: int = 0) -> set[str]:
    """The copying ops (slice, concatenate, copy, dynamic-slice) that instruction `name` is or whose fused
    computation contains, those of at least `min_elements` elements."""
    moving = {"slice", "concatenate", "copy", "dynamic-slice"}
    inst = entry[name]
    if inst["op"] != "fusion":
        return {inst["op"]} & moving if _elements(inst["shape"]) >= min_elements else set()
    return {i["op"] for i in _instructions(hlo, inst["calls"]).values()
            if i["op"] in moving and _elements(i["shape"]) >= min_elements}


def _computes_a_matmul(hlo: str, entry: dict, name: str) -> bool:
    """Whether instruction `name` is a matrix product: a dot, a GEMM custom call, or a fusion around a dot."""
    inst = entry[name]
    if inst["op"] == "fusion":
        return any(i["op"] == "dot" for i in _instructions(hlo, inst["calls"]).values())
    return inst["op"] == "dot" or (inst["op"] == "custom-call" and "gemm" in inst["line"].lower())


def _source(entry: dict, name: str) -> str:
    """What `name` is a view of: bitcasts and get-tuple-elements followed back."""
    while entry[name]["op"] in ("bitcast", "get-tuple-element"):
        name = entry[name]["operands"][0]
    return name


def _producer(hlo: str, entry: dict, name: str) -> str:
    """What `name` is computed from: views followed back, and past fusions that multiply no matrices to their
    operand of the same size (the op's finite parts of the SSD's inputs and cotangents, its non-finite reach
    term added to the gradients; the fusions that read the conv's own outputs are checked for copies below)."""
    name = _source(entry, name)
    while entry[name]["op"] == "fusion" and not _computes_a_matmul(hlo, entry, name):
        size = _elements(entry[name]["shape"])
        same = [o for o in entry[name]["operands"] if _elements(entry[o]["shape"]) == size]
        if not same:
            break
        name = _source(entry, same[0])
    return name


def test_one_device_layer_convolves_in_proj_output_in_place_in_one_launch_each_way(emulated):
    """In the compiled forward + backward of the layer: the conv's forward reads in_proj's product itself and
    its outputs are the SSD forward's x, B, C (views, read by the op's finite parts), with z and dt (copied by the same launch: no
    slice of in_proj's product anywhere); its backward takes the SSD backward's dx, dB,
    dC and the gated norm's dz as they come and writes the whole cotangent of in_proj's output, which in_proj's
    backward matmuls read as it is; one conv launch each way; no slice / concatenate / copy fusion of
    activation size reads or writes an activation of the conv."""
    layer, (u, weights) = _layer("cutile"), _inputs()
    graphdef, state = nnx.split(layer)
    grad = jax.jit(jax.grad(lambda state, u: _loss(nnx.merge(graphdef, state), u, weights), argnums=(0, 1)))
    hlo = grad.lower(state, u).compile().as_text()
    entry = _instructions(hlo)
    calls = {n: i for n, i in entry.items() if i["op"] == "custom-call"}
    d_in_proj = 2 * layer.d_inner + 2 * layer.d_state + layer.nheads
    in_proj_shape = f"f32[{BATCH},{SEQLEN},{d_in_proj}]"
    forward = [n for n, i in calls.items() if i["shape"].count(f"[{BATCH},{SEQLEN},") == 5 and
               i["shape"].startswith(f"(f32[{BATCH},{SEQLEN},{layer.d_ssm}]") and
               entry[i["operands"][0]]["shape"].startswith(in_proj_shape)]
    backward = [n for n, i in calls.items() if i["shape"].startswith(f"(f32[{BATCH},{SEQLEN},{d_in_proj}]")]
    assert len(forward) == 1 and len(backward) == 1, (forward, backward)
    (fwd,), (bwd,) = forward, backward

    # The forward's input is in_proj's matmul output itself, not a copy of its slice, and nothing slices it.
    in_proj = _source(entry, calls[fwd]["operands"][0])
    assert _computes_a_matmul(hlo, entry, in_proj)
    in_proj_views = {n for n in entry if _source(entry, n) == in_proj}
    readers = [n for n, i in entry.items() if set(i["operands"]) & in_proj_views and n not in in_proj_views]
    assert readers and not any(_copies(hlo, entry, n) for n in readers), readers
    # The SSD's forward and backward take x, B, C from the conv's outputs: views, through the op's finite parts.
    ssd_calls = [n for n, i in entry.items() if i["op"] == "custom-call" and n not in (fwd, bwd)
                 and sum(_producer(hlo, entry, o) == fwd for o in i["operands"]) >= 3]
    # The SSD's forward, its backward's recompute of the chunk states (the layer's default) and its backward.
    assert len(ssd_calls) == 3, ssd_calls
    # The conv's backward takes dx, dB, dC straight from the SSD's backward (past the op's reach term).
    activation = BATCH * SEQLEN * layer.d_state  # the smallest activation: B or C
    dys = [_source(entry, o) for o in calls[bwd]["operands"] if _elements(entry[o]["shape"]) >= activation]
    assert len(dys) == 5 and dys[0] == _source(entry, calls[fwd]["operands"][0]), dys  # in_proj's product, dy's
    ssd_grads = {_producer(hlo, entry, d) for d in dys[1:4]}  # dx, dB, dC
    assert len(ssd_grads) == 1 and ssd_grads <= set(ssd_calls), dys
    # Nothing around the conv moves activations: no slice / concatenate / copy fusion consumes its outputs.
    conv_values = {fwd, bwd} | {n for n, i in entry.items() if i["op"] in ("bitcast", "get-tuple-element") and
                                _source(entry, n) in (fwd, bwd)}
    # in_proj's output cotangent is the backward's dx as it wrote it: only matrix products (its weight and
    # input gradients) read it, on the CPU through a layout copy for the weight gradient's transposed
    # operand; no pad or add assembles it from pieces.
    dx = {n for n, i in entry.items() if i["op"] in ("get-tuple-element", "bitcast") and _source(entry, n) == bwd
          and not i["shape"].startswith("(") and _elements(i["shape"]) == BATCH * SEQLEN * d_in_proj}

    def readers(names):  # past views
        return [n for n, i in entry.items() if set(i["operands"]) & set(names) and n not in dx]

    layout_copies = [n for n in readers(dx) if not _computes_a_matmul(hlo, entry, n)]
    assert readers(dx) and all(_copies(hlo, entry, n) == {"copy"} for n in layout_copies), layout_copies
    assert all(_computes_a_matmul(hlo, entry, n) for n in readers(layout_copies)), layout_copies
    for name, inst in entry.items():
        if name in layout_copies:
            continue
        if set(inst["operands"]) & conv_values and _elements(inst["shape"]) >= activation:
            # (Fusions may move small arrays inside, e.g. the SSD's per-(token, head) reach term.)
            assert not _copies(hlo, entry, name, activation), (name, inst)


def test_one_device_layer_on_the_emulated_kernels_matches_xla(emulated):
    """Forward, prefill (the conv state from the same launch) and gradients, with seq_idx."""
    layers = {b: _layer(b) for b in ("cutile", "xla")}
    u, weights = _inputs()
    seq_idx = jnp.asarray(np.repeat([[0] * 20 + [1] * 12], BATCH, axis=0), jnp.int32)
    forward = nnx.jit(lambda m: m(u, seq_idx=seq_idx))
    out = {b: forward(m) for b, m in layers.items()}
    assert rel_l2(out["cutile"], out["xla"]) < 1e-5
    prefill = {b: nnx.jit(lambda m: m.prefill(u))(m) for b, m in layers.items()}
    assert rel_l2(prefill["cutile"][0], prefill["xla"][0]) < 1e-5
    np.testing.assert_allclose(prefill["cutile"][1].conv_state, prefill["xla"][1].conv_state, rtol=1e-6)
    grad = nnx.jit(nnx.grad(lambda m: _loss(m, u, weights)))
    grads = {b: nnx.to_flat_state(grad(m)) for b, m in layers.items()}
    for (path, g_cutile), (_, g_xla) in zip(grads["cutile"], grads["xla"]):
        assert rel_l2(g_cutile[...], g_xla[...]) < 1e-5, path


def test_one_device_layer_under_remat_matches_xla(emulated):
    layers = {b: _layer(b) for b in ("cutile", "xla")}
    u, weights = _inputs()
    grad = nnx.jit(nnx.grad(lambda m: jnp.sum(nnx.remat(lambda m, u: m(u))(m, u) * weights)))
    grads = {b: nnx.to_flat_state(grad(m)) for b, m in layers.items()}
    for (path, g_cutile), (_, g_xla) in zip(grads["cutile"], grads["xla"]):
        assert rel_l2(g_cutile[...], g_xla[...]) < 1e-5, path


@pytest.mark.parametrize("model_size,ngroups", [(2, 1), (2, 2), (1, 1)],
                         ids=["heads_split_groups_replicated", "heads_and_groups_split", "data_parallel"])
def test_sharded_layer_on_the_emulated_kernels_matches_one_device(emulated, model_size, ngroups):
    """Under head parallelism (model axis of 2) the conv runs as x and [B, C] apart; with a model axis of
    size 1 it is the one-launch path inside shard_map over the data axis."""
    mesh = jax.make_mesh((2, model_size), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:2 * model_size])
    u, weights = _inputs()
    one, sharded = _layer("cutile", ngroups=ngroups), shard_model(_layer("cutile", ngroups=ngroups), mesh)
    loss = nnx.jit(nnx.value_and_grad(lambda m: _loss(m, u, weights)))
    (want, want_grads), (got, got_grads) = loss(one), loss(sharded)
    assert rel_l2(got, want) < 1e-5
    for (path, g), (_, e) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(want_grads)):
        assert rel_l2(g[...], e[...]) < 1e-5, path
