"""The LM training step on a device mesh: one device, data-parallel, head-parallel (`shard_model`).

The step: `Mamba2LMHeadModel` (tied embeddings, d_state 128, headdim 64, expand 2, ngroups 1, chunk 256,
vocab 50280 by default), float32 parameters and bfloat16 compute, next-token cross-entropy, the gradients and
one optax AdamW update, under jax.jit with parameters and optimizer state donated. Meshes (--mesh, any of):

  data=1    one device, the model as is (no mesh): the baseline
  data=2    batch rows over 2 devices, each with --batch rows (the same per-device batch as data=1)
  model=2   heads over 2 devices (shard_model), --batch rows in all (the same global batch as data=1)
  data=2,model=2 and other sizes likewise: data x --batch rows in all.

Configs (--configs): d{d_model}-l{n_layer}, default the mamba2-370m width at 24 layers (d1024-l24) and the
mamba2-780m width (d1536-l48). Tokens are arithmetic progressions modulo the vocabulary, a random start and a
stride of 1 or 2 per row, which the model starts to learn within a few steps, so the first --loss-steps losses
follow the training and not just the initialization.

Per (config, mesh), in its own process (so the allocator's peak is that run's): the compile time, the losses
of the first --loss-steps steps, then untimed steps for --warmup-seconds, then --steps steps each synchronised:
median / p20 / p80 ms per step and tokens/s from the median; peak memory per device (memory_stats()'s
peak_bytes_in_use) and XLA's memory_analysis; the collectives of the compiled step (benchmarks/hlo_collectives.py:
per kind, instructions, executions per step and bytes per step; every all-gather whose array has the
batch x seqlen extent of a device or of the mesh is listed as an activation all-gather).

The record file (--out, merged with its earlier records by (config, mesh, global batch, seqlen, dtype,
backend)) also holds the comparisons: tokens/s of each mesh over data=1's at the same per-device batch
(data=1's global batch = the mesh's global batch / data), against the targets (data=2: 1.85x, model=2:
1.6x); and the largest relative difference of its losses from those of data=1 at the same global batch
(for data=2 that is a data=1 run at twice --batch), against the bf16 tolerance.

On two GPUs (each line < 10 minutes; JAX_MAMBA2_GIT_SHA=<commit> when the tree has no .git):
  python benchmarks/lm_train_mesh.py --configs d1024-l24 --mesh data=1 data=2 model=2 --out OUT.json
  python benchmarks/lm_train_mesh.py --configs d1024-l24 --mesh data=1 --batch 16 --out OUT.json
  python benchmarks/lm_train_mesh.py --configs d1536-l48 --mesh data=1 data=2 model=2 --out OUT.json
  python benchmarks/lm_train_mesh.py --configs d1536-l48 --mesh data=1 --batch 16 --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import hlo_collectives  # noqa: E402
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, shard_model  # noqa: E402

CONFIGS = ("d1024-l24", "d1536-l48")
SPEEDUP_TARGETS = {"data": 1.85, "model": 1.6}  # over one device, for a mesh along that axis only
# The losses of a mesh agree with one device's to within one rounding of the computation dtype (bf16: 2^-8):
# the sharded step sums partial products across devices in that dtype where one device accumulates them in
# f32 inside one matrix product, and splits reductions (gradients, norms, softmax) differently.
LOSS_RTOL_BF16 = 2.0 ** -8
LOSS_RTOL_F32 = 1e-5
ADAMW = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


class MeshShape(NamedTuple):
    data: int
    model: int

    @property
    def name(self) -> str:
        parts = [f"{axis}={size}" for axis, size in zip(self._fields, self) if size > 1]
        return ",".join(parts) or "data=1"

    @property
    def devices(self) -> int:
        return self.data * self.model

    @classmethod
    def parse(cls, text: str) -> "MeshShape":
        """From "data=2", "model=2", "data=2,model=2" (an axis left out has size 1)."""
        sizes = {"data": 1, "model": 1}
        for part in text.split(","):
            match = re.fullmatch(r"(data|model)=([1-9]\d*)", part.strip())
            if not match:
                raise ValueError(f"lm_train_mesh: mesh {text!r} must be like data=2, model=2 or data=2,model=2")
            sizes[match[1]] = int(match[2])
        return cls(sizes["data"], sizes["model"])


def parse_config(name: str) -> tuple[int, int]:
    """(d_model, n_layer) of a config name d{d_model}-l{n_layer}."""
    match = re.fullmatch(r"d(\d+)-l(\d+)", name)
    if not match:
        raise ValueError(f"lm_train_mesh: config {name!r} must be d<d_model>-l<n_layer>, e.g. d1024-l24")
    return int(match[1]), int(match[2])


def model_config(name: str, *, d_state: int = 128, headdim: int = 64, expand: int = 2, ngroups: int = 1,
                 chunk_size: int = 256, vocab_size: int = 50280) -> Mamba2Config:
    d_model, n_layer = parse_config(name)
    return Mamba2Config(d_model=d_model, n_layer=n_layer, vocab_size=vocab_size, pad_vocab_size_multiple=8,
                        tie_embeddings=True, ssm_cfg=dict(d_state=d_state, headdim=headdim, expand=expand,
                                                          ngroups=ngroups, chunk_size=chunk_size))


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------

def next_token_loss(model: Mamba2LMHeadModel, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy (float32) of predicting tokens[:, 1:] from tokens[:, :-1]; tokens (batch, seqlen+1).

    The padding columns of the logits are masked rather than sliced off: under head parallelism the logits
    are split over the vocabulary, and a slice that ends inside a device's block would be resharded."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # (batch, seqlen, padded_vocab)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < model.config.vocab_size, logits, -jnp.inf)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class Trainer(NamedTuple):
    """A compiled training step and the state it runs on.

    step(params, opt_state, tokens) -> (params, opt_state, loss); params and opt_state are donated.
    """

    step: jax.stages.Compiled
    params: nnx.State
    opt_state: optax.OptState
    mesh: jax.sharding.Mesh | None
    batch_sharding: jax.sharding.Sharding | None
    compiler_options: dict  # what XLA compiled the step with: the model's, then the caller's

    def put(self, tokens: np.ndarray) -> jax.Array:
        """A host batch on the devices, rows split over the data axis."""
        return jnp.asarray(tokens) if self.batch_sharding is None else jax.device_put(tokens, self.batch_sharding)


def build_trainer(config: Mamba2Config, mesh_shape: MeshShape | None, *, global_batch: int, seqlen: int,
                  dtype=jnp.bfloat16, backend: str = "auto", lr: float = 1e-3, remat: bool = False,
                  seed: int = 0, compiler_options: dict | None = None) -> Trainer:
    """Builds the model (float32 parameters, `dtype` computation), places it on the first devices as
    `mesh_shape` says (None or data=1,model=1: one device, no mesh), and compiles the AdamW step for
    (global_batch, seqlen + 1) int32 tokens with the model's compiler options (`compiler_options()`), updated
    with `compiler_options`."""
    model = Mamba2LMHeadModel(config, backend=backend, remat=remat, dtype=dtype, param_dtype=jnp.float32,
                              rngs=nnx.Rngs(seed))
    mesh = batch_sharding = None
    if mesh_shape is not None and mesh_shape.devices > 1:
        if global_batch % mesh_shape.data:
            raise ValueError(f"lm_train_mesh: global batch {global_batch} must be divisible by data={mesh_shape.data}")
        mesh = jax.make_mesh(tuple(mesh_shape), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                             devices=jax.devices()[:mesh_shape.devices])
        shard_model(model, mesh)
        batch_sharding = NamedSharding(mesh, P("data"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(lr, **ADAMW)
    opt_state = jax.jit(tx.init)(params)  # the moments take the parameters' shardings

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jax.ShapeDtypeStruct((global_batch, seqlen + 1), jnp.int32, sharding=batch_sharding)
    options = {**model.compiler_options(), **(compiler_options or {})}
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile(options)
    return Trainer(compiled, params, opt_state, mesh, batch_sharding, options)


def progression_batches(count: int, global_batch: int, seqlen: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """(count, global_batch, seqlen + 1) int32: row r of batch k is (start + stride * t) mod vocab_size with
    a random start and a stride of 1 or 2 per row (the next token follows from the last two). The same seed
    and sizes give the same batches whatever the mesh."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab_size, size=(count, global_batch, 1))
    stride = rng.integers(1, 3, size=(count, global_batch, 1))
    return ((start + stride * np.arange(seqlen + 1)) % vocab_size).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

