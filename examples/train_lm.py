"""Train a small byte-level Mamba-2 language model on the Python standard library's own source files.

Nothing is downloaded: the corpus is the `*.py` files of the running interpreter's standard library,
read as bytes (vocabulary 256), split into train and validation by file. The model is a
`Mamba2LMHeadModel` (Flax NNX) trained with optax AdamW; the loop shows a tqdm bar, evaluates every
--eval-every steps, checkpoints model and optimizer with Orbax (--resume continues from the last one;
without it, an --out holding an earlier run's checkpoints is refused), and at the end restores this run's
last checkpoint into a fresh model, checks that it reproduces the validation loss, and samples text
(greedy and with temperature) through the decode cache.

    python examples/train_lm.py                    # CPU: a 2-layer model, about a minute
    python examples/train_lm.py --d-model 768 --layers 24 --d-state 128 --headdim 64 \\
        --chunk-size 256 --seq-len 2048 --batch 8 --steps 2000 --lr 1e-3 --dtype bfloat16   # GPU

On a GPU with cuda-tile installed, --backend auto runs the SSD as cuTile kernels (forward and backward);
elsewhere it runs the chunked pure-JAX "xla" path and says so. Writes to --out/train_lm/:
loss_curve.png, metrics.json, sample.txt, checkpoints/ (Orbax) and model/ (the trained weights as an
HF-format config.json + model.safetensors, which examples/generate.py --model-dir loads).
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import sysconfig
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from _common import (INT32_MAX, add_common_flags, axis_size, describe_device, in_range, make_parser, model_flags,
                     output_dir, positive_int, power_of_two, prompt_bytes, resolve_backend, save_figure,
                     sequence_length, settings, write_atomically)
from jax_mamba2.checks import check_element_count
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, generate, save_pretrained

VOCAB_SIZE = 256  # bytes
MAX_STEPS = 2**31 - 1  # optax counts the steps in int32, and the learning-rate schedule reads that count


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

def load_corpus(max_bytes: int, *, val_every: int = 10) -> tuple[np.ndarray, np.ndarray, str]:
    """The standard library's source as bytes: (train uint8 array, validation uint8 array, summary).

    A file goes to validation when the CRC32 of its relative path is 0 modulo `val_every`, so the split
    does not depend on which other files exist. Files are read in sorted order until the train split
    holds about (1 - 1/val_every) * max_bytes and the validation split the rest.
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    budget = {"val": max_bytes // val_every, "train": max_bytes - max_bytes // val_every}
    parts, sizes = {"train": [], "val": []}, {"train": 0, "val": 0}
    for path in files:
        split = "val" if zlib.crc32(str(path.relative_to(stdlib)).encode()) % val_every == 0 else "train"
        if sizes[split] < budget[split]:
            parts[split].append(path.read_bytes())
            sizes[split] += len(parts[split][-1])
        if all(sizes[s] >= budget[s] for s in sizes):
            break
    train, val = (np.frombuffer(b"\n".join(parts[s]), np.uint8) for s in ("train", "val"))
    summary = (f"{len(parts['train'])} + {len(parts['val'])} files of {stdlib}: "
               f"{train.size / 1e6:.2f} MB train, {val.size / 1e6:.2f} MB validation")
    return train, val, summary


def sample_windows(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
    """(batch, seq_len + 1) int32 random windows of `data` (at least seq_len + 1 bytes), each start equally likely
    (the last window ends at data's last byte): inputs [:, :-1], next-byte targets [:, 1:]."""
    starts = rng.integers(0, data.size - seq_len, size=batch)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Model, optimizer, steps
# ------------------------------------------------------------------------------------------------

def build_model(args, backend: str, seed: int) -> Mamba2LMHeadModel:
    with model_flags("--d-model", "--layers", "--d-state", "--headdim", "--chunk-size"):
        config = Mamba2Config(
            d_model=args.d_model, n_layer=args.layers, vocab_size=VOCAB_SIZE, pad_vocab_size_multiple=8,
            ssm_cfg=dict(d_state=args.d_state, headdim=args.headdim, chunk_size=args.chunk_size, expand=2))
    remat = {None: False, "full": True}.get(args.remat, args.remat)
    return Mamba2LMHeadModel(config, backend=backend, remat=remat, scan_layers=not args.unroll_layers,
                             dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(params=seed))


def learning_rate_schedule(args):
    """Linear warmup over the first tenth of the steps (none under 10 steps: the first step trains) to --lr, then
    cosine decay to a tenth of it at --steps."""
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=args.lr, warmup_steps=args.steps // 10,
                                              decay_steps=args.steps, end_value=args.lr / 10)


def build_optimizer(model: Mamba2LMHeadModel, args) -> nnx.Optimizer:
    """AdamW with warmup and cosine decay, clipped gradients. Only the `kernel`s (in_proj, conv1d,
    out_proj) decay: not A_log, D, dt_bias (mamba_ssm's `_no_weight_decay`), norms or the embedding."""
    schedule = learning_rate_schedule(args)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: any(getattr(k, "key", None) == "kernel" for k in path), params)

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def next_byte_loss(model: Mamba2LMHeadModel, windows: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of predicting windows[:, 1:] from windows[:, :-1]: the model's fused LM head +
    chunked cross-entropy, which never holds the whole batch's logits."""
    return model.loss(windows[:, :-1], shift_labels=windows[:, 1:])


def make_train_step(model: Mamba2LMHeadModel, optimizer: nnx.Optimizer):
    """step(windows) -> loss: one AdamW step that updates `model` and `optimizer` in place, compiled with the
    model's XLA options (`compiler_options()`: under the layer scan, products that copy fewer of its stacked
    activations). nnx.jit takes no compiler options, so the step is a jax.jit of their split state."""
    graphdef = nnx.graphdef((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0, compiler_options=model.compiler_options())
    def pure_step(state, windows):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(next_byte_loss)(model, windows)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def step(windows):
        state, loss = pure_step(nnx.state((model, optimizer)), windows)
        nnx.update((model, optimizer), state)
        return loss

    return step


@nnx.jit
def eval_loss(model, windows):
    return next_byte_loss(model, windows)


def evaluate(model, val_windows: list[np.ndarray]) -> float:
    return float(np.mean([eval_loss(model, w) for w in val_windows]))


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------

def checkpoint_manager(directory: pathlib.Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(directory.resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(manager: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    manager.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(model)),
                                               optimizer=ocp.args.StandardSave(nnx.state(optimizer))))


def restore_checkpoint(manager: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    """Loads checkpoint `step` into `model` and `optimizer` in place (their state gives shapes and dtypes)."""
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    restored = manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(abstract(nnx.state(model))),
        optimizer=ocp.args.StandardRestore(abstract(nnx.state(optimizer)))))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------

def write_metrics(path: pathlib.Path, backend: str, args, n_params: int, history: dict) -> None:
    """metrics.json: the run's settings and its loss history so far (written at each checkpoint too, so that a
    resumed run keeps the history of an interrupted one)."""
    write_atomically(path, json.dumps({
        "device": describe_device(), "backend": backend, "args": settings(args), "parameters": n_params,
        "history": history}, indent=1).encode())


def read_metrics(metrics_file: pathlib.Path) -> dict:
    """The metrics.json `write_metrics` wrote ({"args": ..., "history": ...}), or {} where there is no file. Exits
    naming the file where it is not one (it is written whole, so something else changed it): what --resume reads of
    it, the earlier run's settings and losses, is then unknown."""
    if not metrics_file.is_file():
        return {}
    try:
        metrics = json.loads(metrics_file.read_bytes())
        problem = None if isinstance(metrics, dict) and all(isinstance(metrics.get(key), dict) for key in (
            "args", "history")) else "no args and history in it"
    except OSError as e:
        problem = f"unreadable: {e}"
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        problem = f"not JSON: {e}"
    if problem:
        raise SystemExit(f"--resume: {metrics_file} is not the metrics.json this script writes ({problem}); move it "
                         "away to resume without the earlier run's settings checks and loss history")
    return metrics


def earlier_values(saved: dict, args, flags: tuple[str, ...]) -> dict:
    """{flag: value} of those of `flags` whose value in the settings of the run that wrote `saved` (`read_metrics`:
    the metrics.json written with each of its checkpoints) differs from `args`; empty where they agree or nothing
    was saved."""
    written = saved.get("args", {})
    return {name: written[name] for name in flags if name in written and written[name] != getattr(args, name)}


# The flags that give the parameters their shapes: a checkpoint restores only into a model built with its values.
SHAPE_FLAGS = ("d_model", "layers", "d_state", "headdim")


def earlier_flags(differ: dict, args) -> str:
    """The flags of `differ` ({flag: the earlier run's value}) as that run gave them, each with the value in `args`:
    "--d-model 32 (not 64), ..."."""
    return ", ".join(f"--{name.replace('_', '-')} {value} (not {getattr(args, name)})"
                     for name, value in differ.items())


def check_shape_flags(saved: dict, args, checkpoint: str) -> None:
    """Exits naming the flags whose values differ from those of the run that wrote `saved`, before a restore that
    could only fail; nothing saved, no check (Orbax's shape check remains)."""
    differ = earlier_values(saved, args, SHAPE_FLAGS)
    if differ:
        raise SystemExit(f"--resume: {checkpoint} was written by a model of other shapes; resume with the model "
                         f"flags of the run that wrote it: {earlier_flags(differ, args)}")


# The flags that decide which bytes each step trains on: the corpus read (data_mb) and the windows each step draws
# from it (seed, batch, seq_len; `sample_windows`).
DATA_FLAGS = ("seed", "batch", "seq_len", "data_mb")


def check_data_flags(saved: dict, metrics_file: pathlib.Path, args, checkpoint: str) -> str | None:
    """Exits naming the DATA_FLAGS whose values differ from those of the run that wrote `saved` (read from
    `metrics_file`, written with each of its checkpoints): the resumed steps would train on other batches than that
    run's. Without the file (a checkpoint whose run was cut short before writing it, or copied without it) they
    cannot be checked: returns a line saying so (None where the file is there)."""
    differ = earlier_values(saved, args, DATA_FLAGS)
    if differ:
        raise SystemExit(f"--resume: {checkpoint} was trained on the batches of other data flags; resume with those "
                         f"of the run that wrote it: {earlier_flags(differ, args)}")
    if saved:
        return None
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in DATA_FLAGS)
    return (f"--resume: no {metrics_file} records the flags of the run that wrote {checkpoint}; the resumed steps "
            f"draw their batches from {flags} as given now, unchecked")


