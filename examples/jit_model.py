"""A Flax NNX model built from `Mamba2` layers, its jitted training step, and the cuTile kernels in its HLO.

The model (input projection, pre-norm residual `Mamba2` layers, output projection) learns a delayed copy
of its input sequence. The script jits one training step (forward, backward, AdamW update) as a pure
function of the model state, compiles it, and lists every custom call in the compiled HLO: for the
cuTile backend each SSD kernel launch is an XLA custom call ("jax_mamba2_cutile_launch") with its kernel name,
grid, output shapes, the JAX name stack it came from (forward or transposed/backward, which layer),
and the HLO computation that holds it (XLA's command buffers, recorded into CUDA graphs, are computations named
"command_buffer..."). Then it times the step against the same model on the "xla" backend (the chunked SSD in
plain XLA ops).

    python examples/jit_model.py                   # CPU: xla only (the cuTile lowering needs a GPU)
    python examples/jit_model.py --batch 8 --seqlen 4096 --d-model 1024 --layers 4 --d-state 128 \\
        --headdim 64 --chunk-size 128 --dtype bfloat16        # GPU

Writes the compiled HLO of each backend (kernel binaries elided) and timings.json to --out/jit_model/.
"""
from __future__ import annotations

import json
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from _common import (add_common_flags, axis_size, describe_device, make_parser, model_flags, output_dir, positive_int,
                     power_of_two, resolve_backend, settings, time_call, write_atomically)
from jax_mamba2.flax_layers import Mamba2

CUTILE_TARGET = "jax_mamba2_cutile_launch"  # jax_mamba2.bridge.aot.CUTILE_CUSTOM_CALL


class DelayedCopyModel(nnx.Module):
    """(batch, seqlen, features) -> (batch, seqlen, features): n_layers pre-norm residual Mamba2 layers."""

    def __init__(self, features: int, d_model: int, n_layers: int, *, d_state: int, headdim: int,
                 chunk_size: int, backend: str, dtype, rngs: nnx.Rngs):
        self.embed = nnx.Linear(features, d_model, dtype=dtype, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs) for _ in range(n_layers)])
        self.mixers = nnx.List([
            Mamba2(d_model, d_state=d_state, headdim=headdim, chunk_size=chunk_size, backend=backend,
                   dtype=dtype, rngs=rngs)
            for _ in range(n_layers)])
        self.head = nnx.Linear(d_model, features, dtype=dtype, rngs=rngs)

    def __call__(self, inputs):
        hidden = self.embed(inputs)
        for norm, mixer in zip(self.norms, self.mixers):
            hidden = hidden + mixer(norm(hidden))
        return self.head(hidden)


def delayed_copy_batch(key, batch: int, seqlen: int, features: int, delay: int):
    """Inputs ~ N(0, 1) (batch, seqlen, features) and targets = inputs shifted `delay` steps later."""
    inputs = jax.random.normal(key, (batch, seqlen, features), jnp.float32)
    targets = jnp.pad(inputs, ((0, 0), (delay, 0), (0, 0)))[:, :seqlen]
    return inputs, targets


