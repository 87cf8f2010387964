"""Mamba-2 SSD forward (or forward + backward) benchmark: jax-mamba2's backends against the peers.

Implementations (--impls):
  cutile           ssd(backend="cutile") in jax.jit: each cuTile kernel an XLA FFI custom call
  cutile_callback  ssd(backend="cutile_callback") in jax.jit: one buffer_callback launching the kernels
  xla              ssd(backend="xla") in jax.jit: the chunked algorithm in plain JAX
  mamba_ssm        mamba_ssm's Triton `mamba_chunk_scan_combined` (source tree via --mamba-ssm PATH)
  jla              jax-linear-attention `linear_attention("simple_gla", impl="mosaic_gpu")` (--jla PATH);
                   it has no D or dt input: Δ = softplus(dt + dt_bias) is computed outside the timed
                   forward, v = Δ x and g = Δ A inside, and D x is added only for the accuracy check.

Inputs (bf16, Mamba2-module-like): x, B, C ~ N(0, 1); raw dt ~ N(0, 0.5²) with dt_softplus and
dt_bias = softplus⁻¹(Δ0), Δ0 log-uniform in [1e-3, 1e-1]; A = -U(1, 16) f32; D per head ~ N(0, 1) f32.
Every output is checked against ssd(backend="xla") run in float32 at HIGHEST matmul precision (relative L2
error, max abs error); fwd_bwd checks the gradients of the linear loss sum(y·w_y) + sum(final·w_f).

Timing (compilation, autotuning and the first calls are excluded; the first call's wall time, which
includes them, is recorded as first_call_s; then every implementation runs back to back for
--warmup-seconds, 2 s by default, so that the GPU's clocks are up, see WARMUP_S):
  JAX impls    per-call wall time of fn(*args) + block_until_ready: median, p20, p80; and
               ms_pipelined, the median over 5 rounds of the mean of N back-to-back calls with one
               block_until_ready per round (ms_pipelined_rounds).
  torch peers  CUDA-graph replay after autotuning warm-up, timed with CUDA events: per-replay median,
               p20, p80; ms_pipelined, the median over 5 rounds of the mean of N back-to-back replays.
ms_pipelined is the number to compare across implementations (device time, no per-call host sync);
tflops and gbps are derived from it.

Roofline (`roofline`), per token, from the chunked SSD algorithm with chunk Q (notes mamba2.md §10):
  FLOPs  F_tok = 2·[½·G·Q·N (C·Bᵀ, causal half) + H·P·N (chunk states) + H·P·N (C·h, inter-chunk)
                   + ½·H·Q·P (intra-chunk, causal half)]
         backward (incl. recompute) ≈ 2·[3·½·G·Q·N + 5·H·P·N + 3·½·H·Q·P]
  bytes  fused forward: 2·(H·P [x] + H·P [y] + 2·G·N [B, C] + H [dt]) per token, + 4·H·P·N final
         states per sequence; the backward adds reads of x, dy, B, C, dt and writes of dx, dB, dC, ddt:
         2·(3·H·P + 4·G·N + 2·H) per token.
  floor  max(FLOPs / 790 TFLOP/s (measured bf16 dense on the H200), bytes / 4.8 TB/s (HBM3e)).
These are floors of an ideal fused kernel; ours writes bf16 chunk states and f32 dt/dA_cumsum in between.

Run on the GPU machine (one process; < 8 min for the full forward grid with a warm tuning cache):
  source .gpu/gpu-env.sh
  JAX_MAMBA2_CACHE_DIR=$OUT/tuning python benchmarks/ssd.py --mamba-ssm .peers --jla .peers --out $OUT
Options: --quick (first 2 shapes), --shapes B,L,H,P,N,G ..., --impls ..., --direction fwd|fwd_bwd,
--chunk Q (ours; mamba_ssm always 256, jla 64), --tuning auto|off (off: default configs only).
Writes <out>/ssd_<direction>_<gpu>.json (a list of records), ssd_<direction>_<gpu>.png (a bar panel per
shape) and ssd_<direction>_tuning_<gpu>.json (what the autotuner measured), then prints the table
built from the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_mamba2  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.environment import environment, gpu_slug  # noqa: E402
from jax_mamba2 import op as ssd_op  # noqa: E402

# (batch, seqlen, nheads, headdim, dstate, ngroups)
GRID = (
    (4, 2048, 32, 64, 128, 1),
    (4, 8192, 32, 64, 128, 1),
    (2, 32768, 32, 64, 128, 1),
    (4, 8192, 32, 64, 64, 1),
    (4, 8192, 32, 64, 256, 1),
    (4, 8192, 80, 64, 128, 1),
    (4, 16384, 8, 64, 128, 1),
    (4, 8192, 64, 64, 128, 8),
    (1, 131072, 32, 64, 128, 1),
)
IMPLS = report.OURS + report.PEERS
MAMBA_SSM_CHUNK = 256
JLA_CHUNK = 64  # fixed by its kernels
PEAK_BF16_TFLOPS = 790.0
PEAK_HBM_TBPS = 4.8
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


class Shape(NamedTuple):
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        values = tuple(int(v) for v in text.replace("x", ",").split(","))
        if len(values) != 6:
            raise ValueError(f"ssd benchmark: --shapes {text!r} must be B,L,H,P,N,G")
        return cls(*values)

    def label(self) -> str:
        return "({},{},{},{},{},{})".format(*self)


def roofline(shape: Shape, chunk_size: int = 256, direction: str = "fwd") -> dict:
    """FLOPs, bytes and the time floor of an ideal fused SSD on the H200 (formulas: module docstring).

    Returns:
      {"flops", "bytes", "compute_ms", "memory_ms", "floor_ms", "bound" ("compute"|"memory"),
       "intensity" (FLOP/byte)}.
    """
    b, L, H, P, N, G = shape
    Q = chunk_size
    tokens = b * L
    flops = 2 * (0.5 * G * Q * N + 2 * H * P * N + 0.5 * H * Q * P) * tokens
    nbytes = 2 * (2 * H * P + 2 * G * N + H) * tokens + 4 * b * H * P * N
    if direction == "fwd_bwd":
        flops += 2 * (3 * 0.5 * G * Q * N + 5 * H * P * N + 3 * 0.5 * H * Q * P) * tokens
        nbytes += 2 * (3 * H * P + 4 * G * N + 2 * H) * tokens
    compute_ms = flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3
    memory_ms = nbytes / (PEAK_HBM_TBPS * 1e12) * 1e3
    return {"flops": flops, "bytes": nbytes, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms),
            "bound": "compute" if compute_ms >= memory_ms else "memory",
            "intensity": flops / nbytes}


# ----------------------------------------------------------------------------------------------
# Inputs and reference
# ----------------------------------------------------------------------------------------------

def make_inputs(shape: Shape, seed: int = 0) -> dict[str, jax.Array]:
    """x, dt, A, B, C, D, dt_bias on the default device (see the module docstring)."""
    b, L, H, P, N, G = shape
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    dt0 = jnp.exp(jax.random.uniform(k[2], (H,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    inputs = {
        "x": jax.random.normal(k[0], (b, L, H, P), jnp.float32).astype(jnp.bfloat16),
        "dt": (0.5 * jax.random.normal(k[1], (b, L, H), jnp.float32)).astype(jnp.bfloat16),
        "A": -jax.random.uniform(k[3], (H,), jnp.float32, 1.0, 16.0),
        "B": jax.random.normal(k[4], (b, L, G, N), jnp.float32).astype(jnp.bfloat16),
        "C": jax.random.normal(k[5], (b, L, G, N), jnp.float32).astype(jnp.bfloat16),
        "D": jax.random.normal(k[6], (H,), jnp.float32),
        "dt_bias": dt0 + jnp.log(-jnp.expm1(-dt0)),  # softplus⁻¹(Δ0), as mamba_ssm initialises it
    }
    return jax.block_until_ready(inputs)


def loss_weights(shape: Shape, seed: int = 1) -> dict[str, jax.Array]:
    """Fixed cotangents of the linear loss sum(y·w_y) + sum(final·w_f): w_y in y's dtype (bf16), so that
    the loss reads as few bytes as y itself and its gradient w.r.t. y is w_y unchanged; with an f32 w_y
    the loss's reduction and the cast of the cotangent took 0.19 of the 1.71 ms program at
    (4,8192,32,64,128,1) (JAX profiler trace, H200), time every implementation paid alike."""
    b, L, H, P, N, _ = shape
    ky, kf = jax.random.split(jax.random.PRNGKey(seed))
    return {"y": jax.random.normal(ky, (b, L, H, P), jnp.float32).astype(jnp.bfloat16),
            "final": jax.random.normal(kf, (b, H, P, N), jnp.float32)}


def _ssd_call(backend: str, chunk_size: int, save_chunk_states: bool = True, check_finite: bool = True):
    def call(x, dt, A, B, C, D, dt_bias):
        return jax_mamba2.ssd(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                              return_final_states=True, backend=backend, save_chunk_states=save_chunk_states,
                              check_finite=check_finite)
    return call


def _linear_loss(forward):
    """loss(args, weights): the linear loss of forward(*args). The weights are an argument, not a
    closure: closed over, they become constants of the compiled program, which XLA then spends minutes
    constant-folding through the xla path's reshapes (seen at (4,16384,8,64,128,1))."""
    def loss(args, weights):
        y, final = forward(*args)
        return (jnp.sum(y.astype(jnp.float32) * weights["y"].astype(jnp.float32))
                + jnp.sum(final * weights["final"]))
    return loss


