"""What the whole-model benchmarks (lm_train.py, lm_decode.py) share.

- One process per measurement ("worker"): JAX and PyTorch each take the GPU's memory their own way, and a
  worker's peak memory is then its own. The driver starts `python SCRIPT --worker JOB.json` per job, with
  the job's extra environment (XLA_FLAGS), and reads back the record the worker wrote.
- The peers' source trees on sys.path (--mamba-ssm, --causal-conv1d) and what could be imported from them.
- Timing by wall clock after a warm-up by time, the device's measured bf16 matrix rate and copy bandwidth,
  records merged into one JSON file per benchmark (written atomically).

Nothing here imports JAX or torch at module level: a torch worker must not start JAX on the GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import glob
import gzip
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from benchmarks.environment import local_gpu_slug

REPO = Path(__file__).resolve().parents[1]
# mamba_ssm's Mamba2 module and its fused add + RMSNorm: what the PyTorch peer LM is built from.
MAMBA_SSM_MODULES = ("mamba_ssm.modules.mamba2", "mamba_ssm.ops.triton.layer_norm")
# The H200's bf16 dense matrix rate as measured on this project's machine (benchmarks/ssd.py's figure).
NOMINAL_BF16_TFLOPS = 790.0
# The square bf16 matrix product timed for the measured rate: 2 * 8192^3 FLOPs, about 2 ms on an H200.
MATMUL_SIZE = 8192
# Bytes copied device to device for the measured bandwidth (1 GiB: far beyond the 50 MB L2).
COPY_BYTES = 1 << 30

# XLA's command buffers (CUDA graphs) per process, as XLA_FLAGS: as XLA defaults them, off, or extended to
# loops and conditionals (the decode loop; the layer scan and the loss's chunk loops of a training step), which
# otherwise run from the host between graphs (a conditional reads its predicate back first).
# "host_custom_calls" keeps XLA's defaults but launches every custom call (ours) from the host: XLA forms its
# command buffers from the program's thunks after the HLO, so no HLO text says which launches it records, and
# "host_custom_calls" against "default" measures what recording ours saves.
COMMAND_BUFFER_FLAGS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "loop": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1",
    "host_custom_calls": "--xla_gpu_enable_command_buffer=-CUSTOM_CALL",
}
# The same settings as compile options, which take no "+"/"-" edits of XLA's default command kinds: every kind,
# loops and conditionals included, and the defaults less CUSTOM_CALL.
_DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")
RECORD_EVERY_COMMAND = {"xla_gpu_enable_command_buffer": ",".join(_DEFAULT_COMMANDS + ("WHILE", "CONDITIONAL"))}
RECORD_HOST_CUSTOM_CALLS = {"xla_gpu_enable_command_buffer": ",".join(c for c in _DEFAULT_COMMANDS
                                                                      if c != "CUSTOM_CALL")}
_KERNEL_NAME = re.compile(r'function_name\s*=\s*\\?"([^"\\]+)')


def cutile_launches(hlo_text: str, target: str) -> list[str]:
    """The kernel symbol of every custom call to `target` (a cuTile launch target) in an HLO module's text, in the
    order of the text."""
    return [_KERNEL_NAME.search(line).group(1) for line in hlo_text.splitlines()
            if f'custom_call_target="{target}"' in line]


def command_buffer_env(buffers: str) -> dict:
    """The worker environment of a command-buffer setting: XLA_FLAGS with its flags appended ({} for none)."""
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), COMMAND_BUFFER_FLAGS[buffers]]))
    return {"XLA_FLAGS": flags} if flags else {}


def git_sha() -> str:
    """JAX_MAMBA2_GIT_SHA (the device copy of the tree has no .git), else `git rev-parse HEAD`."""
    if os.environ.get("JAX_MAMBA2_GIT_SHA"):
        return os.environ["JAX_MAMBA2_GIT_SHA"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------------------------
# Peers
# ----------------------------------------------------------------------------------------------

def add_peer_paths(mamba_ssm: Optional[Path], causal_conv1d: Optional[Path]) -> None:
    """Puts the peers' directories first on sys.path (each holds the package folder of that name)."""
    for path in (causal_conv1d, mamba_ssm):
        if path is not None:
            sys.path.insert(0, str(Path(path).resolve()))


