"""The decode step's fused kernels (`jax_mamba2.decode`) at an LM's shapes, against their bandwidth floor; a sweep of
the projection kernel's tiles and hints.

Cases, for the LM of --d-model (24 layers, d_state 128, headdim 64, expand 2, vocab 50280):
  in_proj   norm_project: the block's residual add + RMSNorm, then x @ in_proj (d_model x d_in_proj)
  out_proj  norm_project: the gated RMSNorm (gate read from in_proj's output), then y @ out_proj (d_inner x d_model);
            as in the LM's step, up to GATED_NORM_IN_MIXER_ROWS rows the norm's input is the mixer step's (gated,
            float32) with its sums of squares, and the product normalizes (one launch)
  head      norm_project: the final add + RMSNorm, then x @ embedding^T (the tied LM head, one layer)
  mixer     mixer_step: the conv step + SSD state update of one layer (state in the parameters' dtype); as in the
            LM's step, up to GATED_NORM_IN_MIXER_ROWS rows it also gates y and sums its squares for the norm
Parameters (--param-dtypes) bfloat16 or float32; activations bfloat16; rows = --batches.

Timing: one jitted program launches the kernel once for each of the 24 layers of the stacked parameters (the head
on a stack of 24 embeddings), as a decode step does, so each launch reads weights no other launch of the round
left in L2; us_per_launch is the program's pipelined time (benchmarks/ssd.py `time_jax`) over 24, kernel_us the
GPU time of the op's kernels per call (a projection's norm and product launches together) in a profiler trace of
one program (with the program's other kernels, under "others"). Floor: the bytes the launch
must move (its layer's weights, the state read and written, the rows) at 4.8 TB/s. --sweep also times every
projection and mixer config of `sweep_configs` (the default's record has "default": true).

Run on the GPU machine:
  source .gpu/gpu-env.sh
  python benchmarks/decode_kernels.py --sweep --out $OUT
Writes <out>/decode_kernels_<gpu>.json after every record (records of an earlier run in the same file are kept
unless remeasured) and prints one line per record.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment, exit_unless_cutile_runs, gpu_slug  # noqa: E402
from benchmarks.lm_bench import write_json  # noqa: E402
from benchmarks.ssd import PEAK_HBM_TBPS, time_jax  # noqa: E402
from jax_mamba2 import backends, decode  # noqa: E402
from jax_mamba2.flax_layers.mamba2 import GATED_NORM_IN_MIXER_ROWS  # noqa: E402

LAYERS = 24
# The decode ops' kernels: a projection launches the first two (the second alone without a norm, the third after
# it with a split K).
DECODE_KERNELS = ("decode_norm_kernel", "decode_project_kernel", "decode_split_sum_kernel", "mixer_step_kernel")
VOCAB = 50280
CASES = ("in_proj", "out_proj", "head", "mixer")


@dataclasses.dataclass(frozen=True)
class Shapes:
    d_model: int
    d_state: int = 128
    headdim: int = 64

    @property
    def d_inner(self) -> int:
        return 2 * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.d_state

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.d_state + self.nheads


def sweep_configs(case: str, rows: int):
    """The tiles and hints the sweep times: the projection product's columns, K step with its latency hint and
    occupancy hint, or the mixer step's state rows per block and occupancy hint."""
    from jax_mamba2.kernels.decode_mixer import MixerStepConfig
    from jax_mamba2.kernels.decode_projection import ProjectionConfig
    if case == "mixer":
        return [MixerStepConfig(BLOCK_P=p, OCCUPANCY=occ) for p, occ in itertools.product((32, 64), (2, 4, 8))]
    return [ProjectionConfig(BLOCK_N=n, BLOCK_K=k, LATENCY=latency, OCCUPANCY=occupancy)
            for n, (k, latency), occupancy in itertools.product((32, 64, 128), ((128, 4), (256, 2)), (None, 2))]