def forward_backward(forward):
    """The timed forward+backward program (args, weights) -> (loss, gradients w.r.t. the 7 args).

    `jax.grad` alone would let XLA drop the forward: the gradients of a linear loss do not depend on y,
    and the custom VJPs save only the inputs, so the forward's kernels are dead code."""
    return jax.value_and_grad(_linear_loss(forward))


def _ordered(inputs: dict) -> tuple:
    return tuple(inputs[n] for n in GRAD_NAMES)


def reference_outputs(inputs: dict, weights: dict, chunk_size: int, direction: str) -> dict:
    """Outputs of ssd(backend="xla") in float32 at HIGHEST precision: y, final_states (+ grads)."""
    args = tuple(a.astype(jnp.float32) for a in _ordered(inputs))
    forward = _ssd_call("xla", chunk_size)
    with jax.default_matmul_precision("highest"):
        if direction == "fwd":
            y, final = jax.jit(forward)(*args)
            return jax.block_until_ready({"y": y, "final_states": final})
        grads = jax.jit(jax.grad(_linear_loss(forward)))(args, weights)
        return jax.block_until_ready(dict(zip((f"d{n}" for n in GRAD_NAMES), grads)))


@jax.jit
def _errors(actual, expected):
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    diff = actual - expected
    return jnp.linalg.norm(diff.ravel()) / jnp.linalg.norm(expected.ravel()), jnp.max(jnp.abs(diff))


