"""What every benchmark record repeats: GPU, driver, package versions, git revision, date."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional


def _command_output(cmd: list[str]) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(name: str) -> Optional[str]:
    """The installed distribution's version, else the importable module's __version__, else None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return getattr(__import__(name), "__version__", "unknown")
    except ImportError:
        return None


def environment() -> dict:
    """gpu, sm, driver, versions, git_sha, date: the fields every record repeats (initialises JAX's backend)."""
    import jax  # here, not at import: the benchmarks' drivers name their files without touching JAX

    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("jaxlib", "cuda-tile", "torch", "triton", "jla"):
        versions[name.replace("-", "_")] = _version(name)
    repo = Path(__file__).resolve().parents[1]
    git_sha = (os.environ.get("JAX_MAMBA2_GIT_SHA")
               or _command_output(["git", "-C", str(repo), "rev-parse", "HEAD"]) or "unknown")
    return {
        "gpu": device.device_kind,
        "sm": f"sm_{str(capability).replace('.', '')}" if capability else None,
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version",
                                   "--format=csv,noheader"]),
        "versions": versions,
        "git_sha": git_sha,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def exit_unless_cutile_runs(script: str) -> None:
    """Exits naming the reason where the cuTile kernels cannot run in this process (no GPU, no cuda-tile): a script
    that times them would otherwise end in a traceback or time XLA's fallback under the kernels' names."""
    from jax_mamba2 import backend_status
    status = backend_status()["cutile"]
    if not status.runnable:
        raise SystemExit(f"{script}: the cuTile kernels cannot run here: {status.reason}")


def gpu_slug(name: str) -> str:
    """The model of a GPU as results files name it: "NVIDIA H100 80GB HBM3" -> "h100"."""
    words = name.lower().replace("nvidia", "").split()
    return words[0] if words else "gpu"


def local_gpu_slug() -> str:
    """`gpu_slug` of this machine's first GPU as nvidia-smi names it, without initialising JAX (the benchmarks'
    drivers leave the GPU to their workers); "cpu" on a machine without one."""
    names = _command_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return gpu_slug(names.splitlines()[0]) if names else "cpu"