def _arrays(case: str, s: Shapes, rows: int, param_dtype, key):
    """The case's inputs: (fn(layer, **arrays) -> outputs, arrays, floor bytes per launch)."""
    keys = iter(jax.random.split(key, 12))

    def normal(shape, dtype, scale=1.0):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    bf16, itemsize = jnp.bfloat16, jnp.dtype(param_dtype).itemsize
    if case == "in_proj":
        arrays = dict(x=normal((rows, s.d_model), bf16), residual=normal((rows, s.d_model), jnp.float32),
                      weight=normal((LAYERS, s.d_model, s.d_in_proj), param_dtype, s.d_model ** -0.5),
                      norm_weight=normal((LAYERS, s.d_model), param_dtype, 0.1) + 1)
        floor = s.d_model * s.d_in_proj * itemsize + rows * (s.d_model * 10 + s.d_in_proj * 2)
        return (lambda layer, x, residual, weight, norm_weight: decode.norm_project(
            x, weight, norm_weight=norm_weight, residual=residual, residual_dtype=jnp.float32, layer=layer,
            dtype=bf16)), arrays, floor
    if case == "out_proj":
        arrays = dict(weight=normal((LAYERS, s.d_inner, s.d_model), param_dtype, s.d_inner ** -0.5),
                      norm_weight=normal((LAYERS, s.d_inner), param_dtype, 0.1) + 1)
        if rows > GATED_NORM_IN_MIXER_ROWS:  # the norm's own launch gates y
            arrays.update(y=normal((rows, s.d_inner), bf16), z=normal((rows, s.d_in_proj), bf16))
            floor = s.d_inner * s.d_model * itemsize + rows * (s.d_inner * 4 + s.d_model * 2)
            return (lambda layer, y, z, weight, norm_weight: decode.norm_project(
                y, weight, norm_weight=norm_weight, z=z, layer=layer, dtype=bf16)), arrays, floor
        from jax_mamba2.kernels.decode_mixer import sum_squares_parts
        parts = sum_squares_parts(mixer_dims(s, rows, param_dtype))
        arrays.update(y=normal((rows, s.d_inner), jnp.float32),  # the mixer step's gated output
                      sum_squares=jnp.abs(normal((rows, parts), jnp.float32, s.d_inner / parts)))
        floor = s.d_inner * s.d_model * itemsize + rows * (s.d_inner * 4 + s.d_model * 2 + parts * 4)
        return (lambda layer, y, weight, norm_weight, sum_squares: decode.norm_project(
            y, weight, norm_weight=norm_weight, layer=layer, dtype=bf16, sum_squares=sum_squares)), arrays, floor
    if case == "head":  # a stack of LAYERS embeddings: every launch reads its own (no two are the same call)
        arrays = dict(x=normal((rows, s.d_model), bf16), residual=normal((rows, s.d_model), jnp.float32),
                      embedding=normal((LAYERS, VOCAB, s.d_model), param_dtype, 0.02),
                      norm_weight=normal((LAYERS, s.d_model), param_dtype, 0.1) + 1)
        floor = VOCAB * s.d_model * itemsize + rows * (s.d_model * 6 + VOCAB * 2)
        return (lambda layer, x, residual, embedding, norm_weight: decode.norm_project(
            x, embedding, norm_weight=norm_weight, residual=residual, residual_dtype=jnp.float32,
            transpose_weight=True, layer=layer, dtype=bf16)[0]), arrays, floor
    conv_shape = (LAYERS, rows, s.conv_dim, 4)
    state_shape = (LAYERS, rows, s.nheads, s.headdim, s.d_state)
    arrays = dict(zxbcdt=normal((rows, s.d_in_proj), bf16), conv_state=normal(conv_shape, param_dtype),
                  ssm_state=normal(state_shape, param_dtype), conv_weight=normal((LAYERS, 4, s.conv_dim), param_dtype),
                  conv_bias=normal((LAYERS, s.conv_dim), param_dtype),
                  A_log=normal((LAYERS, s.nheads), param_dtype), dt_bias=normal((LAYERS, s.nheads), param_dtype) - 3,
                  D=normal((LAYERS, s.nheads), param_dtype))
    state_bytes = rows * s.nheads * s.headdim * s.d_state * itemsize
    floor = 2 * state_bytes + rows * (s.conv_dim * (2 + 8 * itemsize) + s.d_inner * 2)
    return (lambda layer, zxbcdt, conv_state, ssm_state, **params: decode.mixer_step(
        zxbcdt, conv_state, ssm_state, params["conv_weight"], params["conv_bias"], params["A_log"],
        params["dt_bias"], params["D"], nheads=s.nheads, headdim=s.headdim, ngroups=1, dstate=s.d_state,
        xbc_offset=s.d_inner, dt_offset=s.d_inner + s.conv_dim,
        norm_z_offset=0 if rows <= GATED_NORM_IN_MIXER_ROWS else None, layer=layer,
        group_windows_apart=True)), arrays, floor