def compare(outputs: dict, reference: dict) -> dict[str, dict[str, float]]:
    """{name: {"rel_l2", "max_abs"}} for every reference output the implementation returned."""
    result = {}
    for name, expected in reference.items():
        if name in outputs:
            rel, mx = _errors(jnp.asarray(outputs[name]), expected)
            result[name] = {"rel_l2": float(rel), "max_abs": float(mx)}
    return result


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

class Timing(NamedTuple):
    ms_median: float
    ms_p20: float
    ms_p80: float
    ms_pipelined: float
    ms_pipelined_rounds: tuple[float, ...]
    iters: int
    first_call_s: float
    warmup_s: float


# Every implementation runs back to back for this long before its timed calls. The H200's SM clock idles at
# 345 MHz (1980 under load): a program timed right after its compilation had left the GPU idle for seconds
# ran 7-12x slower for its first ~800 back-to-back calls (0.5-1.2 s), then at full speed
# (docs/experiments.md, "Measuring").
WARMUP_S = 2.0
# The pipelined time is the median of this many rounds of back-to-back calls.
PIPELINED_ROUNDS = 5
# Calls issued between synchronisations while warming up (JAX queues at most 32 executions in flight).
_WARMUP_BATCH = 16


def _iterations(seconds_per_call: float, budget_s: float) -> int:
    return int(min(200, max(5, budget_s / max(seconds_per_call, 1e-6))))