def mamba_ssm_unavailable_reason() -> Optional[str]:
    """None when mamba_ssm's Mamba2 module and fused add + RMSNorm import here, else why not."""
    for module in MAMBA_SSM_MODULES:
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001  any failure (missing torch, triton, CUDA) means: not runnable
            return f"cannot import {module}: {type(e).__name__}: {e}"
    return None


def causal_conv1d_version() -> Optional[str]:
    """The importable causal_conv1d's version (its CUDA extension loads), else None."""
    try:
        import causal_conv1d
        importlib.import_module("causal_conv1d_cuda")  # the compiled extension mamba_ssm's fused path calls
    except Exception:  # noqa: BLE001
        return None
    return getattr(causal_conv1d, "__version__", "unknown")


# ----------------------------------------------------------------------------------------------
# Timing and device rates
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepTiming:
    """Wall milliseconds of synchronised calls after the warm-up; with `pipelined`, also of calls back to back."""

    ms_median: float
    ms_p20: float
    ms_p80: float
    ms_min: float
    steps: int
    first_call_s: float   # the first call: compilation, autotuning
    warmup_s: float
    warmup_calls: int
    # The median over rounds of the mean of `pipelined` calls issued back to back with one sync at the end (a
    # training loop that does not wait for each step): the host's dispatch of one call overlaps the device's work
    # on the one before. None when not measured.
    ms_pipelined: Optional[float] = None


# Rounds of back-to-back calls whose median is StepTiming.ms_pipelined.
PIPELINED_ROUNDS = 3


def time_calls(call: Callable[[], Any], sync: Callable[[Any], Any], *, steps: int,
               warmup_seconds: float, pipelined: int = 0) -> StepTiming:
    """Times `steps` calls of `call`, each followed by `sync(result)`, after one untimed first call and
    `warmup_seconds` of untimed calls (the GPU's clocks idle low after a compilation; see ssd.WARMUP_S); then,
    with `pipelined` > 0, PIPELINED_ROUNDS rounds of that many calls back to back (ms_pipelined)."""
    import numpy as np

    began = time.perf_counter()
    sync(call())
    first_call_s = time.perf_counter() - began
    began, warmup_calls = time.perf_counter(), 0
    while time.perf_counter() - began < warmup_seconds:
        sync(call())
        warmup_calls += 1
    samples = []
    for _ in range(steps):
        began = time.perf_counter()
        sync(call())
        samples.append((time.perf_counter() - began) * 1e3)
    p20, median, p80 = np.percentile(samples, [20, 50, 80])
    pipelined_ms = _median_ms(call, sync, repeats=PIPELINED_ROUNDS, calls=pipelined) if pipelined else None
    return StepTiming(float(median), float(p20), float(p80), float(min(samples)), steps, first_call_s,
                      warmup_seconds, warmup_calls, pipelined_ms)


def _trace_kernels(trace_dir: str) -> list:
    """(name, start_us, duration_us) of the GPU kernels in the Perfetto trace under trace_dir."""
    from benchmarks.tools import kernel_profile
    paths = glob.glob(f"{trace_dir}/plugins/profile/*/perfetto_trace.json.gz")
    if not paths:
        return []
    return kernel_profile.trace_kernels(json.loads(gzip.decompress(Path(paths[0]).read_bytes())))


def profile_calls(call: Callable[[], Any], hlo_text: str, calls: int, top: int = 15) -> dict:
    """The GPU kernels of `calls` calls of a compiled JAX program under jax.profiler, per call and folded into
    categories (benchmarks/kernel_categories.py), with the `top` kernels by time; `hlo_text` is the program's
    `compiled.as_text()`."""
    import jax

    with tempfile.TemporaryDirectory(prefix="lm_bench_trace_") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        kernels = _trace_kernels(trace_dir)
    return _profile_record("jax.profiler trace (CUPTI)", kernels, hlo_text, calls, top)


def _profile_record(source: str, kernels: list, hlo_text: str, calls: int, top: int) -> dict:
    """A profile's record: where its kernels came from, launches per call, and `kernel_categories.fold` of them."""
    from benchmarks import kernel_categories

    return {"source": source, "kernel_launches": len(kernels) / calls,
            **kernel_categories.fold(kernels, hlo_text, calls, top=top)}