def _program(fn, case: str):
    """call(arrays) -> outputs: one jitted program launching fn for each of the LAYERS layers; the mixer threads
    its state stacks through the launches and the calls (donated, so that they are updated in place) and writes
    the layers' B and C conv windows at the end, as the LM's token step does."""
    if case != "mixer":
        run = jax.jit(lambda arrays: [fn(layer, **arrays) for layer in range(LAYERS)])
        return run

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def run_mixer(arrays, ssm_state, conv_state):
        outs, windows = [], []
        for layer in range(LAYERS):
            y, ssm_state, conv_state, group_windows, *sum_squares = fn(layer, ssm_state=ssm_state,
                                                                       conv_state=conv_state, **arrays)
            outs.append((y, *sum_squares))
            windows.append(group_windows)
        d_ssm = conv_state.shape[2] - windows[0].shape[1]
        return outs, ssm_state, decode.write_group_windows(conv_state, jnp.stack(windows), d_ssm)

    held = {}

    def call(arrays):
        states = [held.pop(name, arrays[name]) for name in ("ssm_state", "conv_state")]
        outs, held["ssm_state"], held["conv_state"] = run_mixer(
            {k: v for k, v in arrays.items() if k not in ("ssm_state", "conv_state")}, *states)
        return outs
    return call


def measure(case: str, s: Shapes, rows: int, param_dtype, config=None, budget_s: float = 0.5) -> dict:
    """One record: microseconds per launch, the floor and the achieved bandwidth."""
    from jax_mamba2.bridge import decode_ops, ffi
    from jax_mamba2.kernels import decode_mixer, decode_projection

    fn, arrays, floor_bytes = _arrays(case, s, rows, param_dtype, jax.random.key(0))
    record = dict(case=case, d_model=s.d_model, rows=rows, param_dtype=jnp.dtype(param_dtype).name,
                  config=None if config is None else dataclasses.asdict(config),
                  default=config is None, floor_us=floor_bytes / (PEAK_HBM_TBPS * 1e12) * 1e6)
    kernels = backends.registered(decode.OP)["cutile"].kernels
    if config is not None:  # the op's "cutile" backend runs the kernels in this config for the record
        choice = {"mixer_config" if case == "mixer" else "projection_config": lambda dims, c=config: c}
        kernels = decode_ops.make_kernels(ffi.run_plan, **choice)
    with backends.kernels_replaced(decode.OP, "cutile", kernels):
        run = _program(fn, case)
        timing, _ = time_jax(lambda: run(arrays), budget_s, warmup_s=0.5)
        traced = _profile(lambda: run(arrays))
    us = timing.ms_pipelined * 1e3 / LAYERS
    ours = [d for name, _, d in traced if name.startswith(DECODE_KERNELS)]
    kernel_us = sum(ours) / LAYERS if ours else None  # the op's kernels per call: one or two launches
    others = {}
    for name, _, duration in traced:
        if not name.startswith(DECODE_KERNELS):
            others[name[:60]] = others.get(name[:60], 0.0) + duration
    record.update(us_per_launch=us, gbps=floor_bytes / (us * 1e-6) / 1e9, timing=timing._asdict(),
                  kernel_us=kernel_us, kernel_launches=len(ours),
                  kernel_gbps=None if not kernel_us else floor_bytes / (kernel_us * 1e-6) / 1e9,
                  others_us=dict(sorted(others.items(), key=lambda kv: -kv[1])[:8]))
    if config is None:
        record["config"] = dataclasses.asdict(
            decode_mixer.mixer_step_default_config(mixer_dims(s, rows, param_dtype)) if case == "mixer" else
            decode_projection.projection_default_config(projection_dims(case, s, rows, param_dtype)))
    return record


def mixer_dims(s: Shapes, rows: int, param_dtype):
    """The mixer step of the LM of `s` at `rows` rows, its state and parameters in `param_dtype`."""
    from jax_mamba2.kernels.decode_mixer import MixerStepDims
    name = jnp.dtype(param_dtype).name
    return MixerStepDims(rows=rows, nheads=s.nheads, headdim=s.headdim, ngroups=1, dstate=s.d_state,
                         in_width=s.d_in_proj, xbc_offset=s.d_inner, dt_offset=s.d_inner + s.conv_dim,
                         norm_z_offset=0 if rows <= GATED_NORM_IN_MIXER_ROWS else None, layers=LAYERS,
                         conv_state_dtype=name, ssm_state_dtype=name, conv_weight_dtype=name, A_log_dtype=name,
                         dt_bias_dtype=name, D_dtype=name)