def warm_up(call: Callable[[], Any], sync: Callable[[Any], Any], seconds: float) -> float:
    """Runs `call` back to back, synchronising after every _WARMUP_BATCH calls, for at least `seconds`;
    returns the wall seconds per call of the last batch."""
    start = time.perf_counter()
    while True:
        batch_start = time.perf_counter()
        sync([call() for _ in range(_WARMUP_BATCH)])
        now = time.perf_counter()
        if now - start >= seconds:
            return (now - batch_start) / _WARMUP_BATCH


def _summary(samples_ms: list[float], rounds_ms: list[float], first_call_s: float, warmup_s: float) -> Timing:
    q = np.percentile(samples_ms, [20, 50, 80])
    return Timing(float(q[1]), float(q[0]), float(q[2]), float(np.median(rounds_ms)), tuple(rounds_ms),
                  len(samples_ms), first_call_s, warmup_s)


def time_jax(fn: Callable[[], Any], budget_s: float, warmup_s: float = WARMUP_S) -> tuple[Timing, Any]:
    """After `warmup_s` of back-to-back calls: per-call block_until_ready times, and the pipelined time (the
    median over PIPELINED_ROUNDS rounds of the mean of back-to-back calls, one block_until_ready per round);
    returns (timing, last outputs)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())  # compiles (and autotunes)
    first_call_s = time.perf_counter() - start
    seconds_per_call = warm_up(fn, jax.block_until_ready, warmup_s)
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    iters = _iterations(time.perf_counter() - start, budget_s)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    rounds = []
    calls = _iterations(seconds_per_call, budget_s / PIPELINED_ROUNDS)
    for _ in range(PIPELINED_ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) * 1e3 / calls)
    return _summary(samples, rounds, first_call_s, warmup_s), out


def raise_gpu_clocks(torch) -> None:
    """Thirty bf16 products of 8192 x 8192 on torch's current device, so that the first timing after it does not
    start at the idle clocks (WARMUP_S says why)."""
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(30):
        warm @ warm
    torch.cuda.synchronize()


def time_cuda_graph(fn: Callable[[], Any], budget_s: float, warmup_s: float = WARMUP_S) -> tuple[Timing, Any]:
    """CUDA-graph replay of a torch callable after warm-up (which runs Triton's autotuning) and `warmup_s`
    of back-to-back replays, timed with CUDA events: per-replay times, and the pipelined time (the median
    over PIPELINED_ROUNDS rounds of the mean of back-to-back replays)."""
    import torch

    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    # thread_local: JAX's own threads may touch CUDA while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    seconds_per_replay = warm_up(graph.replay, lambda _: torch.cuda.synchronize(), warmup_s)
    iters = _iterations(seconds_per_replay, budget_s)
    calls = _iterations(seconds_per_replay, budget_s / PIPELINED_ROUNDS)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters + PIPELINED_ROUNDS)]
    for begin, end in events[:iters]:
        begin.record()
        graph.replay()
        end.record()
    for begin, end in events[iters:]:
        begin.record()
        for _ in range(calls):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [b.elapsed_time(e) for b, e in events[:iters]]
    rounds = [b.elapsed_time(e) / calls for b, e in events[iters:]]
    return _summary(samples, rounds, first_call_s, warmup_s), out


def time_plan(ct, plan, tensors: dict, reps: int, budget_s: float, warmup_s: float) -> dict:
    """GPU microseconds of a kernel plan outside JAX (`ct.launch` on the torch tensors `tensors` names): "plan_us"
    for all its launches and, for a plan of several, "<kernel>_us" for each alone, each the median replay of a
    CUDA graph of `reps` back-to-back runs (`time_cuda_graph`) over `reps`; "<kernel>_grid" each launch's grid."""
    import torch

    from jax_mamba2.kernels._common import kernel_name

    launches = [(launch, tuple(tensors[a] if isinstance(a, str) else a for a in launch.args))
                for launch in plan.launches]

    def graph_us(launch_all) -> float:
        timing, _ = time_cuda_graph(lambda: [launch_all(torch.cuda.current_stream()) for _ in range(reps)],
                                    budget_s, warmup_s=warmup_s)
        return timing.ms_median * 1e3 / reps

    def run_all(stream):
        for launch, args in launches:
            ct.launch(stream, launch.grid, launch.kernel, args)

    out = {"plan_us": graph_us(run_all)}
    for launch, args in launches:
        name = kernel_name(launch.kernel)
        out[f"{name}_grid"] = list(launch.grid)
        if len(launches) > 1:
            out[f"{name}_us"] = graph_us(
                lambda stream, launch=launch, args=args: ct.launch(stream, launch.grid, launch.kernel, args))
    return out


def timed_record(record: dict, measure: Callable[[], dict]) -> dict:
    """`record` updated with what `measure()` returns (e.g. `time_plan`'s times), or with the error it raised: a
    config that fails to compile or launch is a record too; printed as one JSON line and returned."""
    try:
        record.update(measure())
    except Exception as exc:  # noqa: BLE001 - the record says what failed
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(json.dumps(record), flush=True)
    return record


# ----------------------------------------------------------------------------------------------
# Implementations: each returns (run, timer, to_outputs, chunk_size, extra record fields)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prepared:
    run: Callable[[], Any]
    timer: Callable[[Callable[[], Any], float], tuple[Timing, Any]]
    timing: str
    to_outputs: Callable[[Any], dict]  # raw outputs -> {name: JAX array} named like the reference
    chunk_size: int
    notes: str = ""
    residual_bytes: Optional[Callable[[], int]] = None  # bytes a forward keeps for its backward (jax.vjp)


def _grad_outputs(grads) -> dict:
    return {f"d{n}": g for n, g in zip(GRAD_NAMES, grads)}


def residual_bytes(forward, args) -> int:
    """Bytes of the arrays jax.vjp keeps from `forward(*args)` for the backward (inputs included)."""
    _, vjp = jax.vjp(forward, *args)
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(vjp) if hasattr(leaf, "nbytes"))


