"""Generation speed: ms per token step and tokens/s of ours against mamba_ssm's step under a CUDA graph and
against the memory floor, and prefill on its own; one process per measurement.

Models (--configs): d1024-l24 (the training benchmark's LM: d_model 1024, 24 layers, vocab 50280) and the
mamba2-370m, -780m and -1.3b presets (48 layers, vocab 50288), random weights; d_state 128, headdim 64.
Parameters (--param-dtypes) float32 or bfloat16, computation in bfloat16 either way: float32 parameters are
converted inside every step (what a model built with float32 parameters does), bfloat16 ones were converted
once (`cast_params`). The decode state is allocated in the parameters' dtype, as mamba_ssm does.

Implementations (--impls):
  cutile, cutile_callback, xla
               jax-mamba2's `generate` (one jitted program: prefill, then a lax.scan of cached steps) on that
               backend (cutile_callback: the same kernels launched from buffer_callbacks, the token step's
               all from one that replays a CUDA graph of programmatic dependent launches). The
               step time is the difference of generate with 1 and with 1 + --decode-steps new tokens (the
               prefill and the first token cancel), divided by --decode-steps. --command-buffers runs each
               of them with XLA's command buffers (CUDA graphs) as XLA defaults them ("default"), off
               ("off": --xla_gpu_enable_command_buffer=), extended to the decode loop itself ("loop":
               +WHILE,+CONDITIONAL, --xla_gpu_graph_min_graph_size=1) or as XLA defaults them but with every
               custom call (ours) launched from the host ("host_custom_calls": -CUSTOM_CALL), each in its own
               process.
  mamba_ssm    mamba_ssm's `Mamba2.step` for every layer (`allocate_inference_cache`, with causal_conv1d's
               update kernel when --causal-conv1d is given) in a PyTorch LM of the same shape
               (benchmarks/torch_lm.py), one token step with its greedy argmax captured once in a
               torch.cuda.CUDAGraph and replayed (what mamba_ssm's own generation does), timed with CUDA
               events over rounds of --decode-steps replays. float32 parameters run under
               torch.autocast(bfloat16) (cache off, so the cast is captured in the graph).
--sampling (ours): the next-token rule of `generate`, "greedy" (default: argmax, as the peer's step), or with
HF's sampling controls, to time what they add per token: "top-k" (temperature 1, top_k 50), "top-p" (temperature
1, top_p 0.9: a sort of the vocabulary per token), "penalty" (greedy with repetition_penalty 1.2).
--cache-dtypes (ours): `generate`'s cache_dtype, the decode state's dtype: "default" (mamba_ssm's, the parameters'
dtype, as the peer's), or bfloat16 / float32 (bfloat16 under float32 parameters halves the bytes a token step
moves from a few dozen rows on).
Per batch in --batches (default 1 8 64 256): the median ms per token step over --repeats rounds after
--warmup-seconds of untimed rounds, tokens/s = batch / step time, and which step ours ran ("fused": the decode
ops, on one device; "composed" otherwise).
Floor: the weights' bytes (and, as a second figure, plus the decode state read and written once) over the
HBM bandwidth of a 1 GiB device-to-device copy measured in the same process.
Prefill (--prompt-lengths, default 512 2048, batch 1): ours `generate(prompt, 1)`, mamba_ssm the forward that
fills the cache and takes the last token's logits (mamba_ssm's prefill), median wall ms.
--profile (ours): per batch, one call each of generate with 1 and with 1 + --decode-steps new tokens under
jax.profiler; their difference over --decode-steps is a token step's GPU time and launches per kernel category
(benchmarks/kernel_categories.py: matrix products, SSD, conv, norms, copies, elementwise), under "profile".

On the GPU machine (each line < 10 minutes; add JAX_MAMBA2_GIT_SHA=<commit>):
  source .gpu/gpu-env.sh
  JAX_MAMBA2_AUTOTUNE=0 python benchmarks/lm_decode.py --configs d1024-l24 --mamba-ssm .peers --out $OUT
  JAX_MAMBA2_AUTOTUNE=0 python benchmarks/lm_decode.py --configs mamba2-370m --mamba-ssm .peers --out $OUT
  JAX_MAMBA2_AUTOTUNE=0 python benchmarks/lm_decode.py --configs d1024-l24 --impls cutile --command-buffers off loop \\
      --out $OUT
Writes <out>/lm_decode_<gpu>.json (<gpu>: the GPU's model, "h200", "h100"; "cpu" without one; records merged by
`record_key` with earlier runs of the same file: a record of the same commit gains the new batches, one of another
commit is replaced) and lm_decode_<gpu>.png, then prints the table.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lm_bench  # noqa: E402

IMPLS = ("cutile", "cutile_callback", "xla", "mamba_ssm")
OURS = ("cutile", "cutile_callback", "xla")
PRESETS = ("mamba2-370m", "mamba2-780m", "mamba2-1.3b")
DEFAULT_CONFIGS = ("d1024-l24", *PRESETS)
PROMPT_TOKENS = 16  # the prompt before the timed decode steps
# generate's controls per --sampling name (an rng is added where they sample).
SAMPLING = {"greedy": {}, "top-k": {"temperature": 1.0, "top_k": 50}, "top-p": {"temperature": 1.0, "top_p": 0.9},
            "penalty": {"repetition_penalty": 1.2}}
PROFILE_TOP_KERNELS = 40  # a token step's kernels listed by time in --profile's record (about 18 per layer)
COMMAND_BUFFER_FLAGS = lm_bench.COMMAND_BUFFER_FLAGS
LABELS = {"cutile": "jax-mamba2 generate, cuTile", "cutile_callback": "jax-mamba2 generate, cuTile from "
          "buffer_callbacks (the token step one, replaying a CUDA graph)", "xla": "jax-mamba2 generate, XLA",
          "mamba_ssm": "mamba_ssm Mamba2.step, CUDA graph (PyTorch)"}


def lm_config(name: str):
    """The `Mamba2Config` of a config name: a preset, or d{width}-l{layers} (vocab 50280, mixer defaults)."""
    from jax_mamba2 import flax_layers

    presets = {"mamba2-370m": flax_layers.mamba2_370m, "mamba2-780m": flax_layers.mamba2_780m,
               "mamba2-1.3b": flax_layers.mamba2_1_3b}
    if name in presets:
        return presets[name]()
    match = re.fullmatch(r"d(\d+)-l(\d+)", name)
    if not match:
        raise ValueError(f"lm_decode: config {name!r} must be one of {PRESETS} or d<width>-l<layers>")
    return flax_layers.Mamba2Config(d_model=int(match.group(1)), n_layer=int(match.group(2)), vocab_size=50280,
                                    pad_vocab_size_multiple=8)


def floors(weight_bytes: int, state_bytes_per_row: int, batch: int, copy_gbps: float) -> dict:
    """ms per token step when only the weights (and also the decode state, read and written) move once."""
    to_ms = 1e3 / (copy_gbps * 1e9)
    return {"weights_ms": weight_bytes * to_ms,
            "weights_and_state_ms": (weight_bytes + 2 * batch * state_bytes_per_row) * to_ms}


# ----------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------

def mixer_heads_kernels(heads: int):
    """The decode ops' kernels (FFI launches) with `heads` heads per mixer-step block from 64 rows on, the default
    tiles otherwise (`decode_ops.make_kernels`)."""
    import dataclasses

    from jax_mamba2.bridge import decode_ops, ffi
    from jax_mamba2.kernels import decode_mixer

    def mixer_config(dims):
        default = decode_mixer.mixer_step_default_config(dims)
        return dataclasses.replace(default, HEADS=heads) if dims.rows >= 64 else default

    return decode_ops.make_kernels(ffi.run_plan, mixer_config=mixer_config)


def ours_model(job: dict):
    import jax.numpy as jnp
    from flax import nnx

    from jax_mamba2.flax_layers import Mamba2LMHeadModel, cast_params

    model = Mamba2LMHeadModel(lm_config(job["config"]), backend=job["impl"], dtype=jnp.bfloat16,
                              param_dtype=jnp.float32, scan_layers=job.get("scan_layers", True), rngs=nnx.Rngs(0))
    return cast_params(model, jnp.bfloat16) if job["param_dtype"] == "bfloat16" else model


def _controls(job: dict) -> dict:
    """generate's keyword arguments for the job's --sampling."""
    import jax

    controls = dict(SAMPLING[job.get("sampling", "greedy")])
    if job.get("cache_dtype"):
        controls["cache_dtype"] = job["cache_dtype"]
    return {**controls, "rng": jax.random.key(0)} if controls.get("temperature") else controls


def _timed_generate(model, prompt, new_tokens: int, repeats: int, warmup_seconds: float,
                    controls: dict) -> tuple[float, float]:
    """(first call s, median wall ms of generate(..., **controls) after warm-up)."""
    import jax

    from jax_mamba2.flax_layers import generate

    timing = lm_bench.time_calls(lambda: generate(model, prompt, new_tokens, **controls), jax.block_until_ready,
                                 steps=repeats, warmup_seconds=warmup_seconds)
    return timing.first_call_s, timing.ms_median


def per_token_profile(short: dict, long: dict, decode_steps: int) -> dict:
    """A token step's share of two profiles (`lm_bench.profile_calls`) of generate with 1 and with
    1 + decode_steps new tokens: per category microseconds and launches, their difference over decode_steps
    (the prompt's prefill and the first token cancel), the same of the GPU's idle time between launches. The
    long call's top kernels and gaps come along as they are."""
    def per_step(field: str, category: str) -> float:
        return (long["categories"].get(category, {}).get(field, 0.0)
                - short["categories"].get(category, {}).get(field, 0.0)) / decode_steps
    categories = {c: {"us": per_step("us", c), "launches": per_step("launches", c)} for c in long["categories"]}
    return {"source": long["source"], "decode_steps": decode_steps,
            "busy_us": (long["busy_us"] - short["busy_us"]) / decode_steps,
            "kernel_launches": (long["kernel_launches"] - short["kernel_launches"]) / decode_steps,
            "idle_us": (long["idle_us"] - short["idle_us"]) / decode_steps,
            "categories": categories, "top_kernels_long_call": long["top_kernels"],
            "top_gaps_long_call": long["top_gaps"]}


def _compiled_generate(model, prompt, new_tokens: int, controls: dict):
    """generate(model, prompt, new_tokens, **controls) compiled as a program of the model's state and the prompt
    (for its HLO text), and that state."""
    import jax
    from flax import nnx

    from jax_mamba2.flax_layers import generate

    graphdef, state = nnx.split(model)
    program = jax.jit(lambda state, prompt: generate(nnx.merge(graphdef, state), prompt, new_tokens, **controls))
    return program.lower(state, prompt).compile(), state


def _profile_generate(model, prompt, decode_steps: int, controls: dict) -> dict:
    """`per_token_profile` of generate on `prompt`, each length compiled as its own program for its HLO text."""
    import jax

    profiles = []
    for new_tokens in (1, 1 + decode_steps):
        compiled, state = _compiled_generate(model, prompt, new_tokens, controls)
        jax.block_until_ready(compiled(state, prompt))  # warm: the profile holds the steady state only
        profiles.append(lm_bench.profile_calls(lambda: compiled(state, prompt), compiled.as_text(), calls=1,
                                              top=PROFILE_TOP_KERNELS))
    return per_token_profile(*profiles, decode_steps)


def _decode_batch(model, prompt, job: dict, controls: dict) -> dict:
    """A batch's row: generate with 1 and 1 + decode_steps new tokens timed, the step time their difference."""
    first_s, short_ms = _timed_generate(model, prompt, 1, job["repeats"], job["warmup_seconds"], controls)
    _, long_ms = _timed_generate(model, prompt, 1 + job["decode_steps"], job["repeats"], job["warmup_seconds"],
                                 controls)
    step_ms = (long_ms - short_ms) / job["decode_steps"]
    row = {"generate_1_ms": short_ms, "generate_long_ms": long_ms, "first_call_s": first_s}
    if step_ms > 0:
        row.update(ms_per_token=step_ms, tokens_per_s=prompt.shape[0] / step_ms * 1e3)
    else:  # the decode steps took less than the timing noise of the prefill: no step time to report
        row.update(ms_per_token=None, tokens_per_s=None,
                   error="the decode steps are within the prefill's timing noise: raise --decode-steps")
    if job.get("profile"):
        row["profile"] = _profile_generate(model, prompt, job["decode_steps"], controls)
    return row


def decode_ours(job: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.environment import environment

    model = ours_model(job)
    decode_step = "fused" if model.layers.mixer.decodes_fused() else "composed"
    vocab = model.config.vocab_size
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.init_cache(1, job.get("cache_dtype"))))
    batches, controls = {}, _controls(job)
    for batch in job["batches"]:
        prompt = jax.random.randint(jax.random.key(batch), (batch, PROMPT_TOKENS), 0, vocab, jnp.int32)
        try:
            batches[str(batch)] = {"step": decode_step, **_decode_batch(model, prompt, job, controls)}
        except Exception as e:  # e.g. out of memory at the largest batch: the other batches' rows stay
            batches[str(batch)] = {"step": decode_step, "ms_per_token": None, "tokens_per_s": None,
                                   "error": f"{type(e).__name__}: {e}"[:1000]}
    prefill = {}
    for length in job["prompt_lengths"]:
        prompt = jax.random.randint(jax.random.key(length), (1, length), 0, vocab, jnp.int32)
        _, prefill[str(length)] = _timed_generate(model, prompt, 1, job["repeats"], job["warmup_seconds"], controls)
    return {"batches": batches, "prefill_ms": prefill, "weight_bytes": weight_bytes, "decode_step": decode_step,
            "state_bytes_per_row": state_bytes, "peak_memory_bytes": lm_bench.jax_peak_bytes(),
            "environment": environment(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


# ----------------------------------------------------------------------------------------------
# PyTorch
# ----------------------------------------------------------------------------------------------

def _autocast(device, dtype):
    """torch.autocast to `dtype` (None: a no-op context). Its weight cache is off: a CUDA graph must
    capture the casts (and a cache would outlive the capture)."""
    import contextlib

    import torch
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False) if dtype else contextlib.nullcontext()


def _torch_step_call(model, batch: int, device, autocast_dtype):
    """A callable running one greedy token step of `model` for `batch` rows (the next token fed back), as a
    replayed CUDA graph on a GPU, eagerly elsewhere."""
    import torch

    caches = model.allocate_inference_cache(batch)
    ids = torch.zeros(batch, dtype=torch.long, device=device)

    def step():
        with _autocast(device, autocast_dtype):
            logits = model.step(ids, caches)
        ids.copy_(logits.argmax(-1))

    if device.type != "cuda":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # Triton's autotuning and compilation, before the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


def decode_torch_model(job: dict, model, device) -> dict:
    """The peer's measurements for `model` (a benchmarks/torch_lm.TorchLM) on `device`."""
    import torch

    from benchmarks import torch_lm

    cuda = device.type == "cuda"
    autocast_dtype = torch.bfloat16 if job["param_dtype"] == "float32" else None
    if job["param_dtype"] == "bfloat16":
        model = model.to(torch.bfloat16)
    vocab = model.embedding.num_embeddings
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for cache in model.allocate_inference_cache(1) for t in cache)
    sync = (lambda _: torch.cuda.synchronize()) if cuda else (lambda _: None)
    steps = job["decode_steps"]
    batches = {}
    with torch.inference_mode():
        for batch in job["batches"]:
            replay = _torch_step_call(model, batch, device, autocast_dtype)

            def round_of_steps():
                for _ in range(steps):
                    replay()

            timing = lm_bench.time_calls(round_of_steps, sync, steps=job["repeats"],
                                         warmup_seconds=job["warmup_seconds"])
            batches[str(batch)] = {"ms_per_token": timing.ms_median / steps,
                                   "tokens_per_s": batch / timing.ms_median * steps * 1e3,
                                   "first_call_s": timing.first_call_s}
        prefill = {}
        for length in job["prompt_lengths"]:
            ids = torch.randint(0, vocab, (1, length), device=device)

            def prefill_call():
                with _autocast(device, autocast_dtype):
                    cache = torch_lm.PrefillCache(max_seqlen=length, max_batch_size=1)
                    return model(ids, inference_params=cache, last_only=True).argmax(-1)

            prefill[str(length)] = lm_bench.time_calls(prefill_call, sync, steps=job["repeats"],
                                                       warmup_seconds=job["warmup_seconds"]).ms_median
    return {"batches": batches, "prefill_ms": prefill, "weight_bytes": weight_bytes,
            "state_bytes_per_row": state_bytes,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "environment": {"device": torch.cuda.get_device_name() if cuda else str(device),
                            "torch": torch.__version__, "git_sha": lm_bench.git_sha()}}