def profile_torch_calls(call: Callable[[], Any], sync: Callable[[Any], Any], calls: int, top: int = 15) -> dict:
    """`profile_calls` for a PyTorch step on a CUDA device: its kernels under torch.profiler (CUPTI), folded into
    the same categories by their names (no compiled module: `kernel_categories` names mamba_ssm's, causal_conv1d's
    and ATen's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.tools import kernel_profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            sync(call())
    with tempfile.TemporaryDirectory(prefix="lm_bench_torch_trace_") as trace_dir:
        path = Path(trace_dir) / "trace.json"
        prof.export_chrome_trace(str(path))
        kernels = kernel_profile.torch_trace_kernels(json.loads(path.read_text()))
    return _profile_record("torch.profiler trace (CUPTI)", kernels, "", calls, top)


def _median_ms(call: Callable[[], Any], sync: Callable[[Any], Any], repeats: int = 10, calls: int = 10) -> float:
    """Median over `repeats` samples of the mean ms of `calls` back-to-back calls (one sync per sample)."""
    import numpy as np
    sync(call())
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        results = [call() for _ in range(calls)]
        sync(results[-1])
        samples.append((time.perf_counter() - began) * 1e3 / calls)
    return float(np.median(samples))


# Off the GPU (a CPU check of the benchmarks) the rates are measured on small arrays, in seconds.
SMALL_MATMUL_SIZE, SMALL_COPY_BYTES = 256, 1 << 22


def jax_device_rates() -> dict:
    """This process's GPU as JAX sees it: the bf16 matrix rate of a large jnp.dot (TFLOP/s) and the
    bandwidth of a device-to-device copy (GB/s, bytes read + written)."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    matmul_size, copy_bytes = (MATMUL_SIZE, COPY_BYTES) if on_gpu else (SMALL_MATMUL_SIZE, SMALL_COPY_BYTES)

    a, b = (jax.random.normal(jax.random.key(i), (matmul_size, matmul_size), jnp.bfloat16) for i in (0, 1))
    matmul = jax.jit(jnp.dot)  # bf16 in and out; the GPU's matrix units accumulate in float32
    matmul_ms = _median_ms(lambda: matmul(a, b), jax.block_until_ready)
    src = jnp.ones((copy_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 0.0 * x[0])  # one full read and write; XLA cannot elide it
    copy_ms = _median_ms(lambda: copy(src), jax.block_until_ready)
    return {"matmul_tflops": 2 * matmul_size ** 3 / (matmul_ms * 1e-3) / 1e12, "matmul_size": matmul_size,
            "copy_gbps": 2 * copy_bytes / (copy_ms * 1e-3) / 1e9, "copy_bytes": copy_bytes}


def torch_device_rates(device) -> dict:
    """As `jax_device_rates`, measured with torch on `device`."""
    import torch

    on_gpu = device.type == "cuda"
    matmul_size, copy_bytes = (MATMUL_SIZE, COPY_BYTES) if on_gpu else (SMALL_MATMUL_SIZE, SMALL_COPY_BYTES)
    sync = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)
    a, b = (torch.randn(matmul_size, matmul_size, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = _median_ms(lambda: a @ b, sync)
    src = torch.ones(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), sync)
    return {"matmul_tflops": 2 * matmul_size ** 3 / (matmul_ms * 1e-3) / 1e12, "matmul_size": matmul_size,
            "copy_gbps": 2 * copy_bytes / (copy_ms * 1e-3) / 1e9, "copy_bytes": copy_bytes}


def jax_peak_bytes() -> Optional[int]:
    """The JAX allocator's peak bytes in use on device 0 since the process started (None where the backend
    keeps no statistics, e.g. the CPU)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ----------------------------------------------------------------------------------------------
# Workers and records
# ----------------------------------------------------------------------------------------------

def run_worker(script: Path, job: dict, *, env: Optional[dict] = None, timeout_s: float = 600) -> dict:
    """Runs `python SCRIPT --worker JOB.json` and returns the record it wrote; a worker that fails, times out
    or writes nothing becomes {**job, "error": what happened}."""
    with tempfile.TemporaryDirectory(prefix="lm_bench_") as tmp:
        job_file, record_file = Path(tmp) / "job.json", Path(tmp) / "record.json"
        job_file.write_text(json.dumps({**job, "record_file": str(record_file)}))
        command = [sys.executable, str(script), "--worker", str(job_file)]
        began = time.perf_counter()
        try:
            result = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                                    timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return {**job, "error": f"worker timed out after {timeout_s:.0f} s", "log_tail": _tail(e.stderr)}
        if record_file.is_file():
            record = json.loads(record_file.read_text())
        else:
            record = {**job, "error": f"worker exited {result.returncode} without a record"}
        record.setdefault("error", None)
        record["worker_wall_s"] = time.perf_counter() - began
        if record["error"] is not None or result.returncode != 0:
            record["log_tail"] = _tail(result.stderr) + _tail(result.stdout)
        return record


def _tail(text, chars: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]


def worker_main(argv: list[str], work: Callable[[dict], dict], ours: Collection[str]) -> bool:
    """If argv is `--worker JOB.json`: runs `work(job)`, then measures the GPU's rates (`jax_device_rates` where
    the job's impl is among `ours`, else `torch_device_rates`: after `work` has returned and a garbage
    collection, so its model and state are freed), and writes the record (or the error raised) where the job
    says; returns True. Otherwise returns False (the caller is the driver)."""
    if len(argv) != 2 or argv[0] != "--worker":
        return False
    job = json.loads(Path(argv[1]).read_text())
    record_file = Path(job.pop("record_file"))
    try:
        record = {**job, **work(job)}
        gc.collect()
        if job["impl"] not in ours:
            import torch

            record["device_rates"] = torch_device_rates(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        else:
            record["device_rates"] = jax_device_rates()
        record["error"] = None
    except Exception as e:  # noqa: BLE001  the record says what failed (an out-of-memory, a missing peer)
        import traceback
        traceback.print_exc()
        record = {**job, "error": f"{type(e).__name__}: {e}"[:2000]}
    write_json(record_file, record)
    return True


def write_json(path: Path, data) -> Path:
    """Writes `data` as JSON through a temporary file and a rename: readers see the old or the new file."""
    from jax_mamba2._files import write_atomically

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, (json.dumps(data, indent=1, sort_keys=True, default=str) + "\n").encode())
    return path


def results_path(out: Path, benchmark: str) -> Path:
    """out / "<benchmark>_<gpu>.json": the results file of a benchmark, named after this machine's GPU model."""
    return Path(out) / f"{benchmark}_{local_gpu_slug()}.json"


