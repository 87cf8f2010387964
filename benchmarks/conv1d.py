"""The mixer's causal conv1d + SiLU, forward (or forward + backward), against its bandwidth floor and the peers.

Implementations (--impls):
  cutile         causal_conv1d_silu(backend="cutile") in jax.jit (kernels/causal_conv1d*.py); with --fwd-configs /
                 --bwd-configs, the kernels' plans at each listed tile (bridge/conv_ops.ConvKernels with those
                 configs: the same launches as the op, without its checks) to choose the defaults from
  xla            causal_conv1d_silu(backend="xla") in jax.jit (the reference: the sum of shifted taps in plain JAX)
  causal_conv1d  causal_conv1d's CUDA `causal_conv1d_fn` (channels-last, activation="silu"), the kernel of
                 mamba_ssm's fused path; `--causal-conv1d PATH` puts a built copy on sys.path
                 (benchmarks/README.md says how to build it); timed by CUDA-graph replay

Layouts (--layouts): "plain" convolves x (batch, seqlen, channels) into one y; "mixer" is the layer's
one-device path (causal_conv1d_silu_split): x is in_proj's whole output [z, xBC, dt] of d_ssm + channels +
nheads channels (d_ssm = channels - 256, d_state 128, one group, headdim 64), xBC read at offset d_ssm, and
y written as x, B, C (dy taken as dx, dB, dC). Both move the same bytes. "mixer_whole" is the mixer layout
with pass_through (what the layer runs): z and dt come out too (copied by the forward kernel), dy covers x's
whole width and dx is x's whole cotangent; the floor adds the copies of z and dt and of their cotangents (a
read and a write each).

Inputs: bf16 x, dy ~ N(0, 1), an f32 kernel ~ N(0, 1/d_conv) and bias ~ N(0, 1) rounded to bf16 (bf16
parameters, which every implementation takes as they are; the cuTile kernels read them as f32), no seq_idx.
fwd_bwd runs the forward and the VJP of a given dy (dx, dkernel, dbias), no loss reduction. Every output is
checked against xla in float32 (relative L2).

Floor: bytes / 4.3 TB/s (what a streaming copy reaches on the H200, against its 4.8 TB/s peak) with bytes =
2 · itemsize · elements (forward: x in, y out) and 3 · itemsize · elements more for the backward (x and dy
in, dx out), elements = batch · seqlen · channels (the conv's). Timing as benchmarks/ssd.py: ms_pipelined, the
median over 5 rounds of back-to-back calls, is the number to compare; gbps is floor bytes / ms_pipelined.

Run on the GPU machine:
  source .gpu/gpu-env.sh
  python benchmarks/conv1d.py [--causal-conv1d /tmp/ccsite] --out $OUT
  python benchmarks/conv1d.py --impls cutile --layouts mixer --shapes 8,2048,2304 \
      --fwd-configs 16x512x3 8x512x3 16x256x4 32x256x2 16x1024x2 --bwd-configs 16x16x256x2 8x32x256x3 8x32x128x4 \
      --out $OUT        (a sweep: every forward config with the default backward, then the backward ones)
Writes <out>/conv1d_<direction>_<gpu>.json (a list of records) and prints one line per record.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.environment import environment, exit_unless_cutile_runs, gpu_slug  # noqa: E402
from benchmarks.ssd import time_cuda_graph, time_jax  # noqa: E402
from jax_mamba2 import causal_conv1d_silu, causal_conv1d_silu_split  # noqa: E402
from jax_mamba2.conv1d import ConvInputs, ConvStatic  # noqa: E402

# (batch, seqlen, channels): the LM at d_model 1024 (conv_dim 2304, and the layer's x and [B, C] pieces) and
# at d_model 1536 (mamba2-780m: 3328) with 2 x 8192 tokens.
GRID = ((8, 2048, 2304), (8, 2048, 2048), (8, 2048, 256), (2, 8192, 3328))
D_CONV = 4
IMPLS = ("cutile", "xla", "causal_conv1d")
LAYOUTS = ("plain", "mixer", "mixer_whole")
# A streaming copy's bandwidth on the H200 (HBM3e, 4.8 TB/s peak): what a memory-bound kernel can reach.
STREAM_HBM_TBPS = 4.3
# The mixer layout's B and C (d_state 128, one group) and head size.
_BC, _HEADDIM = 128, 64


def mixer_layout(channels: int) -> tuple[int, int, tuple[int, int, int]]:
    """(channel offset, in_proj width, split) of the "mixer" layout of conv_dim `channels`."""
    d_ssm = channels - 2 * _BC
    return d_ssm, d_ssm + channels + d_ssm // _HEADDIM, (d_ssm, _BC, _BC)


def make_inputs(shape, seed: int = 0, layout: str = "plain") -> dict:
    """x (in the layout's width), kernel, bias and dy (the conv's channels; x's whole width in mixer_whole)."""
    batch, seqlen, channels = shape
    width = channels if layout == "plain" else mixer_layout(channels)[1]
    keys = jax.random.split(jax.random.key(seed), 4)
    return dict(x=jax.random.normal(keys[0], (batch, seqlen, width), jnp.bfloat16),
                kernel=(jax.random.normal(keys[1], (D_CONV, channels)) / np.sqrt(D_CONV)).astype(jnp.bfloat16),
                bias=jax.random.normal(keys[2], (channels,)).astype(jnp.bfloat16),
                dy=jax.random.normal(keys[3], (batch, seqlen, width if layout == "mixer_whole" else channels),
                                     jnp.bfloat16))


def floor_bytes(shape, direction: str, itemsize: int = 2, layout: str = "plain") -> int:
    elements = int(np.prod(shape))
    total = (2 + (3 if direction == "fwd_bwd" else 0)) * itemsize * elements
    if layout == "mixer_whole":
        batch, seqlen, channels = shape
        copies = 2 if direction == "fwd_bwd" else 1
        total += copies * 2 * itemsize * batch * seqlen * (mixer_layout(channels)[1] - channels)
    return total


def parse_config(text: str, config_type):
    """A config from its fields' values joined by "x": BLOCK_L x SEGMENT_TILES x BLOCK_C x OCCUPANCY (e.g.
    8x16x512x4; ConvBwdConfig with the default REDUCE_BLOCK_C), or for ConvFwdConfig also BLOCK_L x BLOCK_C x
    OCCUPANCY (e.g. 16x512x3: one tile per block)."""
    from jax_mamba2.kernels.causal_conv1d_bwd import REDUCE_BLOCK_C, ConvBwdConfig

    values = [int(v) for v in text.split("x")]
    segments = ["BLOCK_L", "SEGMENT_TILES", "BLOCK_C", "OCCUPANCY"]
    backward = config_type is ConvBwdConfig
    forms = [segments] if backward else [["BLOCK_L", "BLOCK_C", "OCCUPANCY"], segments]
    names = next((form for form in forms if len(form) == len(values)), None)
    if names is None:
        raise SystemExit(f"conv1d.py: config {text!r} must be " + " or ".join("x".join(f) for f in forms))
    return config_type(**dict(zip(names, values)), **({"REDUCE_BLOCK_C": REDUCE_BLOCK_C} if backward else {}))


def _pieces(y, layout: str, channels: int):
    """y (batch, seqlen, channels; x's whole width in mixer_whole) as the layout's outputs (a tuple)."""
    if layout == "plain":
        return (y,)
    offset, _, split = mixer_layout(channels)
    if layout == "mixer_whole":
        split = (offset, *split, y.shape[-1] - offset - channels)
    return tuple(jnp.split(y, list(np.cumsum(split[:-1])), axis=-1))


def jax_call(backend: str, inputs: dict, direction: str, layout: str = "plain", kernels=None):
    """A no-argument function returning (y, dx, dkernel, dbias) of the op (y and dx over the conv's
    channels, concatenated in the mixer layout; over x's whole width in mixer_whole); with `kernels` (a
    bridge ConvKernels), its plans."""
    channels = inputs["kernel"].shape[1]
    offset, _, split = mixer_layout(channels) if layout != "plain" else (0, channels, ())
    static = ConvStatic(silu=True, offset=offset, split=split, pass_through=layout == "mixer_whole")

    def forward(x, kernel, bias):
        if kernels is not None:
            return kernels.forward(ConvInputs(x, kernel, bias, None, None), static)
        if layout == "plain":
            return (causal_conv1d_silu(x, kernel, bias, backend=backend),)
        return causal_conv1d_silu_split(x, kernel, bias, channel_offset=offset, split=split,
                                        pass_through=static.pass_through, backend=backend)

    def window(dx):
        return dx if static.pass_through else dx[..., offset:offset + channels]

    if direction == "fwd":
        run = jax.jit(lambda *a: (jnp.concatenate(forward(*a), axis=-1),))
        return lambda: run(inputs["x"], inputs["kernel"], inputs["bias"])

    def fwd_bwd(x, kernel, bias, dy):
        dys = _pieces(dy, layout, channels)
        if kernels is not None:  # the custom VJP's two plans
            y = forward(x, kernel, bias)
            grads = kernels.backward(ConvInputs(x, kernel, bias, None, None), static, dys)
            return jnp.concatenate(y, axis=-1), window(grads.x), grads.kernel, grads.bias
        y, vjp = jax.vjp(forward, x, kernel, bias)
        dx, dkernel, dbias = vjp(dys)
        return jnp.concatenate(y, axis=-1), window(dx), dkernel, dbias

    run = jax.jit(fwd_bwd)
    return lambda: run(inputs["x"], inputs["kernel"], inputs["bias"], inputs["dy"])


def torch_call(inputs: dict, direction: str):
    """causal_conv1d_fn on torch views of the same arrays: x as (batch, channels, seqlen) with channel
    stride 1 (its channels-last kernels), weight (channels, d_conv)."""
    import torch
    from causal_conv1d import causal_conv1d_fn

    def tensor(a):
        return torch.from_dlpack(a).clone()

    x = tensor(inputs["x"]).requires_grad_(True).transpose(1, 2)
    weight = tensor(inputs["kernel"]).t().contiguous().requires_grad_(True)
    bias = tensor(inputs["bias"]).requires_grad_(True)
    dy = tensor(inputs["dy"]).transpose(1, 2)

    def run():
        y = causal_conv1d_fn(x, weight, bias, activation="silu")
        if direction == "fwd":
            return (y.transpose(1, 2),)
        dx, dweight, dbias = torch.autograd.grad(y, (x, weight, bias), dy)
        return y.transpose(1, 2), dx.transpose(1, 2), dweight.t(), dbias

    return run


def _as_jax(outputs):
    return [jnp.asarray(np.asarray(o.detach().float().cpu())) if hasattr(o, "detach") else o for o in outputs]


def rel_l2(actual, expected) -> float:
    actual, expected = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (actual, expected))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def measure(impl: str, shape, direction: str, budget_s: float, layout: str = "plain", fwd_config=None,
            bwd_config=None) -> dict:
    """One record: times, the floor and the errors against xla in float32."""
    inputs = make_inputs(shape, layout=layout)
    reference = jax_call("xla", jax.tree.map(lambda a: a.astype(jnp.float32), inputs), direction, layout)()
    configured = fwd_config is not None or bwd_config is not None
    if impl == "causal_conv1d":
        timing, outputs = time_cuda_graph(torch_call(inputs, direction), budget_s)
        outputs = _as_jax(outputs)
    else:
        kernels = None
        if configured:
            from jax_mamba2.bridge import conv_ops
            kernels = dataclasses.replace(conv_ops.KERNELS["cutile"], fwd_config=fwd_config,
                                          bwd_config=bwd_config)
        timing, outputs = time_jax(jax_call(impl, inputs, direction, layout, kernels), budget_s)
    names = ("y", "dx", "dkernel", "dbias")[:len(outputs)]
    floor = floor_bytes(shape, direction, layout=layout)
    config = {k: dataclasses.asdict(c) if c is not None else None
              for k, c in (("fwd", fwd_config), ("bwd", bwd_config))} if configured else None
    return dict(impl=impl, shape=list(shape), d_conv=D_CONV, direction=direction, dtype="bfloat16", layout=layout,
                config=config, ms_median=timing.ms_median, ms_pipelined=timing.ms_pipelined,
                floor_ms=floor / (STREAM_HBM_TBPS * 1e9), gbps=floor / (timing.ms_pipelined * 1e6),
                errors={n: rel_l2(o, r) for n, o, r in zip(names, outputs, reference)}, **environment())