def prepare_ours(backend: str, inputs: dict, weights: dict, chunk_size: int, direction: str,
                 save_chunk_states: bool = True):
    args = _ordered(inputs)
    forward = _ssd_call(backend, chunk_size, save_chunk_states)
    if direction == "fwd":
        fn = jax.jit(forward)
        run = lambda: fn(*args)  # noqa: E731
        to_outputs = lambda out: {"y": out[0], "final_states": out[1]}  # noqa: E731
    else:
        fn = jax.jit(forward_backward(forward))
        run = lambda: fn(args, weights)  # noqa: E731
        to_outputs = lambda out: _grad_outputs(out[1])  # noqa: E731
    if backend.startswith("cutile"):
        from jax_mamba2.bridge import problem
        chunk_size = problem.KERNEL_CHUNK_SIZE   # what the kernels run at, whatever chunk_size was asked for
    return Prepared(run, time_jax, "block_until_ready", to_outputs, chunk_size,
                    residual_bytes=None if direction == "fwd" else lambda: residual_bytes(forward, args))


def prepare_mamba_ssm(inputs: dict, weights: dict, chunk_size: int, direction: str):
    del chunk_size  # mamba_ssm runs at its own default chunk
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    t = {n: torch.from_dlpack(a) for n, a in inputs.items()}
    w = {n: torch.from_dlpack(a) for n, a in weights.items()}

    def forward(x, dt, A, B, C, D, dt_bias):
        return mamba_chunk_scan_combined(x, dt, A, B, C, MAMBA_SSM_CHUNK, D=D, dt_bias=dt_bias,
                                         dt_softplus=True, return_final_states=True)

    def from_torch(tensors):
        return {name: jax.dlpack.from_dlpack(tensor.detach().contiguous()) for name, tensor in tensors}

    if direction == "fwd":
        args = [t[n] for n in GRAD_NAMES]
        run = lambda: forward(*args)  # noqa: E731
        to_outputs = lambda out: from_torch([("y", out[0]), ("final_states", out[1])])  # noqa: E731
    else:
        leaves = [t[n].detach().clone().requires_grad_() for n in GRAD_NAMES]

        def run():
            y, final = forward(*leaves)
            loss = (y.float() * w["y"].float()).sum() + (final * w["final"]).sum()
            return torch.autograd.grad(loss, leaves)

        to_outputs = lambda grads: from_torch(  # noqa: E731
            [(f"d{n}", g) for n, g in zip(GRAD_NAMES, grads)])
    return Prepared(run, time_cuda_graph, "cuda_graph", to_outputs, MAMBA_SSM_CHUNK)