def merge_results(path: Path, benchmark: str, records: list[dict], key: Callable[[dict], tuple],
                  combine: Optional[Callable[[dict, dict], dict]] = None) -> dict:
    """The results file at `path` with `records` added, written back; returns its content. A record replaces an
    earlier one of the same key measured at the same commit (a grid run over several device calls stays one
    file; with `combine` the earlier one becomes `combine(earlier, new)` instead); records of other commits are
    kept, in the order they were added, since the docs cite them (readers take a measurement's latest)."""
    def full_key(record):
        return (*key(record), (record.get("environment") or {}).get("git_sha"))

    path = Path(path)
    old = json.loads(path.read_text())["records"] if path.is_file() else []
    merged = {full_key(r): r for r in old}
    for record in records:
        earlier = merged.get(full_key(record))
        merged[full_key(record)] = record if combine is None or earlier is None else combine(earlier, record)
    results = {"benchmark": benchmark, "git_sha": git_sha(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "records": list(merged.values())}
    write_json(path, results)
    return results


# ----------------------------------------------------------------------------------------------
# Command line and figures
# ----------------------------------------------------------------------------------------------

def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the script's docstring (its first line, then the rest as written)."""
    return argparse.ArgumentParser(description=doc.split("\n", 1)[0], epilog=doc.split("\n", 2)[2],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mamba-ssm", type=Path, help="directory holding the mamba_ssm package (source tree)")
    parser.add_argument("--causal-conv1d", type=Path,
                        help="directory holding a built causal_conv1d (its CUDA kernels for mamba_ssm)")


def peer_paths(args) -> dict:
    """The peers' directories of parsed arguments, as a job's fields."""
    return {"mamba_ssm": str(args.mamba_ssm) if args.mamba_ssm else None,
            "causal_conv1d": str(args.causal_conv1d) if args.causal_conv1d else None}


def save_figure(fig, path: Path, title: str, records: list[dict], bottom: float = 0.0) -> Path:
    """Titles `fig` with `title` and the GPU the records ran on, writes it to `path` and closes it; `bottom`:
    the fraction of the height kept below the axes (for a figure legend)."""
    import matplotlib.pyplot as plt

    from jax_mamba2 import _files

    gpu = next((r["environment"].get("gpu") or r["environment"].get("device") for r in records
                if r.get("environment")), "")
    fig.suptitle(f"{title}, {gpu}" if gpu else title, fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    _files.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return Path(path)
