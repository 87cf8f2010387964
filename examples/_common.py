"""What every example shares: choosing and announcing the SSD backend, the output folder and its atomic writes
(`write_atomically`, `save_figure`: a reader or a killed run never leaves half a file), timing.

Imported by the example scripts as a sibling module (`python examples/NAME.py` puts examples/ on sys.path).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

import jax_mamba2
from jax_mamba2._files import save_figure, write_atomically  # noqa: F401 (for the examples)
from jax_mamba2.checks import INT32_MAX

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "out"


def cutile_unavailable_reason() -> str | None:
    """None when the cuTile kernels can run in this process, else why not (one sentence)."""
    return jax_mamba2.backend_status()["cutile"].reason


def resolve_backend(requested: str) -> str:
    """The concrete SSD backend for `requested`, announced on stdout.

    "auto" becomes "cutile" where the kernels can run and "xla" elsewhere. The examples pass the
    concrete name on to the model, so a shape the kernels do not support raises instead of silently
    running the xla path.
    """
    if requested != "auto":
        status = jax_mamba2.backend_status()[requested]
        if not status.runnable:
            raise SystemExit(f"--backend {requested} cannot run here: {status.reason}")
        print(f"SSD backend: {requested} (requested)")
        return requested
    reason = cutile_unavailable_reason()
    if reason is None:
        print("SSD backend: cutile (auto: cuTile kernels on the GPU)")
        return "cutile"
    print(f"SSD backend: xla (auto: {reason}; falling back to the chunked pure-JAX path)")
    return "xla"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with the description's line breaks kept (its command lines) and every flag's default shown."""


def make_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the example's module docstring (with its GPU command) and
    every flag's help text with its default."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_common_flags(parser: argparse.ArgumentParser, *, backend: bool = True) -> None:
    """--out and --seed for every example, and --backend unless `backend` is False."""
    if backend:
        parser.add_argument("--backend", choices=("auto", *jax_mamba2.backend_status()), default="auto",
                            help="SSD backend; auto = cutile on a CUDA GPU, else xla")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help="folder for plots, checkpoints and JSON")
    parser.add_argument("--seed", type=seed, default=0, help="random seed, an int in [0, 2**63 - 1]")


def settings(args: argparse.Namespace) -> dict:
    """A run's flags as JSON values for its results file: numbers, bools and strings as they are, paths as text."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in vars(args).items()}


def output_dir(path: pathlib.Path) -> pathlib.Path:
    """Creates `path` (and its parents) and returns it; a path that cannot be a folder ends the run naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out: cannot make the folder {path} ({e.strerror})") from None
    return path


@contextlib.contextmanager
def model_flags(*flags: str):
    """Around building a model from command-line `flags`: the package's argument errors (a ValueError or
    TypeError naming what does not fit, e.g. a headdim that does not divide the width) end the run in one line,
    as argparse reports its own, rather than in a traceback."""
    try:
        yield
    except (ValueError, TypeError) as error:
        raise SystemExit(f"{' / '.join(flags)} do not make a model: {error}") from None


def int_in(low: int, high: int | None, requirement: str) -> Callable[[str], int]:
    """argparse type of an int in [low, high] (no upper bound for None); the error says `requirement`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} must be {requirement}")
        return value
    parse.__name__ = "int"  # argparse names the type in "invalid int value: ..."
    return parse


MAX_SEED = 2**63 - 1  # JAX makes its keys from int64 seeds (NumPy's generators take non-negative ones)
# Sizes and counts; --seed (the examples derive other seeds from it as seed ^ 1, which stays in its range); token ids.
positive_int = int_in(1, None, "a positive int")
seed = int_in(0, MAX_SEED, "an int in [0, 2**63 - 1] (JAX makes its keys from int64 seeds)")
token_id = int_in(0, None, "a token id, an int >= 0")
# The sizes of array axes (JAX indexes and counts in int32): --batch; and the lengths that one token more makes an
# axis of (a training window's next-byte target, a prompt of at least one token before the new tokens).
axis_size = int_in(1, INT32_MAX, "a positive int of at most 2**31 - 1 (an array axis)")
sequence_length = int_in(1, INT32_MAX - 1, "a positive int of at most 2**31 - 2 (with one token more, an array axis)")


def prompt_bytes(prompt: str) -> bytes:
    """The bytes of --prompt as given: its text's UTF-8, and each byte of the command line that is not UTF-8 as that
    byte (Python hands such a byte of argv to the program as a lone surrogate, U+DC80 to U+DCFF, which UTF-8 alone
    cannot encode).

    Raises:
      UnicodeEncodeError: for another lone surrogate (one that no byte of a command line gives).
    """
    return prompt.encode("utf-8", errors="surrogateescape")


def in_range(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type of a finite float in [low, high] (low excluded with low_open; high=inf: no upper bound)."""
    def parse(text: str) -> float:
        value = float(text)
        if not ((low < value) if low_open else (low <= value)) or not value <= high or not math.isfinite(value):
            upper = "inf)" if math.isinf(high) else f"{high}]"
            raise argparse.ArgumentTypeError(f"{value} must be a finite number in {'(' if low_open else '['}{low}, "
                                             f"{upper}")
        return value
    parse.__name__ = "float"  # argparse names the type in "invalid float value: ..."
    return parse


def power_of_two(text: str) -> int:
    """argparse type of chunk lengths: a power of two."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} must be a power of two")
    return value


def describe_device() -> str:
    device = jax.devices()[0]
    return f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}"


class Timing(NamedTuple):
    """Wall-clock milliseconds of one call: median and 20th/80th percentiles."""

    median_ms: float
    p20_ms: float
    p80_ms: float


def time_call(fn: Callable, *args, repeats: int = 10, warmup_s: float = 1.0) -> Timing:
    """Times `fn(*args)`, waiting for the results each time, after one untimed call (compilation) and
    `warmup_s` seconds of untimed calls: a GPU left idle by the compilation runs at low clocks for up to a
    second of load (docs/experiments.md, "Measuring")."""
    jax.block_until_ready(fn(*args))
    warm_until = time.perf_counter() + warmup_s
    while time.perf_counter() < warm_until:
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    p20, median, p80 = np.percentile(samples, [20, 50, 80])
    return Timing(float(median), float(p20), float(p80))