def make_train_step(graphdef):
    """The training step as a pure function of the (model, optimizer) state, jitted."""
    def loss_fn(model, inputs, targets):
        return jnp.mean((model(inputs).astype(jnp.float32) - targets) ** 2)

    @jax.jit
    def train_step(state, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return train_step


# ------------------------------------------------------------------------------------------------
# Reading the compiled HLO
# ------------------------------------------------------------------------------------------------

class CustomCall(NamedTuple):
    target: str       # custom_call_target
    kernel: str       # cuTile kernel symbol ("" for other targets)
    grid: str         # cuTile launch grid "x,y,z" ("" for other targets)
    shapes: str       # result shapes, layouts dropped
    computation: str  # the HLO computation holding the call
    op_name: str      # JAX name stack of the op that produced it


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CUSTOM_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+custom-call\(")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_ELIDE_BINARY = re.compile(r'(cubin_code\s*=\s*)"[^"\\]*(?:\\.[^"\\]*)*"')


def _attribute(line: str, pattern: str) -> str:
    match = re.search(pattern, line)
    return match.group(1) if match else ""


def custom_calls(hlo_text: str) -> tuple[list[CustomCall], set[str]]:
    """Every custom call of an HLO module's text, and the names of computations that are while bodies."""
    calls, while_bodies, computation = [], set(), ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        body = _WHILE_BODY.search(line)
        if body:
            while_bodies.add(body.group(1))
        call = _CUSTOM_CALL.match(line)
        if not call:
            continue
        grid = [_attribute(line, rf"grid_{axis}\s*=\s*(\d+)") for axis in "xyz"]
        calls.append(CustomCall(
            target=_attribute(line, r'custom_call_target="([^"]+)"'),
            kernel=_attribute(line, r'function_name\s*=\s*\\?"([^"\\]+)'),
            grid=",".join(grid) if all(grid) else "",
            shapes=re.sub(r"\{[\d,]*\}", "", call.group(1)),
            computation=computation,
            op_name=_attribute(line, r'op_name="([^"]+)"')))
    return calls, while_bodies


def print_custom_calls(backend: str, hlo_text: str) -> int:
    """Prints where the custom calls sit; returns the number of cuTile kernel launches."""
    calls, while_bodies = custom_calls(hlo_text)
    launches = [c for c in calls if c.target == CUTILE_TARGET]
    others = [c for c in calls if c.target != CUTILE_TARGET]
    recorded = sum(c.computation.startswith("command_buffer") for c in launches)
    print(f"[{backend}] compiled HLO: {len(launches)} cuTile kernel launches ({CUTILE_TARGET!r} custom calls, "
          f"{recorded} of them in XLA command buffers: CUDA graphs), {len(others)} other custom calls")
    for call in calls:
        place = call.computation + (" (a while-loop body)" if call.computation in while_bodies else "")
        place += " (an XLA command buffer)" if call.computation.startswith("command_buffer") else ""
        name = call.kernel or call.target
        grid = f" grid=({call.grid})" if call.grid else ""
        print(f"  {name}{grid} -> {call.shapes[:100]}")
        print(f"      in computation {place}")
        print(f"      from {call.op_name}")
    return len(launches)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--batch", type=axis_size, default=4, help="sequences per step")
    parser.add_argument("--seqlen", type=axis_size, default=512, help="steps per sequence")
    parser.add_argument("--features", type=positive_int, default=16, help="width of the sequence to copy")
    parser.add_argument("--delay", type=int, default=8, help="the copy lag in steps")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width")
    parser.add_argument("--layers", type=positive_int, default=2, help="Mamba2 layers")
    parser.add_argument("--d-state", type=positive_int, default=64, help="SSM state size N")
    parser.add_argument("--headdim", type=positive_int, default=64, help="SSM head size P")
    parser.add_argument("--chunk-size", type=power_of_two, default=128, help="SSD chunk length, a power of two")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="computation dtype")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed steps per backend")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.delay < args.seqlen:
        parser.error(f"--delay={args.delay} must be in [0, --seqlen={args.seqlen})")
    return args


def compile_and_time(args, backend: str, batch, out) -> dict:
    """Builds the model on `backend`, compiles its train step, prints its custom calls, times it."""
    with model_flags("--features", "--d-model", "--layers", "--d-state", "--headdim", "--chunk-size"):
        model = DelayedCopyModel(
            args.features, args.d_model, args.layers, d_state=args.d_state, headdim=args.headdim,
            chunk_size=args.chunk_size, backend=backend, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    train_step = make_train_step(graphdef)

    began = time.perf_counter()
    lowered = train_step.lower(state, *batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    hlo_text = compiled.as_text()
    write_atomically(out / f"{backend}.hlo.txt", _ELIDE_BINARY.sub(r"\1<elided>", hlo_text).encode())
    launches = print_custom_calls(backend, hlo_text)

    losses = []
    for _ in range(3):  # a few real steps: the loss must move
        loss, state = compiled(state, *batch)
        losses.append(float(loss))
    timing = time_call(compiled, state, *batch, repeats=args.repeats)
    print(f"[{backend}] lower {lowered_at - began:.1f} s, compile {compiled_at - lowered_at:.1f} s, "
          f"train step {timing.median_ms:.2f} ms (p20 {timing.p20_ms:.2f}, p80 {timing.p80_ms:.2f}); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"backend": backend, "cutile_launches": launches, "lower_s": lowered_at - began,
            "compile_s": compiled_at - lowered_at, "step_ms": timing._asdict(), "losses": losses}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_dir(args.out / "jit_model")
    print(f"device: {describe_device()}")
    backend = resolve_backend(args.backend)
    batch = delayed_copy_batch(jax.random.PRNGKey(args.seed), args.batch, args.seqlen, args.features, args.delay)

    backends = [backend] if backend == "xla" else [backend, "xla"]
    if backend == "xla":
        print("(the xla backend has no cuTile kernels; on a CUDA GPU, --backend auto shows where they sit)")
    results = [compile_and_time(args, b, batch, out) for b in backends]
    if len(results) == 2:
        speedup = results[1]["step_ms"]["median_ms"] / results[0]["step_ms"]["median_ms"]
        print(f"train step: {backend} is {speedup:.2f}x the speed of xla")
    if backend == "cutile" and results[0]["cutile_launches"] == 0:
        print("FAILED: backend cutile compiled without any cuTile kernel launch")
        return 1
    write_atomically(out / "timings.json", json.dumps({"device": describe_device(), "args": settings(args),
                                                       "results": results}, indent=1).encode())
    print(f"wrote {out}/timings.json and the compiled HLO of {', '.join(backends)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
