"""The whole LM training step, ours against mamba_ssm's Mamba2 modules in PyTorch, one process per measurement.

The step: a Mamba-2 LM (embedding, n_layer blocks of fused add + RMSNorm -> Mamba2 mixer, final norm, tied
head; d_state 128, headdim 64, expand 2, chunk 256, vocab 50280), float32 parameters, bfloat16 compute,
next-token cross-entropy on (batch, seqlen) random tokens, the gradients and one AdamW update
(lr 1e-4, betas 0.9 / 0.95, weight decay 0.1, every parameter).

Implementations (--impls):
  cutile             jax-mamba2 `Mamba2LMHeadModel(backend="cutile")`, the step under jax.jit (buffers donated)
  xla                the same with backend="xla" (the chunked SSD in plain JAX; needs the most memory)
  mamba_ssm          mamba_ssm's `Mamba2` + Triton add/RMSNorm in a PyTorch LM of the same shape
                     (benchmarks/torch_lm.py), f32 parameters under torch.autocast(bfloat16), fused AdamW.
                     With --causal-conv1d its fused path (use_mem_eff_path=True: conv, SSD, gated norm and
                     out_proj in one autograd function), else use_mem_eff_path=False (torch conv1d, Triton SSD
                     and gated norm); the record's "use_mem_eff_path" and "causal_conv1d" say which.
  mamba_ssm_unfused  use_mem_eff_path=False even when causal_conv1d is there.

Configs (--configs, default the first; "all" for every one): the widths of mamba2-370m (d_model 1024) and
mamba2-780m (1536) at 24 and 48 layers, batch x seqlen 8 x 2048 and 2 x 8192. Named d{width}-l{layers}-
{batch}x{seqlen}.

Measured per (config, impl), in its own process: the first step (compilation, autotuning; for ours also its
stages apart under "first_step": trace, lower with the cuTile kernels' compiles, XLA compile, the cubins
compiled, and the first run), then steps back to back for --warmup-seconds, then --steps steps each
synchronised: median / p20 / p80 wall ms per step, then --pipelined-steps steps back to back with one sync
(three rounds, the median of their mean ms per step: what a training loop that does not wait on each step's loss
sees, the host dispatching one step while the GPU runs the one before; "ms_pipelined"),
tokens/s (from the synchronised median), peak memory (JAX: the allocator's peak_bytes_in_use since the process
started, and XLA's memory_analysis of the step; torch: max_memory_allocated over the timed steps), the bf16 matrix
rate of a large matrix product measured in the same process, and MFU = (6 x parameters x tokens + the SSD's forward
and backward FLOPs (benchmarks/ssd.py's roofline at chunk 256) x n_layer) / step time, against that measured rate
and against 790 TFLOP/s. Unless --no-profile, a trace of --profile-steps steps (ours: jax.profiler; a PyTorch
peer's on a CUDA device: torch.profiler) folded into categories (benchmarks/kernel_categories.py): matrix products,
SSD, the SSD's non-finite confinement, conv, norms, loss, optimizer, copies, elementwise.

--loss (ours): "plain" takes the logits and optax's softmax cross-entropy in float32; "model" calls
`Mamba2LMHeadModel.loss(input_ids, targets)` (the LM's own chunked loss, where the package has it); "auto"
(default) the latter when it exists.

On the GPU machine (each line < 10 minutes; add JAX_MAMBA2_GIT_SHA=<commit>):
  source .gpu/gpu-env.sh
  JAX_MAMBA2_AUTOTUNE=0 python benchmarks/lm_train.py --mamba-ssm .peers --causal-conv1d /tmp/ccsite --out $OUT
  JAX_MAMBA2_AUTOTUNE=0 python benchmarks/lm_train.py --configs d1024-l48-8x2048 d1024-l24-2x8192 ... --out $OUT
Writes <out>/lm_train_<gpu>.json (<gpu>: the GPU's model, "h200", "h100"; "cpu" without one; records merged by
(config, impl) with earlier runs of the same file) and lm_train_<gpu>.png, then prints the table.
"""
from __future__ import annotations

import contextlib
import functools
import gzip
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lm_bench  # noqa: E402

D_STATE, HEADDIM, EXPAND, CHUNK, VOCAB, D_CONV = 128, 64, 2, 256, 50280, 4
LR, BETAS, WEIGHT_DECAY, EPS = 1e-4, (0.9, 0.95), 0.1, 1e-8
IMPLS = ("cutile", "xla", "mamba_ssm", "mamba_ssm_unfused")
OURS = ("cutile", "xla")
LABELS = {
    "cutile": "jax-mamba2 Mamba2LMHeadModel, cuTile SSD",
    "xla": "jax-mamba2 Mamba2LMHeadModel, XLA SSD",
    "mamba_ssm": "mamba_ssm Mamba2 modules (PyTorch)",
    "mamba_ssm_unfused": "mamba_ssm Mamba2 modules (PyTorch), use_mem_eff_path=False",
}