def decode_mamba_ssm(job: dict) -> dict:
    import torch

    from benchmarks import torch_lm

    lm_bench.add_peer_paths(job.get("mamba_ssm"), job.get("causal_conv1d"))
    reason = lm_bench.mamba_ssm_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    config, device = lm_config(job["config"]), torch.device("cuda")
    options = config.mixer_options
    parts = torch_lm.mamba_ssm_parts(config.d_model, d_state=options["d_state"], headdim=options["headdim"],
                                     expand=options["expand"], chunk_size=options["chunk_size"],
                                     use_mem_eff_path=False, device=device)
    torch.manual_seed(0)
    model = torch_lm.TorchLM(d_model=config.d_model, n_layer=config.n_layer,
                             vocab_size=config.padded_vocab_size, **parts).to(device)
    return {**decode_torch_model(job, model, device), "causal_conv1d": lm_bench.causal_conv1d_version()}


def work(job: dict) -> dict:
    if job["impl"] not in OURS:
        return decode_mamba_ssm(job)
    if job.get("mixer_heads") is None:
        return decode_ours(job)
    from jax_mamba2 import backends, decode

    with backends.kernels_replaced(decode.OP, "cutile", mixer_heads_kernels(job["mixer_heads"])):
        return decode_ours(job)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def derive(record: dict) -> dict:
    """Adds the floors per batch and the label."""
    record = {**record, "label": label(record)}
    rates = record.get("device_rates")
    if record.get("error") or not rates:
        return record
    for batch, row in record["batches"].items():
        row["floor"] = floors(record["weight_bytes"], record["state_bytes_per_row"], int(batch), rates["copy_gbps"])
        row["x_weights_floor"] = (row["ms_per_token"] / row["floor"]["weights_ms"]
                                  if row["ms_per_token"] is not None else None)
    return record


