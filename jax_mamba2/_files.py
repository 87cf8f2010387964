"""Atomic writes of the files the package and its scripts leave for their users (tuning caches, exported cubins,
results, plots)."""
from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> Path:
    """Writes `data` to `path` through a temporary file beside it, synced and then renamed over it (the directory
    synced after): a reader, or a process killed mid-write, sees the old file or the whole new one, never a part.
    A symlink is written through to its target; a new file gets the permissions the umask leaves, a replaced one
    keeps its own. Returns the path written (the symlink's target).

    Raises:
      FileNotFoundError: naming `path`, when its directory does not exist.
    """
    path = Path(os.path.realpath(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: its directory does not exist")
    tmp = path.with_name(f".{path.name[:200]}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask to 0666, as open() does for any user file (mkstemp would make it 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f.fileno(), stat.S_IMODE(path.stat().st_mode))
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def save_figure(fig, path: Path, **savefig_kwargs) -> Path:
    """A matplotlib figure rendered in the format of `path`'s suffix (matplotlib's default format without one,
    or `format=`) and written with `write_atomically`."""
    buffer = io.BytesIO()
    savefig_kwargs.setdefault("format", Path(path).suffix.lstrip(".").lower() or None)
    fig.savefig(buffer, **savefig_kwargs)
    return write_atomically(path, buffer.getvalue())