def _profile(call) -> list:
    """(name, start_us, duration_us) of the GPU kernels of one call under jax.profiler."""
    import tempfile

    from benchmarks import lm_bench

    with tempfile.TemporaryDirectory(prefix="decode_kernels_trace_") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(call())
        return lm_bench._trace_kernels(trace_dir)


def projection_dims(case: str, s: Shapes, rows: int, param_dtype):
    """in_proj, out_proj or the head (on a stack of LAYERS embeddings) of the LM of `s` at `rows` rows."""
    from jax_mamba2.kernels.decode_projection import ProjectionDims
    name = jnp.dtype(param_dtype).name
    if case == "in_proj":
        return ProjectionDims(rows=rows, features=s.d_model, out_features=s.d_in_proj, layers=LAYERS, has_norm=True,
                              has_residual=True, write_residual=True, residual_dtype="float32",
                              residual_in_dtype="float32", weight_dtype=name, norm_weight_dtype=name)
    if case == "out_proj" and rows > GATED_NORM_IN_MIXER_ROWS:
        return ProjectionDims(rows=rows, features=s.d_inner, out_features=s.d_model, layers=LAYERS, has_norm=True,
                              z_width=s.d_in_proj, weight_dtype=name, norm_weight_dtype=name)
    if case == "out_proj":  # normalizing the mixer step's gated output (float32) from its sums of squares
        from jax_mamba2.kernels.decode_mixer import sum_squares_parts
        return ProjectionDims(rows=rows, features=s.d_inner, out_features=s.d_model, layers=LAYERS, has_norm=True,
                              dtype="float32", weight_dtype=name, norm_weight_dtype=name,
                              norm_parts=sum_squares_parts(mixer_dims(s, rows, param_dtype)))
    return ProjectionDims(rows=rows, features=s.d_model, out_features=VOCAB, layers=LAYERS, has_norm=True,
                          has_residual=True,
                          write_residual=True, residual_dtype="float32", residual_in_dtype="float32",
                          transpose_weight=True, weight_dtype=name, norm_weight_dtype=name)


def _key(record):
    return (record["case"], record["d_model"], record["rows"], record["param_dtype"],
            json.dumps(record["config"], sort_keys=True), record["default"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--param-dtypes", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16"])
    parser.add_argument("--sweep", action="store_true", help="also every config of sweep_configs")
    parser.add_argument("--sweep-cases", nargs="+", choices=CASES, default=["in_proj", "out_proj", "mixer"])
    parser.add_argument("--sweep-batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    exit_unless_cutile_runs("decode_kernels.py")  # it times the kernels' launches (elsewhere XLA's fallback)

    shapes = Shapes(args.d_model)
    records = []
    for case, rows, dtype in itertools.product(args.cases, args.batches, args.param_dtypes):
        configs = [None] + (sweep_configs(case, rows) if args.sweep and case in args.sweep_cases and rows in
                            args.sweep_batches else [])
        for config in configs:
            try:
                record = measure(case, shapes, rows, jnp.dtype(dtype), config)
            except Exception as e:  # a config that does not compile or run: recorded, not fatal
                record = dict(case=case, d_model=shapes.d_model, rows=rows, param_dtype=dtype, default=config is None,
                              config=None if config is None else dataclasses.asdict(config), error=repr(e)[:500])
            record["environment_commit"] = os.environ.get("JAX_MAMBA2_GIT_SHA", "unknown")
            records.append(record)
            print(json.dumps({k: record.get(k) for k in ("case", "rows", "param_dtype", "config", "us_per_launch",
                                                          "kernel_us", "floor_us", "kernel_gbps", "error")}),
                  flush=True)
            _write(args.out, records)  # after every record: a run stopped by a time cap keeps what it measured
    return 0


def _write(out: Path, records: list[dict]) -> None:
    """Merges `records` into <out>/decode_kernels_<gpu>.json (a remeasured record replaces the earlier one)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_kernels_{gpu_slug(environment().get('gpu', 'gpu'))}.json"
    old = json.loads(path.read_text())["records"] if path.exists() else []
    fresh = {_key(r) for r in records}
    merged = [r for r in old if _key(r) not in fresh] + records
    write_json(path, {"benchmark": "decode_kernels", "environment": environment(), "records": merged})


if __name__ == "__main__":
    sys.exit(main())