class TrainConfig(NamedTuple):
    d_model: int
    n_layer: int
    batch: int
    seqlen: int

    @property
    def name(self) -> str:
        return f"d{self.d_model}-l{self.n_layer}-{self.batch}x{self.seqlen}"

    @property
    def nheads(self) -> int:
        return EXPAND * self.d_model // HEADDIM

    @classmethod
    def parse(cls, name: str) -> "TrainConfig":
        """From a name d{width}-l{layers}-{batch}x{seqlen} (any sizes, e.g. tiny ones for a CPU check)."""
        match = re.fullmatch(r"d(\d+)-l(\d+)-(\d+)x(\d+)", name)
        if not match:
            raise ValueError(f"lm_train: config {name!r} must be d<width>-l<layers>-<batch>x<seqlen>")
        return cls(*(int(v) for v in match.groups()))


CONFIGS = {c.name: c for c in (TrainConfig(d, layers, b, L) for d in (1024, 1536) for layers in (24, 48)
                               for b, L in ((8, 2048), (2, 8192)))}
DEFAULT_CONFIG = "d1024-l24-8x2048"


def parameter_count(config: TrainConfig) -> int:
    """Parameters of the LM (tied head), from the shapes of mamba_ssm's Mamba2 (ngroups 1, no biases but
    the conv's)."""
    d, d_inner, H = config.d_model, EXPAND * config.d_model, config.nheads
    conv_dim = d_inner + 2 * D_STATE
    per_layer = (d * (2 * d_inner + 2 * D_STATE + H)      # in_proj
                 + conv_dim * (D_CONV + 1)                # conv1d weight and bias
                 + 3 * H                                   # dt_bias, A_log, D
                 + d_inner + d_inner * d                   # gated norm, out_proj
                 + d)                                      # the block's norm
    return VOCAB * d + config.n_layer * per_layer + d


def model_flops(config: TrainConfig) -> dict:
    """FLOPs of one training step: 6 x parameters x tokens (forward + backward of the matrix products) and
    the SSD's forward + backward (benchmarks/ssd.py's roofline, chunk 256) in every layer."""
    from benchmarks import ssd

    tokens = config.batch * config.seqlen
    shape = ssd.Shape(config.batch, config.seqlen, config.nheads, HEADDIM, D_STATE, 1)
    ssd_flops = config.n_layer * ssd.roofline(shape, CHUNK, "fwd_bwd")["flops"]
    dense = 6 * parameter_count(config) * tokens
    return {"parameters": parameter_count(config), "tokens": tokens, "dense_flops": dense,
            "ssd_flops": ssd_flops, "flops": dense + ssd_flops}


# ----------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------

def mamba2_config(config: TrainConfig):
    from jax_mamba2.flax_layers import Mamba2Config
    return Mamba2Config(d_model=config.d_model, n_layer=config.n_layer, vocab_size=VOCAB,
                        pad_vocab_size_multiple=8, tie_embeddings=True,
                        ssm_cfg=dict(d_state=D_STATE, headdim=HEADDIM, expand=EXPAND, chunk_size=CHUNK))


def choose_loss(requested: str, model_class) -> str:
    """"plain" or "model" (Mamba2LMHeadModel.loss) for --loss auto|plain|model."""
    has_loss = callable(getattr(model_class, "loss", None))
    if requested == "model" and not has_loss:
        raise ValueError("--loss model: this jax_mamba2 has no Mamba2LMHeadModel.loss; use --loss plain")
    if requested == "auto":
        return "model" if has_loss else "plain"
    return requested