# The flags the learning-rate schedule is a function of (`learning_rate_schedule`).
SCHEDULE_FLAGS = ("steps", "lr")


def schedule_change(saved: dict, args, step: int) -> str | None:
    """Where a resumed run's SCHEDULE_FLAGS differ from those of the run that wrote `saved` (`read_metrics`), a line
    saying so and what it does to the learning rate at `step`, the first step trained now (a longer --steps
    stretches the cosine, so the rate jumps back up); None where they agree or nothing was saved."""
    differ = earlier_values(saved, args, SCHEDULE_FLAGS)
    if not differ:
        return None
    before = argparse.Namespace(**{**vars(args), **differ})
    flags = ", ".join(f"--{name} {getattr(args, name)} (the earlier run's {value})" for name, value in differ.items())
    return (f"--resume: {flags} changes the learning-rate schedule: the rate at step {step} is "
            f"{float(learning_rate_schedule(args)(step)):.3g}, where the earlier run's would be "
            f"{float(learning_rate_schedule(before)(step)):.3g}")


def root_cause(error: BaseException) -> BaseException:
    """The first exception of the chain that ends in `error` (Orbax wraps TensorStore's, which names the file)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def first_line(error: BaseException) -> str:
    """`error`'s message, its first line (a KeyError's without the quotes `str` adds)."""
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return (message.strip().splitlines() or [""])[0]


def damaged_checkpoint(directory: pathlib.Path, step: int, steps, error: BaseException) -> str:
    """What --resume says of the checkpoint at `step` in `directory` (of those at `steps`) that Orbax could not read
    (`error`): its folder is incomplete or damaged (Orbax writes a checkpoint under a temporary name and renames it
    once whole, so a save cut short leaves no such folder; something else changed it), and how to go on."""
    earlier = [s for s in steps if s < step]
    then = f"resume from step {max(earlier)}, the checkpoint before it" if earlier else "start a new run"
    return (f"--resume: the checkpoint at step {step} cannot be read; its folder {directory / str(step)} is "
            f"incomplete or damaged ({type(error).__name__}: {first_line(error)}). Delete that folder to {then}")


def resumed_history(saved: dict, step: int) -> dict:
    """The loss history of an earlier run (`saved`, `read_metrics`) up to `step` (as of its last checkpoint)."""
    history = saved.get("history", {})
    return {name: [tuple(p) for p in history.get(name, []) if p[0] <= step] for name in ("train", "eval")}


def save_loss_curve(history: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history["train"]), label="train", linewidth=1, alpha=0.7)
    ax.plot(*zip(*history["eval"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def sample_text(model, prompt: str, max_new_tokens: int, *, temperature: float, seed: int) -> str:
    prompt_ids = jnp.asarray([list(prompt_bytes(prompt))], jnp.int32)
    tokens = generate(model, prompt_ids, max_new_tokens, temperature=temperature,
                      rng=jax.random.key(seed) if temperature > 0 else None)
    return bytes(np.asarray(tokens[0]).astype(np.uint8).tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=positive_int, default=250,
                        help=f"training steps in all, a resumed run's included (at most {MAX_STEPS})")
    parser.add_argument("--batch", type=axis_size, default=8, help="sequences per step, at most 2**31 - 1")
    parser.add_argument("--seq-len", type=sequence_length, default=128,
                        help="bytes per sequence, at most 2**31 - 2 (its window holds one more, the last target)")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width")
    parser.add_argument("--layers", type=positive_int, default=2, help="Mamba-2 blocks")
    parser.add_argument("--d-state", type=positive_int, default=32, help="SSM state size N")
    parser.add_argument("--headdim", type=positive_int, default=32, help="SSM head size P")
    parser.add_argument("--chunk-size", type=power_of_two, default=64, help="SSD chunk length, a power of two")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="computation dtype; parameters stay float32")
    parser.add_argument("--remat", nargs="?", const="full", choices=("full", "matmuls"), default=None,
                        help="rematerialize blocks in the backward pass: all of each block (--remat, full) or all "
                             "but in_proj's output (matmuls); None: keep every activation")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="unroll the blocks (scan_layers=False): faster steps, longer compile")
    parser.add_argument("--lr", type=in_range(0.0, float("inf"), low_open=True), default=3e-3,
                        help="peak learning rate")
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps between loss read-outs")
    parser.add_argument("--eval-every", type=positive_int, default=50,
                        help="steps between validation losses and checkpoints")
    parser.add_argument("--eval-batches", type=positive_int, default=4, help="validation batches per evaluation")
    parser.add_argument("--data-mb", type=in_range(0.0, float("inf"), low_open=True), default=8.0,
                        help="corpus size to read, in MB")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in --out, with the run's model and data flags "
                             "(without it, --out must hold no checkpoint of an earlier run)")
    parser.add_argument("--prompt", default="def ", help="text the samples start from (default: %(default)r)")
    parser.add_argument("--sample-tokens", type=sequence_length, default=200,
                        help="bytes sampled after the prompt, at most 2**31 - 1 with the prompt's")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    if args.steps > MAX_STEPS:
        parser.error(f"--steps={args.steps} must be at most 2**31 - 1 (optax counts the steps in int32)")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    try:  # checked now: the samples are drawn after the training
        prompt = prompt_bytes(args.prompt)
    except UnicodeEncodeError as e:
        parser.error(f"--prompt={args.prompt!r} holds {e.object[e.start:e.end]!r}, a lone surrogate: neither text nor "
                     "a byte of a command line")
    try:  # a step's windows, each with its last target
        check_element_count("train_lm.py", "a step's windows", "(--batch, --seq-len + 1)",
                            (args.batch, args.seq_len + 1))
    except ValueError as error:
        parser.error(str(error))
    if len(prompt) + args.sample_tokens > INT32_MAX:  # a sample, prompt and new bytes, is an array axis
        parser.error(f"--sample-tokens={args.sample_tokens} after the {len(prompt)} bytes of --prompt must make at "
                     "most 2**31 - 1 bytes (an array axis)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_dir(args.out / "train_lm")
    manager = checkpoint_manager(out / "checkpoints")
    try:
        return train(args, out, manager)
    finally:  # Orbax's background threads are joined before the interpreter exits, also after a SystemExit
        manager.close()


def train(args, out: pathlib.Path, manager: ocp.CheckpointManager) -> int:
    """The run main() describes, its checkpoints kept by `manager`; returns the exit status."""
    if not args.resume and manager.latest_step() is not None:
        raise SystemExit(f"train_lm.py: {out / 'checkpoints'} holds the checkpoints of an earlier run (steps "
                         f"{list(manager.all_steps())}); pass --resume to continue it, or choose another --out "
                         f"(or delete that folder) to start a new run")
    print(f"device: {describe_device()}")
    backend = resolve_backend(args.backend)
    train_data, val_data, summary = load_corpus(int(args.data_mb * 1e6))
    print(f"corpus: {summary}")
    if min(train_data.size, val_data.size) < args.seq_len + 1:
        raise SystemExit(f"train_lm.py: --data-mb={args.data_mb} gives a split shorter than "
                         f"--seq-len={args.seq_len} + 1 bytes; raise --data-mb")

    model = build_model(args, backend, args.seed)
    optimizer = build_optimizer(model, args)
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {n_params / 1e6:.2f}M parameters, d_model={args.d_model}, layers={args.layers}, "
          f"d_state={args.d_state}, headdim={args.headdim}, chunk_size={args.chunk_size}, dtype={args.dtype}")

    val_rng = np.random.default_rng(args.seed ^ 1)
    val_windows = [sample_windows(val_data, val_rng, args.batch, args.seq_len) for _ in range(args.eval_batches)]
    start, history = 0, {"train": [], "eval": []}
    if args.resume and manager.latest_step() is None:
        print(f"--resume: no checkpoint in {out / 'checkpoints'}; starting a new run")
    elif args.resume:
        start = manager.latest_step()
        checkpoint = f"the checkpoint at step {start} in {out / 'checkpoints'}"
        saved = read_metrics(out / "metrics.json")  # read once: every check below sees the same run's record
        check_shape_flags(saved, args, checkpoint)
        unchecked = check_data_flags(saved, out / "metrics.json", args, checkpoint)
        if unchecked:
            print(unchecked)
        try:
            restore_checkpoint(manager, start, model, optimizer)
        except (KeyError, ValueError, OSError) as e:  # what Orbax raises of a folder it cannot read (an item
            # missing: KeyError; TensorStore's errors: ValueError), said in one line that names the folder. Not an
            # error of the device or the program (out of memory, a bug), which the folder is not to blame for.
            cause = root_cause(e)
            if "stored shape" in first_line(cause):  # Orbax's "Requested shape ... not compatible with the stored"
                raise SystemExit(f"--resume: the checkpoint at step {start} in {out / 'checkpoints'} does not fit "
                                 "this model; resume with the model flags of the run that wrote it (--d-model, "
                                 f"--layers, --d-state, --headdim). Orbax said: {first_line(cause)}") from None
            raise SystemExit(damaged_checkpoint(out / "checkpoints", start, manager.all_steps(), cause)) from None
        if start > args.steps:  # its outputs would be a later step's model under an earlier run's settings
            raise SystemExit(f"--resume: the checkpoint in {out / 'checkpoints'} is at step {start}, past "
                             f"--steps={args.steps}; resume with --steps {start} or more")
        history = resumed_history(saved, start)
        note = schedule_change(saved, args, start) if start < args.steps else None
        if note:
            print(note)
        print(f"resumed from step {start}" + (f", at or past --steps={args.steps}: nothing left to train"
                                              if start >= args.steps else ""))

    train_step = make_train_step(model, optimizer)
    # Losses stay on the device and are fetched every --log-every steps, so that the host keeps the
    # accelerator's queue full instead of waiting for each step.
    pending, began, excluded = [], None, 0.0
    saved_step = start  # the checkpoint of this run that the restore check reads
    progress = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", unit="step")
    for step in progress:
        # The batch depends only on (seed, step): a resumed run sees the same data.
        windows = sample_windows(train_data, np.random.default_rng((args.seed, step)), args.batch, args.seq_len)
        pending.append((step + 1, train_step(windows)))
        if began is None:  # the first step compiled: time the ones after it
            jax.block_until_ready(pending[-1][1])
            began = time.perf_counter()
        evaluating = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
        if evaluating or (step + 1) % args.log_every == 0:
            history["train"] += [(s, float(loss)) for s, loss in pending]
            pending = []
            progress.set_postfix(loss=f"{history['train'][-1][1]:.3f}")
        if evaluating:
            eval_began = time.perf_counter()
            val_loss = evaluate(model, val_windows)
            history["eval"].append((step + 1, val_loss))
            tqdm.write(f"step {step + 1}: train {history['train'][-1][1]:.3f}, validation {val_loss:.3f} "
                       f"nats/byte ({val_loss / np.log(2):.3f} bits/byte)")
            save_checkpoint(manager, step + 1, model, optimizer)
            write_metrics(out / "metrics.json", backend, args, n_params, history)
            saved_step = step + 1
            excluded += time.perf_counter() - eval_began
    progress.close()
    timed_steps = args.steps - start - 1
    if timed_steps > 0:
        seconds = time.perf_counter() - began - excluded
        print(f"throughput: {timed_steps * args.batch * args.seq_len / seconds:,.0f} tokens/s "
              f"({seconds / timed_steps * 1e3:.1f} ms/step after compilation, evaluation excluded)")
    manager.wait_until_finished()

    # Restore into a model built from another seed (one in --seed's range): only the checkpoint can make it match.
    final_loss = evaluate(model, val_windows)
    restored_model = build_model(args, backend, args.seed ^ 1)
    restore_checkpoint(manager, saved_step, restored_model, build_optimizer(restored_model, args))
    restored_loss = evaluate(restored_model, val_windows)
    print(f"checkpoint {out / 'checkpoints'} step {saved_step}: restored model's validation loss "
          f"{restored_loss:.4f} vs {final_loss:.4f} trained")
    if not np.isclose(restored_loss, final_loss, rtol=1e-5):
        print("FAILED: the restored model does not reproduce the trained model")
        return 1

    samples = {name: sample_text(restored_model, args.prompt, args.sample_tokens, temperature=temperature,
                                 seed=args.seed)
               for name, temperature in (("greedy", 0.0), ("temperature 0.8", 0.8))}
    sample_report = "\n\n".join(f"--- {name} ---\n{text}" for name, text in samples.items())
    print(sample_report)

    write_atomically(out / "sample.txt", (sample_report + "\n").encode())
    save_pretrained(restored_model, out / "model")
    write_metrics(out / "metrics.json", backend, args, n_params, history)
    save_loss_curve(history, out / "loss_curve.png",
                    f"byte-level Mamba-2, {n_params / 1e6:.2f}M params, backend {backend}, {describe_device()}")
    print(f"wrote {out}/loss_curve.png, metrics.json, sample.txt and model/ "
          f"(python examples/generate.py --model-dir {out / 'model'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