def label(record: dict) -> str:
    text = f"{LABELS[record['impl']]}, {record['param_dtype']} params"
    if record["impl"] in OURS:
        layers = ", layers unrolled" if record.get("scan_layers") is False else ""
        flags = f", XLA_FLAGS={user_xla_flags(record)}" if user_xla_flags(record) else ""
        fused = record.get("fused_decode_min_batch")  # records of a fused step that ran from some batch on
        step = f", fused step from batch {fused}" if fused is not None else (
            ", fused step" if record.get("decode_step") == "fused" else "")
        sampling = record.get("sampling", "greedy")
        sampled = f", {sampling}" if sampling != "greedy" else ""
        heads = record.get("mixer_heads")
        mixer = f", {heads} heads per mixer block from 64 rows" if heads is not None else ""
        state = f", {record['cache_dtype']} decode state" if record.get("cache_dtype") else ""
        return f"{text}, command buffers {record['command_buffers']}{layers}{flags}{step}{sampled}{mixer}{state}"
    conv = record.get("causal_conv1d")
    return f"{text}, {'causal_conv1d ' + conv if conv else 'no causal_conv1d'}"


def format_table(records: list[dict]) -> str:
    rows = [("config", "implementation", "batch", "ms/token", "tokens/s", "x floor(weights)", "prefill ms")]
    for r in records:
        if r.get("error"):
            rows.append((r["config"], r["label"], "-", "-", "-", "-", str(r["error"]).splitlines()[0][:70]))
            continue
        prefill = ", ".join(f"{k}: {v:.1f}" for k, v in r["prefill_ms"].items())
        for i, (batch, row) in enumerate(r["batches"].items()):
            rows.append((r["config"], r["label"], batch, _fmt(row["ms_per_token"], ".3f"),
                         _fmt(row["tokens_per_s"], ",.0f"), _fmt(row.get("x_weights_floor"), ".1f"),
                         row["error"].splitlines()[0][:70] if row.get("error") else prefill if i == 0 else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    for r in records:
        for batch, row in ({} if r.get("error") else r["batches"]).items():
            profile = row.get("profile")
            if profile:
                parts = ", ".join(f"{c} {v['us']:.1f} ({v['launches']:.0f})" for c, v in profile["categories"].items())
                idle = f"{profile['idle_us']:.1f} idle, " if "idle_us" in profile else ""  # older records: none
                lines.append(f"{r['config']} {r['label']}, batch {batch}: GPU us per token step by category "
                             f"(launches): {profile['busy_us']:.1f} busy, {idle}{profile['kernel_launches']:.0f} "
                             f"launches; {parts}")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(records: list[dict], path: Path) -> Path | None:
    """A panel per config: tokens/s against batch (log-log), a line per implementation and parameter dtype: its
    latest record, preferring greedy ones with the layer scan, no XLA flags of the user's and command buffers as
    XLA defaults them (each preference before the next); the weights floor of each parameter dtype dashed. None
    (no figure) where every record failed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def preference(r):
        return (r.get("sampling", "greedy") == "greedy", r.get("scan_layers") is not False, not user_xla_flags(r),
                r.get("command_buffers") in (None, "default"), r.get("environment", {}).get("date", ""))
    latest = {}
    for r in sorted((r for r in records if not r.get("error")), key=preference):
        latest[r["config"], r["impl"], r["param_dtype"]] = r
    records = list(latest.values())
    configs = list(dict.fromkeys(r["config"] for r in records))
    if not configs:
        return None
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.6), squeeze=False)
    for ax, config in zip(axes[0], configs):
        floors_drawn = set()
        for r in (r for r in records if r["config"] == config):
            batches = sorted(r["batches"], key=int)
            timed = [b for b in batches if r["batches"][b]["tokens_per_s"] is not None]
            ax.plot([int(b) for b in timed], [r["batches"][b]["tokens_per_s"] for b in timed], "o-",
                    label=r["label"], lw=1.2, ms=4)
            if r["param_dtype"] not in floors_drawn and "floor" in r["batches"][batches[0]]:
                floors_drawn.add(r["param_dtype"])
                ax.plot([int(b) for b in batches],
                        [int(b) / r["batches"][b]["floor"]["weights_ms"] * 1e3 for b in batches], "k--", lw=0.8,
                        alpha=0.5 if r["param_dtype"] == "float32" else 0.9,
                        label=f"floor: {r['param_dtype']} weights read once")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s (higher is better)")
        ax.set_title(config, fontsize=10)
        ax.legend(fontsize=6)
    return lm_bench.save_figure(fig, path, "Mamba-2 decoding, one token step per row, bf16 compute", records)


def parse_args(argv=None):
    parser = lm_bench.make_parser(__doc__)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        help=f"{', '.join(DEFAULT_CONFIGS)} or d<width>-l<layers> (default: all four)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["cutile", "mamba_ssm"],
                        help="default: cutile mamba_ssm")
    parser.add_argument("--param-dtypes", nargs="+", choices=("float32", "bfloat16"),
                        default=["float32", "bfloat16"])
    parser.add_argument("--command-buffers", nargs="+", choices=tuple(COMMAND_BUFFER_FLAGS), default=["default"],
                        help="ours: XLA command buffers per process (default: default)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="ours: Mamba2LMHeadModel(scan_layers=False), the blocks unrolled (default: one scan)")
    parser.add_argument("--sampling", nargs="+", choices=tuple(SAMPLING), default=["greedy"],
                        help="ours' next-token rules (default: greedy)")
    parser.add_argument("--cache-dtypes", nargs="+", choices=("default", "bfloat16", "float32"), default=["default"],
                        help="ours: generate's cache_dtype, one process each (default: default, the parameters')")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--prompt-lengths", nargs="*", type=int, default=[512, 2048])
    parser.add_argument("--decode-steps", type=int, default=128, help="timed token steps per round (default: 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--warmup-seconds", type=float, default=2.0, help="untimed rounds first (default: 2 s)")
    parser.add_argument("--mixer-heads", nargs="+", type=int, default=[None],
                        help="ours, cutile: heads per mixer-step block from 64 rows on, one process each (default: the "
                             "kernels' default config)")
    parser.add_argument("--profile", action="store_true",
                        help="ours: a token step's GPU time per kernel category, from jax.profiler (default: off)")
    lm_bench.add_peer_flags(parser)
    parser.add_argument("--worker-timeout", type=float, default=540, help="seconds per process (default: 540)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    for name in args.configs:
        if name not in PRESETS and not re.fullmatch(r"d\d+-l\d+", name):
            parser.error(f"--configs {name!r}: one of {PRESETS} or d<width>-l<layers>")
    if min(args.batches) < 1 or args.decode_steps < 1 or args.repeats < 1:
        parser.error("--batches, --decode-steps and --repeats must be >= 1")
    return args


def jobs(args) -> list[tuple[dict, dict]]:
    """(job, extra environment) per process."""
    common = {"batches": args.batches, "prompt_lengths": args.prompt_lengths, "decode_steps": args.decode_steps,
              "repeats": args.repeats, "warmup_seconds": args.warmup_seconds}
    peers = lm_bench.peer_paths(args)
    out = []
    for config in args.configs:
        for param_dtype in args.param_dtypes:
            for impl in args.impls:
                if impl not in OURS:
                    out.append(({**common, **peers, "config": config, "impl": impl, "param_dtype": param_dtype,
                                 "command_buffers": None}, {}))
                    continue
                for buffers, sampling, heads, cache in itertools.product(
                        args.command_buffers, args.sampling, args.mixer_heads if impl == "cutile" else [None],
                        args.cache_dtypes):
                    out.append(({**common, "config": config, "impl": impl, "param_dtype": param_dtype,
                                 "command_buffers": buffers, "scan_layers": not args.unroll_layers,
                                 "profile": args.profile, "sampling": sampling,
                                 **({} if heads is None else {"mixer_heads": heads}),
                                 **({} if cache == "default" else {"cache_dtype": cache})},
                                lm_bench.command_buffer_env(buffers)))
    return out


def user_xla_flags(record: dict) -> str:
    """The XLA flags a record ran under beyond those of its command-buffer setting (which this benchmark sets)."""
    own = set(COMMAND_BUFFER_FLAGS[record.get("command_buffers") or "default"].split())
    return " ".join(f for f in record.get("xla_flags", "").split() if f not in own)


def record_key(record: dict) -> tuple:
    """What a record measured (a rerun at the same commit replaces it): config, implementation, parameter
    dtype, command buffers, for ours whether the layers were unrolled, the XLA flags it ran under, its decode
    step: "fused" or "composed" (records from when the fused step ran from some batch on carry that batch
    instead; None: records from before the fused step existed), its sampling (records without one were greedy)
    and its heads per mixer-step block where forced (None: the kernels' default config of the record's commit)
    and its decode state's dtype where asked (None: the parameters')."""
    return (record["config"], record["impl"], record["param_dtype"], record.get("command_buffers"),
            record.get("scan_layers") is False, user_xla_flags(record),
            record.get("fused_decode_min_batch", record.get("decode_step")), record.get("sampling", "greedy"),
            record.get("mixer_heads"), record.get("cache_dtype"))


def combine_batches(earlier: dict, new: dict) -> dict:
    """`new`, holding `earlier`'s batches and prefills too where both records measured the same code (one git
    commit) on the same GPU model without error: a run at other batches adds to a record instead of dropping
    what it had measured."""
    def source(record):
        environment = record.get("environment") or {}
        return environment.get("git_sha"), environment.get("gpu")

    if earlier.get("error") or new.get("error") or source(new)[0] is None or source(earlier) != source(new):
        return new
    return {**new, **{field: {**(earlier.get(field) or {}), **(new.get(field) or {})}
                      for field in ("batches", "prefill_ms")},
            "prompt_lengths": sorted({*(earlier.get("prompt_lengths") or ()), *(new.get("prompt_lengths") or ())})}


def main(argv=None) -> int:
    if lm_bench.worker_main(sys.argv[1:] if argv is None else argv, work, OURS):
        return 0
    args = parse_args(argv)
    path = lm_bench.results_path(args.out, "lm_decode")
    records = []
    for job, env in jobs(args):
        print(f"{job['config']} {job['impl']} {job['param_dtype']} command buffers {job['command_buffers']} "
              f"{job.get('sampling', '')} ...", flush=True)
        began = time.perf_counter()
        record = derive(lm_bench.run_worker(Path(__file__), job, env=env, timeout_s=args.worker_timeout))
        records.append(record)
        print(format_table([record]) + f"\n({time.perf_counter() - began:.0f} s)", flush=True)
        results = lm_bench.merge_results(path, "lm_decode", records, key=record_key, combine=combine_batches)
    print(f"\nwrote {path}\n\n{format_table(results['records'])}")
    print(f"plot: {plot(results['records'], path.with_suffix('.png')) or 'none, no record was timed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