def next_token_loss(model, inputs, targets, loss_impl: str, logits_dtype: str | None = None):
    """Mean next-token cross-entropy. For the profile, the plain loss's own ops are under
    jax.named_scope("loss"); the model loss's are found by their file (jax_mamba2/cross_entropy.py), since a scope
    around `model.loss` would hold the whole model's forward and backward too.
    `logits_dtype` (the model loss only): the dtype its logits are stored in (default float32)."""
    import jax
    import jax.numpy as jnp
    import optax

    if loss_impl == "model":
        return model.loss(inputs, targets, logits_dtype=logits_dtype)
    logits = model(inputs)
    with jax.named_scope("loss"):
        logits = logits[..., :model.config.vocab_size].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_train_step(config: TrainConfig, backend: str, loss_impl: str, seed: int = 0, abstract: bool = False,
                    logits_dtype: str | None = None, **model_options):
    """(step (params, opt_state, inputs, targets) -> (params, opt_state, loss), params, opt_state, inputs,
    targets); with `abstract`, the arrays are ShapeDtypeStructs (nothing allocated: enough to lower).
    `model_options`: options of `Mamba2LMHeadModel` (MODEL_OPTIONS) that differ from its defaults."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_mamba2.flax_layers import Mamba2LMHeadModel

    def make_model():
        return Mamba2LMHeadModel(mamba2_config(config), backend=backend, dtype=jnp.bfloat16,
                                 param_dtype=jnp.float32, **model_options, rngs=nnx.Rngs(seed))

    model = nnx.eval_shape(make_model) if abstract else make_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)

    def step(params, opt_state, inputs, targets):
        def loss_fn(params):
            return next_token_loss(nnx.merge(graphdef, params, rest), inputs, targets, loss_impl, logits_dtype)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    if abstract:
        inputs = targets = jax.ShapeDtypeStruct((config.batch, config.seqlen), jnp.int32)
    else:
        ids = jax.random.randint(jax.random.key(seed + 1), (config.batch, config.seqlen + 1), 0, VOCAB, jnp.int32)
        inputs, targets = ids[:, :-1], ids[:, 1:]
    return step, params, opt_state, inputs, targets


def compile_step(step, *args, platform: str | None = None, xla_options: dict | None = None) -> tuple:
    """(compiled step or None, seconds): `step` jitted with the parameters and AdamW state donated, timed
    stage by stage: trace (Python, to a jaxpr), lower (to StableHLO: every cuTile kernel compiles to a
    cubin here), compile (XLA), and the cubins this process compiled meanwhile. With `platform` (e.g.
    "cuda" on a machine without that GPU) it lowers for it and stops there (compiled None)."""
    import time

    import jax

    cubins_before = _cubins_compiled()
    began = time.perf_counter()
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
    lowered_at = time.perf_counter()
    compiled = None if platform else lowered.compile(xla_options or None)
    compiled_at = time.perf_counter()
    cubins = _cubins_compiled()[len(cubins_before):]
    return compiled, {
        "trace_s": traced_at - began, "lower_s": lowered_at - traced_at,
        "xla_compile_s": None if platform else compiled_at - lowered_at, "cubins_compiled": len(cubins),
        "cubin_compile_s": {c.kernel: round(sum(d.seconds for d in cubins if d.kernel == c.kernel), 3)
                            for c in cubins}}


def _cubins_compiled() -> list:
    """The cubins `jax_mamba2.bridge.compile_ahead` compiled in this process (none without cuda-tile)."""
    try:
        from jax_mamba2.bridge import compile_ahead
    except ImportError:
        return []
    return compile_ahead.compile_log()


def build_ours(config: TrainConfig, backend: str, loss_impl: str, seed: int = 0, xla_options: dict | None = None,
               logits_dtype: str | None = None, **model_options):
    """(compiled step (params, opt_state, inputs, targets) -> (params, opt_state, loss), params, opt_state,
    inputs, targets, the seconds of `compile_step`): the model's parameters and AdamW state donated to
    every call."""
    step, params, opt_state, inputs, targets = make_train_step(config, backend, loss_impl, seed,
                                                               logits_dtype=logits_dtype, **model_options)
    compiled, seconds = compile_step(step, params, opt_state, inputs, targets, xla_options=xla_options)
    return compiled, params, opt_state, inputs, targets, seconds


class Variant(NamedTuple):
    """An option of ours a record may have changed from its default: its field in jobs and records, the
    default, and how a file name and a label spell a changed value."""

    field: str
    default: Any
    name: str   # format of the value for record_name
    label: str  # format of the value for label


VARIANTS = (
    Variant("logits_dtype", None, "-{}-logits", ", {} logits"),
    Variant("scan_layers", True, "-unrolled", ", layers unrolled"),
    Variant("loss_backend", None, "-{}-softmax", ", loss softmax {}"),
    Variant("check_finite", True, "-unchecked", ", SSD inputs unchecked"),
    Variant("save_chunk_states", False, "-saved-states", ", chunk states saved"),
    Variant("remat", False, "-remat-{}", ", remat {}"),
    Variant("command_buffers", "default", "-command-buffers-{}", ", command buffers {}"),
    Variant("conv_configs", None, "-conv-{}", ", conv kernels {}"),
    Variant("layer_loop", "routed", "-{}-layer-loop", ", layer loop {}"),
)


# The variants that are options of Mamba2LMHeadModel itself (the others: the loss's logits dtype, the
# process's XLA command buffers).
MODEL_OPTIONS = ("scan_layers", "loss_backend", "check_finite", "save_chunk_states", "remat")


def model_options(job: dict) -> dict:
    """The Mamba2LMHeadModel options `job` sets (MODEL_OPTIONS), as keyword arguments."""
    return {field: job[field] for field in MODEL_OPTIONS if field in job}


def changed_variants(record: dict) -> list[tuple[Variant, Any]]:
    """(variant, value) of every variant `record` (or a job) sets to other than its default, in VARIANTS order."""
    values = ((v, record.get(v.field, v.default)) for v in VARIANTS)
    return [(v, value) for v, value in values if value != v.default]


def record_name(job: dict) -> str:
    """A file name for what a job measures: config, implementation, changed variants and XLA options."""
    options = "".join(f"-{k}={v}" for k, v in sorted((job.get("xla_options") or {}).items()))
    variants = "".join(v.name.format(value) for v, value in changed_variants(job))
    return f"{job['config']}-{job['impl']}{variants}{options}"


def save_hlo(text: str, directory: Path, name: str) -> Path:
    """Writes the compiled step's HLO text, gzipped, as directory/name.hlo.txt.gz (for reading the copies,
    fusions and loops XLA made of the step)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.hlo.txt.gz"
    path.write_bytes(gzip.compress(text.encode()))
    return path