def prepare_jla(inputs: dict, weights: dict, chunk_size: int, direction: str):
    del chunk_size
    from jla.ops import linear_attention

    def core(x, delta, A, B, C):
        o, final = linear_attention("simple_gla", C, B, (delta[..., None] * x).astype(jnp.bfloat16),
                                    g=delta * A, impl="mosaic_gpu", scale=1.0,
                                    output_final_state=True)
        return o, jnp.swapaxes(final, -1, -2)  # (b, H, N, P) -> (b, H, P, N)

    def softplus_dt(dt, dt_bias):
        return jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)

    x, dt, A, B, C, D, dt_bias = _ordered(inputs)
    if direction == "fwd":
        delta = jax.block_until_ready(softplus_dt(dt, dt_bias))
        fn = jax.jit(core)

        def to_outputs(out):
            o, final = out
            return {"y": o.astype(jnp.float32) + D[:, None] * x.astype(jnp.float32),
                    "final_states": final}
        return Prepared(lambda: fn(x, delta, A, B, C), time_jax, "block_until_ready", to_outputs,
                        JLA_CHUNK, notes="timed without the D skip and without softplus(dt + dt_bias)")

    def forward(x, dt, A, B, C, D, dt_bias):
        o, final = core(x, softplus_dt(dt, dt_bias), A, B, C)
        return o.astype(jnp.float32) + D[:, None] * x.astype(jnp.float32), final

    fn = jax.jit(forward_backward(forward))
    args = _ordered(inputs)
    return Prepared(lambda: fn(args, weights), time_jax, "block_until_ready", lambda out: _grad_outputs(out[1]),
                    JLA_CHUNK, notes="D skip and dt softplus in plain JAX around the kernels")


def prepare(impl: str, inputs: dict, weights: dict, chunk_size: int, direction: str,
            save_chunk_states: bool = True) -> Prepared:
    if impl in report.OURS:
        return prepare_ours(impl, inputs, weights, chunk_size, direction, save_chunk_states)
    if impl == "mamba_ssm":
        return prepare_mamba_ssm(inputs, weights, chunk_size, direction)
    return prepare_jla(inputs, weights, chunk_size, direction)