def _jobs(args, impls, shapes, direction):
    """(impl, shape, layout, fwd_config, bwd_config) of every record of a direction: each impl and layout,
    then for cutile each listed config (a forward one with the default backward, and the reverse)."""
    from jax_mamba2.kernels.causal_conv1d import ConvFwdConfig
    from jax_mamba2.kernels.causal_conv1d_bwd import ConvBwdConfig

    fwd = [parse_config(c, ConvFwdConfig) for c in args.fwd_configs]
    bwd = [parse_config(c, ConvBwdConfig) for c in args.bwd_configs] if direction == "fwd_bwd" else []
    for shape in shapes:
        for layout in args.layouts:
            for impl in impls:
                if impl == "causal_conv1d" and layout != "plain":
                    continue
                yield impl, shape, layout, None, None
                if impl == "cutile":
                    yield from ((impl, shape, layout, cfg, None) for cfg in fwd)
                    yield from ((impl, shape, layout, None, cfg) for cfg in bwd)


def _describe(record) -> str:
    config = record["config"]
    if not config:
        return "default"
    return " ".join(f"{k}:" + "x".join(str(v) for k2, v in c.items() if k2 != "REDUCE_BLOCK_C")
                    for k, c in config.items() if c)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="+", default=["cutile", "xla"], choices=IMPLS)
    parser.add_argument("--causal-conv1d", help="a folder with a built causal_conv1d package (adds the impl)")
    parser.add_argument("--shapes", nargs="+", help="B,L,C shapes (default: the grid)")
    parser.add_argument("--direction", choices=("fwd", "fwd_bwd", "both"), default="both")
    parser.add_argument("--layouts", nargs="+", default=["plain"], choices=LAYOUTS)
    parser.add_argument("--fwd-configs", nargs="+", default=[], metavar="LxCxOCC|LxSxCxOCC",
                        help="forward tiles to time besides the default: BLOCK_L x BLOCK_C x OCCUPANCY (one tile "
                             "per block) or BLOCK_L x SEGMENT_TILES x BLOCK_C x OCCUPANCY (a segment per block)")
    parser.add_argument("--bwd-configs", nargs="+", default=[], metavar="LxSxCxOCC",
                        help="backward tiles: BLOCK_L x SEGMENT_TILES x BLOCK_C x OCCUPANCY")
    parser.add_argument("--budget-seconds", type=float, default=2.0, help="timing budget per record")
    parser.add_argument("--out", required=True, help="output folder")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    impls = list(args.impls)
    if args.causal_conv1d:
        sys.path.insert(0, args.causal_conv1d)
        impls += [] if "causal_conv1d" in impls else ["causal_conv1d"]
    if "cutile" in impls:
        exit_unless_cutile_runs("conv1d.py")
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else GRID
    directions = ("fwd", "fwd_bwd") if args.direction == "both" else (args.direction,)
    os.makedirs(args.out, exist_ok=True)
    for direction in directions:
        records = [measure(impl, shape, direction, args.budget_seconds, layout, fwd, bwd)
                   for impl, shape, layout, fwd, bwd in _jobs(args, impls, shapes, direction)]
        report.write_records(records, Path(args.out) / f"conv1d_{direction}_{gpu_slug(records[0]['gpu'])}.json")
        for r in records:
            print(f"{direction:8s} {str(tuple(r['shape'])):18s} {r['layout']:6s} {r['impl']:14s} "
                  f"{_describe(r):22s} {r['ms_pipelined']:8.4f} ms (floor {r['floor_ms']:.4f} at "
                  f"{STREAM_HBM_TBPS} TB/s, {r['ms_pipelined'] / r['floor_ms']:.2f}x) {r['gbps']:7.1f} GB/s  "
                  f"max rel L2 {max(r['errors'].values()):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