def train_ours(job: dict) -> dict:
    import time

    import jax
    from flax import nnx

    from benchmarks.environment import environment
    from jax_mamba2.flax_layers import Mamba2LMHeadModel

    config = TrainConfig.parse(job["config"])
    loss_impl = choose_loss(job["loss"], Mamba2LMHeadModel)
    model = nnx.eval_shape(lambda: Mamba2LMHeadModel(mamba2_config(config), backend=job["impl"],
                                                     **model_options(job), rngs=nnx.Rngs(0)))
    loss_softmax = model.loss_softmax_backend()
    # The model's own options, as a user compiles its step, and the job's on top (which may undo them).
    compiler_options = {**model.compiler_options(), **(job.get("xla_options") or {})}
    began = time.perf_counter()
    compiled, params, opt_state, inputs, targets, first_step = build_ours(config, job["impl"], loss_impl,
                                                                          xla_options=compiler_options,
                                                                          logits_dtype=job.get("logits_dtype"),
                                                                          **model_options(job))
    compile_s = time.perf_counter() - began
    state = {"params": params, "opt_state": opt_state}
    losses = []

    def call():
        state["params"], state["opt_state"], loss = compiled(state["params"], state["opt_state"], inputs, targets)
        losses.append(loss)
        return loss

    timing = lm_bench.time_calls(call, jax.block_until_ready, steps=job["steps"],
                                 warmup_seconds=job["warmup_seconds"], pipelined=job.get("pipelined_steps", 0))
    memory = compiled.memory_analysis()
    hlo_text = compiled.as_text()
    record = {
        "timing": timing.__dict__, "compile_s": compile_s,
        "first_step": {**first_step, "run_s": timing.first_call_s}, "loss_impl": loss_impl,
        "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
        "peak_memory_bytes": lm_bench.jax_peak_bytes(), "peak_memory_source": "jax peak_bytes_in_use (process)",
        "memory_analysis": None if memory is None else {
            k: getattr(memory, k, None) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                  "alias_size_in_bytes", "temp_size_in_bytes")},
        "environment": environment(), "xla_options": job.get("xla_options") or {},
        "compiler_options": compiler_options,  # what XLA compiled the step with: the model's, then xla_options
        "logits_dtype": job.get("logits_dtype") if loss_impl == "model" else None,
        "loss_softmax": loss_softmax if loss_impl == "model" else None,  # where the model's loss took it
    }
    if job.get("hlo_dir"):
        record["hlo_path"] = str(save_hlo(hlo_text, Path(job["hlo_dir"]), record_name(job)))
    if job["profile_steps"]:
        record["profile"] = lm_bench.profile_calls(call, hlo_text, job["profile_steps"])
    return record


# ----------------------------------------------------------------------------------------------
# PyTorch
# ----------------------------------------------------------------------------------------------