def tune_report(dims) -> dict[str, dict]:
    """What the cutile forward runs for `dims` (kernels.SSDDims) and what was measured, per stage of its
    layout (JSON-ready): "key", "source" ("tuned", "disk" or "default"), "reason" (for defaults), "config"
    (field dict) and, for tuned or cached choices, the cache entry's "mean_us", "default_mean_us",
    "measured" (every config's mean/error in us), "failures" and "tuning_s"."""
    from jax_mamba2.bridge.tuning import layout_choice, timing

    _, choices = layout_choice.forward_choices(dims)
    return {stage: {"key": choice.key, "source": choice.source, "reason": choice.reason, **(choice.entry or {}),
                    "config": timing.config_fields(choice.config)}
            for stage, choice in choices.items()}


def forward_layout_times(dims) -> dict[str, Optional[float]]:
    """What the forward's layout choice compares: per layout that can run `dims`, the summed measured time
    of its stages' chosen configs (us), None where a stage has no measurement (tuning off or no GPU)."""
    from jax_mamba2.bridge.tuning import layout_choice

    return {layout: layout_choice.plan_us(choices) for layout, choices in layout_choice.layout_choices(dims).items()}


def tuning_summary(inputs: dict, chunk_size: int) -> tuple[dict, dict]:
    """(compact per-stage summary for the record, full tune report) of the cutile forward configs, each
    with "layout_us": the summed stage times (us) of every forward layout the tuner compared."""
    from jax_mamba2.bridge import problem

    ssd_inputs = ssd_op.SSDInputs(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                                  inputs["D"], None, inputs["dt_bias"], None, None)
    static = ssd_op.SSDStatic(chunk_size, True, (0.0, math.inf))
    dims = problem.kernel_dims(ssd_inputs, static)
    full = tune_report(dims)
    compact = {stage: {k: r.get(k) for k in ("source", "reason", "config", "mean_us", "default_mean_us")}
               for stage, r in full.items()}
    layouts = forward_layout_times(dims)
    return {**compact, "layout_us": layouts}, {**full, "layout_us": layouts}


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def measure(impl: str, shape: Shape, inputs: dict, weights: dict, reference: dict, args,
            env: dict) -> tuple[dict, Optional[dict]]:
    """One record (and for cutile impls the full tune report); errors become a record's "error"."""
    record = {"op": "ssd", "direction": args.direction, "impl": impl, "shape": shape._asdict(),
              "dtype": "bfloat16", "chunk_size": None, "error": None, **env}
    tune_full = None
    try:
        prepared = prepare(impl, inputs, weights, args.chunk, args.direction, not args.recompute_chunk_states)
        record["chunk_size"] = prepared.chunk_size
        timing, out = prepared.timer(prepared.run, args.seconds_per_impl, args.warmup_seconds)
        errors = compare(prepared.to_outputs(out), reference)
        if impl in ("cutile", "cutile_callback"):
            record["tuning"], tune_full = tuning_summary(inputs, prepared.chunk_size)
        if prepared.residual_bytes is not None:
            record["residual_bytes"] = prepared.residual_bytes()
            if impl in ("cutile", "cutile_callback"):
                # What the differentiated forward kept (ssd's save_chunk_states).
                record["saved_for_backward"] = "inputs" if args.recompute_chunk_states else "inputs+states"
    except Exception as e:  # noqa: BLE001  one failing impl must not end the run
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        return record, None
    line = roofline(shape, prepared.chunk_size, args.direction)
    main = "y" if args.direction == "fwd" else "dx"
    record.update(
        timing._asdict(), timing=prepared.timing, notes=prepared.notes, errors=errors,
        rel_l2_err=max(e["rel_l2"] for e in errors.values()) if errors else None,
        max_abs_err=errors.get(main, {}).get("max_abs"),
        roofline=line,
        tflops=line["flops"] / (timing.ms_pipelined * 1e-3) / 1e12,
        gbps=line["bytes"] / (timing.ms_pipelined * 1e-3) / 1e9,
    )
    return record, tune_full