def measure(job: dict) -> dict:
    """Compiles, trains and times one (config, mesh); the record's fields are described in the docstring."""
    from benchmarks.environment import environment

    mesh_shape = MeshShape.parse(job["mesh"])
    if mesh_shape.devices > len(jax.devices()):
        raise ValueError(f"lm_train_mesh: mesh {mesh_shape.name} needs {mesh_shape.devices} devices; "
                         f"{len(jax.devices())} visible")
    config = model_config(job["config"], **job["shape"])
    global_batch, seqlen = job["batch"] * mesh_shape.data, job["seqlen"]
    dtype = jnp.dtype(job["dtype"])
    began = time.perf_counter()
    trainer = build_trainer(config, mesh_shape, global_batch=global_batch, seqlen=seqlen, dtype=dtype,
                            backend=job["backend"], lr=job["lr"], remat=job["remat"],
                            compiler_options=job.get("compiler_options"))
    compile_s = time.perf_counter() - began
    batches = [trainer.put(b) for b in progression_batches(job["loss_steps"], global_batch, seqlen,
                                                           config.vocab_size)]
    state = [trainer.params, trainer.opt_state]
    calls = [0]

    def call():
        state[0], state[1], loss = trainer.step(state[0], state[1], batches[calls[0] % len(batches)])
        calls[0] += 1
        return loss

    losses = [float(call()) for _ in range(job["loss_steps"])]
    timing = time_steps(call, steps=job["steps"], warmup_seconds=job["warmup_seconds"])
    devices = list(trainer.mesh.devices.flat) if trainer.mesh is not None else jax.devices()[:1]
    found = hlo_collectives.collectives(trainer.step.as_text())
    tokens = global_batch * seqlen
    memory = trainer.step.memory_analysis()
    return {
        "config": job["config"], "mesh": job["mesh"], "mesh_shape": mesh_shape._asdict(),
        "shape": {"d_model": config.d_model, "n_layer": config.n_layer, "vocab_size": config.vocab_size,
                  "padded_vocab_size": config.padded_vocab_size, "expand": 2, **job["shape"]},
        "batch_per_device": job["batch"], "global_batch": global_batch, "seqlen": seqlen, "tokens_per_step": tokens,
        "dtype": dtype.name, "param_dtype": "float32", "backend": job["backend"], "remat": job["remat"],
        "optimizer": {"name": "adamw", "lr": job["lr"], **ADAMW},
        "compiler_options": trainer.compiler_options, "compile_s": compile_s, "losses": losses, "timing": timing,
        "tokens_per_s": tokens / (timing["ms_median"] * 1e-3),
        "peak_memory_bytes": [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices],
        "memory_analysis": None if memory is None else {
            k: getattr(memory, k, None) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                  "alias_size_in_bytes", "temp_size_in_bytes")},
        "collectives": {
            "totals": hlo_collectives.totals(found),
            "activation_all_gathers": [c.describe() for c in hlo_collectives.with_extent(
                found, tokens // mesh_shape.data, tokens, kind="all-gather")],
            "instructions": [c.to_json() for c in found]},
        "devices": [d.device_kind for d in devices],
        "environment": environment(),
    }


def time_steps(call, *, steps: int, warmup_seconds: float) -> dict:
    """Untimed calls for warmup_seconds, then `steps` synchronised calls: ms median / p20 / p80."""
    began = time.perf_counter()
    warmup_steps = 0
    while time.perf_counter() - began < warmup_seconds:
        jax.block_until_ready(call())
        warmup_steps += 1
    warmup_s = time.perf_counter() - began
    ms = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        ms.append((time.perf_counter() - start) * 1e3)
    return {"ms_median": float(np.median(ms)), "ms_p20": float(np.percentile(ms, 20)),
            "ms_p80": float(np.percentile(ms, 80)), "steps": steps, "warmup_steps": warmup_steps,
            "warmup_s": warmup_s}


# ----------------------------------------------------------------------------------------------
# Records and comparisons
# ----------------------------------------------------------------------------------------------

def record_key(record: dict) -> tuple:
    return (record["config"], record["mesh"], record["global_batch"], record["seqlen"], record["dtype"],
            record["backend"])


def comparisons(records: list[dict]) -> list[dict]:
    """For every mesh of more than one device: its speed-up over data=1 at the same per-device batch and its
    losses against data=1's at the same global batch (None where that data=1 record is missing)."""
    ok = [r for r in records if not r.get("error")]

    def one_device(record, global_batch):
        same = ("config", "seqlen", "dtype", "backend")
        return next((r for r in ok if r["mesh"] == "data=1" and r["global_batch"] == global_batch
                     and all(r[k] == record[k] for k in same)), None)

    out = []
    for r in ok:
        shape = MeshShape(**r["mesh_shape"])
        if shape.devices == 1:
            continue
        speed_base = one_device(r, r["batch_per_device"])
        loss_base = one_device(r, r["global_batch"])
        axis = "data" if shape.model == 1 else "model" if shape.data == 1 else None
        speedup = speed_base and r["tokens_per_s"] / speed_base["tokens_per_s"]
        rtol = LOSS_RTOL_BF16 if r["dtype"] == "bfloat16" else LOSS_RTOL_F32
        loss_gap = loss_base and max_relative_gap(loss_base["losses"], r["losses"])
        out.append({
            "config": r["config"], "mesh": r["mesh"], "global_batch": r["global_batch"], "seqlen": r["seqlen"],
            "dtype": r["dtype"], "backend": r["backend"],
            "speedup": speedup, "speedup_target": SPEEDUP_TARGETS.get(axis),
            "speedup_met": None if speedup is None or axis is None else speedup >= SPEEDUP_TARGETS[axis],
            "loss_max_rel_diff": loss_gap, "loss_rtol": rtol,
            "loss_within_rtol": None if loss_gap is None else loss_gap <= rtol,
            "activation_all_gathers": len(r["collectives"]["activation_all_gathers"]),
        })
    return out


def max_relative_gap(reference: list[float], other: list[float]) -> float:
    steps = min(len(reference), len(other))
    return max(abs(o - e) / abs(e) for e, o in zip(reference[:steps], other[:steps]))


def merge_records(path: Path, new: list[dict]) -> dict:
    """The file's records with `new` replacing those of the same key, and the comparisons of them all;
    written atomically."""
    old = json.loads(path.read_text())["records"] if path.is_file() else []
    keys = {record_key(r) for r in new if not r.get("error")}
    records = [r for r in old if record_key(r) not in keys] + new
    result = {"benchmark": "lm_train_mesh", "records": records, "comparisons": comparisons(records)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(result, f, indent=1)
    os.replace(f.name, path)
    return result


def format_table(result: dict) -> str:
    rows = [("config", "mesh", "batch", "step ms (p20-p80)", "tokens/s", "peak GiB/device", "act. all-gathers",
             "loss 1st -> last")]
    for r in result["records"]:
        if r.get("error"):
            rows.append((r["config"], r["mesh"], "-", "-", "-", "-", "-", r["error"].splitlines()[-1][:60]))
            continue
        t = r["timing"]
        peaks = [p for p in r["peak_memory_bytes"] if p is not None]
        rows.append((r["config"], r["mesh"], f"{r['global_batch']}x{r['seqlen']}",
                     f"{t['ms_median']:.1f} ({t['ms_p20']:.1f}-{t['ms_p80']:.1f})", f"{r['tokens_per_s']:.0f}",
                     f"{max(peaks) / 2 ** 30:.2f}" if peaks else "-",
                     str(len(r["collectives"]["activation_all_gathers"])),
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"))
    for c in result["comparisons"]:
        speed = "-" if c["speedup"] is None else f"{c['speedup']:.2f}x (target {c['speedup_target']})"
        loss = "-" if c["loss_max_rel_diff"] is None else f"{c['loss_max_rel_diff']:.2e} (rtol {c['loss_rtol']})"
        rows.append((c["config"], c["mesh"], "vs data=1", f"speed-up {speed}", "", "", "", f"losses {loss}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def run_isolated(job: dict, timeout_s: float) -> dict:
    """`measure(job)` in a fresh Python process (the allocator's peak is then this job's alone)."""
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**_job_fields(job), "error": f"timed out after {timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {**_job_fields(job), "error": (done.stderr or done.stdout).strip()[-2000:] or f"rc {done.returncode}"}
    return json.loads(lines[-1])


def _job_fields(job: dict) -> dict:
    mesh_shape = MeshShape.parse(job["mesh"])
    return {"config": job["config"], "mesh": job["mesh"], "mesh_shape": mesh_shape._asdict(),
            "batch_per_device": job["batch"], "global_batch": job["batch"] * mesh_shape.data,
            "seqlen": job["seqlen"], "dtype": job["dtype"], "backend": job["backend"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        help=f"d<d_model>-l<n_layer> names (default: {' '.join(CONFIGS)})")
    parser.add_argument("--mesh", nargs="+", default=["data=1", "data=2", "model=2"],
                        help="meshes, e.g. data=1 data=2 model=2 data=2,model=2 (default: data=1 data=2 model=2)")
    parser.add_argument("--batch", type=int, default=8, help="rows per data shard (default: 8)")
    parser.add_argument("--seqlen", type=int, default=2048, help="tokens per row (default: 2048)")
    parser.add_argument("--d-state", type=int, default=128, help="SSM state size (default: 128)")
    parser.add_argument("--headdim", type=int, default=64, help="head size (default: 64)")
    parser.add_argument("--ngroups", type=int, default=1, help="groups of B/C (default: 1)")
    parser.add_argument("--chunk-size", type=int, default=256, help="SSD chunk (default: 256)")
    parser.add_argument("--vocab", type=int, default=50280, help="vocabulary (default: 50280)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="computation dtype; parameters are float32 (default: bfloat16)")
    parser.add_argument("--backend", default="auto", help="SSD backend (default: auto)")
    parser.add_argument("--remat", action="store_true", help="rematerialize each block in the backward pass")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--loss-steps", type=int, default=20, help="steps whose losses are kept (default: 20)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--warmup-seconds", type=float, default=5.0,
                        help="untimed steps after the loss steps (default: 5 s)")
    parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option for the step's compilation, on top of the model's own "
                             "(Mamba2LMHeadModel.compiler_options), e.g. xla_backend_optimization_level=0 for a "
                             "quick CPU check (repeatable)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process (peak memory then spans every job)")
    parser.add_argument("--worker-timeout", type=float, default=540, help="seconds per process (default: 540)")
    parser.add_argument("--out", type=Path, required=True, help="record file (JSON), merged with earlier runs")
    args = parser.parse_args(argv)
    try:
        for name in args.configs:
            parse_config(name)
        for mesh in args.mesh:
            MeshShape.parse(mesh)
    except ValueError as e:
        parser.error(str(e))
    for name in ("batch", "seqlen", "loss_steps", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    options = {}
    for option in args.compiler_option:
        name, sep, value = option.partition("=")
        if not sep or not name:
            parser.error(f"--compiler-option {option!r} must be NAME=VALUE")
        options[name] = int(value) if value.lstrip("-").isdigit() else value
    args.compiler_options = options or None
    return args


def jobs(args) -> list[dict]:
    shape = dict(d_state=args.d_state, headdim=args.headdim, ngroups=args.ngroups, chunk_size=args.chunk_size,
                 vocab_size=args.vocab)
    return [{"config": config, "mesh": MeshShape.parse(mesh).name, "shape": shape, "batch": args.batch,
             "seqlen": args.seqlen, "dtype": args.dtype, "backend": args.backend, "remat": args.remat,
             "lr": args.lr, "loss_steps": args.loss_steps, "steps": args.steps,
             "warmup_seconds": args.warmup_seconds, "compiler_options": args.compiler_options}
            for config in args.configs for mesh in args.mesh]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(measure(json.loads(argv[1]))))
        return 0
    args = parse_args(argv)
    records = []
    for job in jobs(args):
        print(f"{job['config']} {job['mesh']} ...", flush=True)
        records.append(measure(job) if args.in_process else run_isolated(job, args.worker_timeout))
        result = merge_records(args.out, records)
    print(f"\nwrote {args.out}\n\n{format_table(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