def train_torch_model(job: dict, parts: dict, device) -> dict:
    """Times the PyTorch LM built from `parts` (benchmarks/torch_lm.py's make_mixer / make_norm / add_norm)
    on `device`; the same step and measurements as ours."""
    import time

    import torch
    import torch.nn.functional as F

    from benchmarks import torch_lm

    config = TrainConfig.parse(job["config"])
    torch.manual_seed(0)
    model = torch_lm.TorchLM(d_model=config.d_model, n_layer=config.n_layer, vocab_size=VOCAB, **parts).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=True)
    ids = torch.randint(0, VOCAB, (config.batch, config.seqlen + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    cuda = device.type == "cuda"
    sync = (lambda _: torch.cuda.synchronize()) if cuda else (lambda _: None)
    losses = []

    def call():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        return loss

    began = time.perf_counter()
    sync(call())  # Triton's autotuning; allocates the optimizer state, so that the peak below is the steady state's
    first_step_s = time.perf_counter() - began
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timing = lm_bench.time_calls(call, sync, steps=job["steps"], warmup_seconds=job["warmup_seconds"],
                                 pipelined=job.get("pipelined_steps", 0))
    peak_memory = torch.cuda.max_memory_allocated() if cuda else None  # of the timed steps, before any profile
    profile = lm_bench.profile_torch_calls(call, sync, job["profile_steps"]) if cuda and job["profile_steps"] else None
    record = {
        "timing": timing.__dict__, "first_step_s": first_step_s, "loss_impl": "logits + F.cross_entropy (float32)",
        "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
        "peak_memory_bytes": peak_memory, "peak_memory_source": "torch max_memory_allocated (timed steps)",
        "parameters_counted": torch_lm.parameter_count(model), **({"profile": profile} if profile else {}),
        "environment": {"device": torch.cuda.get_device_name() if cuda else str(device),
                        "torch": torch.__version__, "git_sha": lm_bench.git_sha()},
    }
    return record


def train_mamba_ssm(job: dict) -> dict:
    import torch

    from benchmarks import torch_lm

    lm_bench.add_peer_paths(job.get("mamba_ssm"), job.get("causal_conv1d"))
    reason = lm_bench.mamba_ssm_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    conv_version = lm_bench.causal_conv1d_version()
    fused = job["impl"] == "mamba_ssm" and conv_version is not None
    device = torch.device("cuda")
    parts = torch_lm.mamba_ssm_parts(TrainConfig.parse(job["config"]).d_model, d_state=D_STATE, headdim=HEADDIM,
                                     expand=EXPAND, chunk_size=CHUNK, use_mem_eff_path=fused, device=device)
    return {**train_torch_model(job, parts, device), "use_mem_eff_path": fused, "causal_conv1d": conv_version}


def conv_kernels(spec: str):
    """The cuTile conv kernels (`conv_ops.KERNELS["cutile"]`) at the configs of `spec`, "FWD,BWD" in
    benchmarks/conv1d.py's notation (e.g. 16x512x3,8x32x128x4); each must fit its problem."""
    import dataclasses

    from benchmarks.conv1d import parse_config
    from jax_mamba2.bridge import conv_ops
    from jax_mamba2.kernels.causal_conv1d import ConvFwdConfig
    from jax_mamba2.kernels.causal_conv1d_bwd import ConvBwdConfig

    fwd, bwd = spec.split(",")
    return dataclasses.replace(conv_ops.KERNELS["cutile"], fwd_config=parse_config(fwd, ConvFwdConfig),
                               bwd_config=parse_config(bwd, ConvBwdConfig))


def work(job: dict) -> dict:
    if job["impl"] not in OURS:
        return train_mamba_ssm(job)
    with contextlib.ExitStack() as replaced:
        if job.get("conv_configs"):
            from jax_mamba2 import backends, conv1d

            replaced.enter_context(backends.kernels_replaced(conv1d.OP, "cutile", conv_kernels(job["conv_configs"])))
        loop = job.get("layer_loop", "routed")
        if loop != "routed":  # the A/B baselines: residuals stacked after each layer, or by lax.scan (zero-filled)
            from unittest import mock

            from jax_mamba2.flax_layers import layer_loop

            baseline = (layer_loop.lax_scan_blocks if loop == "lax-scan"
                        else functools.partial(layer_loop.scan_blocks, route_residuals=False))
            replaced.enter_context(mock.patch("jax_mamba2.flax_layers.lm.scan_blocks", baseline))
        return train_ours(job)


# ----------------------------------------------------------------------------------------------
# Driver: records, table, plot
# ----------------------------------------------------------------------------------------------

def derive(record: dict) -> dict:
    """tokens/s and MFU of a worker's record (None where it failed)."""
    flops = model_flops(TrainConfig.parse(record["config"]))
    timing = record.get("timing")
    if record.get("error") or not timing:
        return {**record, "model_flops": flops}
    seconds = timing["ms_median"] * 1e-3
    achieved = flops["flops"] / seconds / 1e12
    measured = (record.get("device_rates") or {}).get("matmul_tflops")
    return {**record, "model_flops": flops, "tokens_per_s": flops["tokens"] / seconds,
            "achieved_tflops": achieved, "mfu_measured": achieved / measured if measured else None,
            "mfu_nominal": achieved / lm_bench.NOMINAL_BF16_TFLOPS, "label": label(record)}


def label(record: dict) -> str:
    """The implementation named in full, with mamba_ssm's path."""
    if record["impl"].startswith("mamba_ssm") and "use_mem_eff_path" in record:
        path = ("fused path (use_mem_eff_path=True), causal_conv1d " + str(record.get("causal_conv1d"))
                if record["use_mem_eff_path"] else "use_mem_eff_path=False" +
                ("" if record.get("causal_conv1d") else ", no causal_conv1d"))
        return f"mamba_ssm Mamba2 modules (PyTorch), {path}"
    options = record.get("xla_options") or {}
    return (LABELS[record["impl"]] + "".join(v.label.format(value) for v, value in changed_variants(record))
            + "".join(f", {k}={v}" for k, v in sorted(options.items())))


def format_table(records: list[dict]) -> str:
    rows = [("config", "implementation", "step ms (p20-p80)", "pipelined", "tokens/s", "MFU meas./790", "peak GiB",
             "note")]
    for r in records:
        if r.get("error"):
            rows.append((r["config"], LABELS.get(r["impl"], r["impl"]), "-", "-", "-", "-", "-",
                         str(r["error"]).splitlines()[0][:70]))
            continue
        t = r["timing"]
        peak = r.get("peak_memory_bytes")
        pipelined = t.get("ms_pipelined")  # older records: none
        rows.append((r["config"], r["label"], f"{t['ms_median']:.1f} ({t['ms_p20']:.1f}-{t['ms_p80']:.1f})",
                     "-" if pipelined is None else f"{pipelined:.1f}", f"{r['tokens_per_s'] / 1e3:.0f}K",
                     f"{_pct(r.get('mfu_measured'))}/{_pct(r['mfu_nominal'])}",
                     "-" if peak is None else f"{peak / 2 ** 30:.1f}", f"loss {r.get('loss_impl')}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    for r in records:
        profile = r.get("profile")
        if profile and profile.get("busy_us"):
            parts = ", ".join(f"{c} {v['us'] / 1e3:.1f}" for c, v in profile["categories"].items())
            idle = f"{profile['idle_us'] / 1e3:.1f} idle, " if "idle_us" in profile else ""  # older records: none
            lines.append(f"{r['config']} {r['impl']}: GPU ms per step by category ({profile['busy_us'] / 1e3:.1f} "
                         f"busy, {idle}{profile['kernel_launches']:.0f} launches): {parts}")
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _speedup(records: list[dict], config: str):
    """(config, the peer's ms / ours, whether both ran at one commit) for the fastest of ours as a user runs it
    against mamba_ssm's fused path (its record of that commit if there is one, else its latest); None without
    both."""
    ours = [r for r in records if r["config"] == config and _user_ours(r)]
    peers = [r for r in records if r["config"] == config and r["impl"] == "mamba_ssm"]
    if not ours or not peers:
        return None
    best = min(ours, key=lambda r: r["timing"]["ms_median"])
    same_run = [r for r in peers if _commit(r) == _commit(best)]
    peer = (same_run or peers)[-1]
    return config, peer["timing"]["ms_median"] / best["timing"]["ms_median"], bool(same_run)


def _commit(record: dict):
    return (record.get("environment") or {}).get("git_sha")


def _user_ours(record: dict) -> bool:
    """A record of ours as a user ran it: the cutile backend, no XLA options, every variant at its default but the
    layer mode (the layer scan or unrolled blocks, both model options). Judged by the record's label, which names
    the variants it changed against the defaults of the day it ran, so that a default changed since (whether the
    chunk states are saved, where the loss's softmax runs) neither makes an old record a variant nor an old variant
    a user's run."""
    unrolled = next(v.label for v in VARIANTS if v.field == "scan_layers")
    return record["impl"] == "cutile" and record["label"] in (LABELS["cutile"], LABELS["cutile"] + unrolled)


def plot(records: list[dict], path: Path) -> Path:
    """Three panels: step ms and tokens/s (log axes), grouped by config in CONFIGS' order, a bar per
    implementation in one order (ours first); and the speedup of ours (cutile, the faster of the layer scan and
    unrolled blocks) over mamba_ssm's fused path per config. A measurement run again (same config and label, as
    the results file keeps earlier runs cited by the docs) is drawn from its latest record."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list({(r["config"], r.get("label") or LABELS[r["impl"]]): r for r in records}.values())
    ok = [r for r in records if not r.get("error")]
    configs = [c for c in CONFIGS if any(r["config"] == c for r in records)]
    labels = sorted({r.get("label") or LABELS[r["impl"]] for r in records},
                    key=lambda s: (not s.startswith("jax-mamba2"), s))
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 1.4 * len(configs) + 8), 6.0),
                             gridspec_kw={"width_ratios": [2, 2, 1.2]})
    width = 0.8 / max(len(labels), 1)
    for ax, field, title in ((axes[0], "ms", "step (ms, median; lower is better)"),
                             (axes[1], "tokens_per_s", "tokens/s (higher is better)")):
        for j, name in enumerate(labels):
            xs, ys = [], []
            for i, config in enumerate(configs):
                match = [r for r in records if r["config"] == config and (r.get("label") or LABELS[r["impl"]]) == name]
                if match and not match[0].get("error"):
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    ys.append(match[0]["timing"]["ms_median"] if field == "ms" else match[0]["tokens_per_s"])
                elif match:
                    ax.text(i + (j - (len(labels) - 1) / 2) * width, 0.02, "failed", rotation=90, fontsize=7,
                            ha="center", va="bottom", transform=ax.get_xaxis_transform())
            ax.bar(xs, ys, width, label=name, color=plt.cm.tab20(j % 20))  # more labels than tab10 has colours
        ax.set_yscale("log")
        ax.set_xticks(range(len(configs)), configs, rotation=25, fontsize=8)
        ax.set_title(title, fontsize=10)
    speedups = [s for s in (_speedup(ok, config) for config in configs) if s]
    ax = axes[2]
    ax.barh([c for c, _, _ in speedups][::-1], [v for _, v, _ in speedups][::-1],
            color=["C0" if same_run else "0.7" for _, _, same_run in speedups][::-1])
    for k, (_, v, same_run) in enumerate(speedups[::-1]):
        ax.text(v, k, f" {v:.2f}x" + ("" if same_run else " *"), va="center", fontsize=8)
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_xlim(0, max([v for _, v, _ in speedups] + [1.0]) * 1.25)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("speedup of jax-mamba2 over mamba_ssm (fused path)\n(grey, *: the peer measured in another run)",
                 fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    return lm_bench.save_figure(fig, path, "Mamba-2 LM training step (bf16 compute, f32 params, AdamW)", records,
                                bottom=0.05 + 0.035 * -(-len(labels) // 2))


def parse_args(argv=None):
    parser = lm_bench.make_parser(__doc__)
    parser.add_argument("--configs", nargs="+", default=[DEFAULT_CONFIG],
                        help=f"config names or 'all' (default: {DEFAULT_CONFIG}); one of {', '.join(CONFIGS)}")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["cutile", "xla", "mamba_ssm"],
                        help="default: cutile xla mamba_ssm")
    lm_bench.add_peer_flags(parser)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--pipelined-steps", type=int, default=8,
                        help="steps per round of back-to-back steps, one sync each (timing.ms_pipelined, median of "
                             f"{lm_bench.PIPELINED_ROUNDS} rounds); 0: not measured (default: 8)")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="untimed steps first (default: 5 s)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profiled steps of each implementation (default: 3; a PyTorch peer's on a CUDA device)")
    parser.add_argument("--no-profile", action="store_true", help="no per-kernel profile")
    parser.add_argument("--loss", choices=("auto", "plain", "model"), default="auto",
                        help="ours: the loss implementation (default: auto)")
    parser.add_argument("--logits-dtype", choices=("float32", "bfloat16"), default=None,
                        help="ours, --loss model: the dtype the loss stores its logits in (default: the model "
                             "loss's own, float32)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="ours: Mamba2LMHeadModel(scan_layers=False), the blocks unrolled (default: one scan)")
    parser.add_argument("--command-buffers", choices=tuple(lm_bench.COMMAND_BUFFER_FLAGS), default="default",
                        help="ours: XLA's command buffers as XLA defaults them, off, also over loops and "
                             "conditionals (the layer scan, the loss's chunk loops), or as XLA defaults them "
                             "but with our launches from the host (default: default)")
    parser.add_argument("--loss-backend", choices=("xla", "cutile", "cutile_callback", "auto"), default=None,
                        help="ours: Mamba2LMHeadModel(loss_backend=), where the loss's softmax runs (default: the "
                             "model's own choice, recorded as loss_softmax)")
    parser.add_argument("--no-check-finite", action="store_true",
                        help="ours: Mamba2LMHeadModel(check_finite=False), the SSD kernels run on their inputs "
                             "as they are, without confining NaN and inf (default: confined)")
    parser.add_argument("--chunk-states", choices=("saved", "recomputed"), default=None,
                        help="ours: Mamba2LMHeadModel(save_chunk_states=True / False), the SSD forward keeps its "
                             "chunk states for the backward or the backward recomputes them (default: the model's, "
                             "kept under --remat, recomputed without it)")
    parser.add_argument("--remat", choices=("matmuls", "full"), default=None,
                        help="ours: Mamba2LMHeadModel(remat=): keep only in_proj's output (matmuls) or only each "
                             "block's inputs (full) for the backward (default: everything it reads)")
    parser.add_argument("--conv-configs", default=None, metavar="FWD,BWD",
                        help="ours: the cuTile conv kernels at these configs (benchmarks/conv1d.py's notation, e.g. "
                             "16x512x3,8x32x128x4) instead of their defaults")
    parser.add_argument("--layer-loop", choices=("routed", "unfilled", "lax-scan"), default="routed",
                        help="ours with the layer scan: the model's loop (residuals written into unfilled stacks where "
                             "the layer computes them), the same loop stacking them after each layer (unfilled), or "
                             "lax.scan's (stacks created as zeros), for the A/B (default: routed)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="ours: an XLA compiler option of the step on top of the model's "
                             "(Mamba2LMHeadModel.compiler_options), e.g. xla_gpu_enable_triton_gemm=true "
                             "(repeatable; default: none)")
    parser.add_argument("--hlo-dir", type=Path, default=None,
                        help="ours: write each compiled step's HLO text there, gzipped (default: not written)")
    parser.add_argument("--worker-timeout", type=float, default=540, help="seconds per process (default: 540)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.configs = list(CONFIGS) if args.configs == ["all"] else args.configs
    for name in args.configs:
        try:
            TrainConfig.parse(name)
        except ValueError as e:
            parser.error(str(e))
    if args.layer_loop != "routed" and args.unroll_layers:
        parser.error("--layer-loop is the layer scan's: not with --unroll-layers")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def xla_options(specs: list[str]) -> dict:
    """NAME=VALUE strings as XLA compiler options: true / false as bools, integers as ints."""
    options = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[name] = lowered == "true"
        else:
            options[name] = int(value) if value.isdigit() else value
    return options


def record_key(record: dict) -> tuple:
    """What a record measured: config, implementation, the XLA options and the variants of ours (a rerun at the
    same commit replaces it)."""
    return (record["config"], record["impl"], tuple(sorted((record.get("xla_options") or {}).items())),
            *(record.get(v.field, v.default) for v in VARIANTS))


def jobs(args) -> list[dict]:
    from jax_mamba2.flax_layers.lm import chunk_states_saved

    peers = lm_bench.peer_paths(args)
    remat = {None: False, "full": True}.get(args.remat, args.remat)
    return [{"config": config, "impl": impl, "steps": args.steps, "warmup_seconds": args.warmup_seconds,
             "pipelined_steps": args.pipelined_steps,
             "profile_steps": 0 if args.no_profile else args.profile_steps,
             "loss": args.loss, **(peers if impl not in OURS else {"xla_options": xla_options(args.xla_option),
                                                          "logits_dtype": args.logits_dtype,
                                                          "scan_layers": not args.unroll_layers,
                                                          "loss_backend": args.loss_backend,
                                                          "check_finite": not args.no_check_finite,
                                                          "save_chunk_states": chunk_states_saved(
                                                              {None: None, "saved": True, "recomputed": False}[
                                                                  args.chunk_states], remat),
                                                          "remat": remat,
                                                          "command_buffers": args.command_buffers,
                                                          "conv_configs": args.conv_configs,
                                                          "layer_loop": args.layer_loop,
                                                          "hlo_dir": args.hlo_dir and str(args.hlo_dir)})}
            for config in args.configs for impl in args.impls]


def main(argv=None) -> int:
    if lm_bench.worker_main(sys.argv[1:] if argv is None else argv, work, OURS):
        return 0
    args = parse_args(argv)
    path = lm_bench.results_path(args.out, "lm_train")
    records = []
    for job in jobs(args):
        print(f"{job['config']} {job['impl']} ...", flush=True)
        env = lm_bench.command_buffer_env(job["command_buffers"]) if job["impl"] in OURS else {}
        record = derive(lm_bench.run_worker(Path(__file__), job, env=env, timeout_s=args.worker_timeout))
        records.append(record)
        print(format_table([record]), flush=True)
        results = lm_bench.merge_results(path, "lm_train", records, key=record_key)
    print(f"\nwrote {path}\n\n{format_table(results['records'])}")
    print(f"plot: {plot(results['records'], path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
