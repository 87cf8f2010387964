"""Atomic writes of the files the package and its scripts leave for their users (tuning caches, exported cubins,
results, plots)."""
from __future__ import annotations

import contextlib
import io
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file beside it, synced and then renamed over it: a reader (or a
    process killed mid-write) sees the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask to 0666, as open() does for any user file (mkstemp would make it 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_figure(fig, path: Path, **savefig_kwargs) -> Path:
    """A matplotlib figure rendered in the format of `path`'s suffix and written with `write_atomically`."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)
    write_atomically(path, buffer.getvalue())
    return path