def _peer_unavailable_reason(impl: str) -> Optional[str]:
    module = {"mamba_ssm": "mamba_ssm.ops.triton.ssd_combined", "jla": "jla.ops"}.get(impl)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001  any import failure means: not runnable here
        return f"cannot import {module}: {type(e).__name__}: {e}"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", nargs="+", type=Shape.parse, help="B,L,H,P,N,G (default: GRID)")
    parser.add_argument("--quick", action="store_true", help="only the first 2 grid shapes")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--direction", choices=("fwd", "fwd_bwd"), default="fwd")
    parser.add_argument("--chunk", type=int, default=64, help="chunk size of our backends")
    parser.add_argument("--recompute-chunk-states", action="store_true",
                        help="ssd(save_chunk_states=False): the cutile backward recomputes the chunk states")
    parser.add_argument("--tuning", choices=("auto", "off"), default="auto",
                        help="auto: autotune on first use (JAX_MAMBA2_AUTOTUNE=1); off: default kernel configs (no "
                             "autotuning, an empty cache)")
    parser.add_argument("--mamba-ssm", type=Path, help="directory holding the mamba_ssm package")
    parser.add_argument("--jla", type=Path, help="directory holding the jla package")
    parser.add_argument("--seconds-per-impl", type=float, default=0.3,
                        help="timed seconds per implementation and shape (each of the two loops)")
    parser.add_argument("--warmup-seconds", type=float, default=WARMUP_S,
                        help="back-to-back calls before the timed ones, per implementation and shape")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.shapes = [Shape(*s) for s in GRID[:2 if args.quick else None]] if not args.shapes else args.shapes
    return args


def _free_torch_memory() -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    # Read once, at the first kernel config lookup: set before any.
    os.environ["JAX_MAMBA2_AUTOTUNE"] = "0" if args.tuning == "off" else "1"
    if args.tuning == "off":
        os.environ["JAX_MAMBA2_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_mamba2_no_tuning_")
    for path in (args.mamba_ssm, args.jla):
        if path is not None:
            sys.path.insert(0, str(path.resolve()))
    env = environment()
    skipped = {impl: _peer_unavailable_reason(impl) for impl in args.impls}
    for impl, reason in skipped.items():
        if reason:
            print(f"[skip] {impl}: {reason}")
    impls = [impl for impl in args.impls if not skipped[impl]]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ssd_{args.direction}_{gpu_slug(env['gpu'])}"
    records, tune_reports = [], []
    started = time.perf_counter()
    path = args.out / f"{stem}.json"
    for shape in args.shapes:
        inputs, weights = make_inputs(shape), loss_weights(shape)
        reference = reference_outputs(inputs, weights, args.chunk, args.direction)
        line = roofline(shape, args.chunk, args.direction)
        print(f"\n{shape.label()}  floor {line['floor_ms']:.3f} ms ({line['bound']}-bound, "
              f"{line['flops'] / 1e9:.1f} GFLOP, {line['bytes'] / 1e6:.1f} MB)", flush=True)
        for impl in impls:
            record, tune_full = measure(impl, shape, inputs, weights, reference, args, env)
            records.append(record)
            if tune_full is not None:
                tune_reports.append({"impl": impl, "shape": shape._asdict(), "report": tune_full})
            print("  " + report.format_record_line(record), flush=True)
        report.write_records(records, path)  # after every shape: a cut-short run keeps what it measured
        del inputs, weights, reference
        _free_torch_memory()
    report.write_records(tune_reports,
                         args.out / f"ssd_{args.direction}_tuning_{gpu_slug(env['gpu'])}.json")
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)\n")
    loaded = report.load_records(path)
    print(report.format_table(loaded))
    print(f"\nplot: {report.plot_records(loaded, args.out / f'{stem}.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
