"""Atomic writes of the files the package and its scripts leave for their users (tuning caches, exported cubins,
results, plots), and the atomic exchange of two directories that a checkpoint's save ends with."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import io
import os
import secrets
import stat
import sys
from pathlib import Path

# renameat2(2)'s flag that swaps the two names, and the directory fd that makes paths relative to the cwd.
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


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
    tmp = path.with_name(f".{short_name(path, 200)}.{secrets.token_hex(4)}.tmp")
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
    sync_directory(path.parent)
    return path


def short_name(path: Path, limit: int) -> str:
    """`path`'s name cut to at most `limit` bytes in the file system's encoding (a name of many non-ASCII
    characters is longer in bytes than in characters), for a sibling's name that must stay within 255."""
    return os.fsencode(path.name)[:limit].decode("utf-8", errors="ignore")


def fsync(path: Path) -> None:
    """Flushes the file or directory `path` to its storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_directory(directory: Path) -> None:
    """Makes the entries of `directory` (files renamed in or out) durable where the file system can sync a
    directory; some network ones cannot, and the renames stand all the same."""
    with contextlib.suppress(OSError):
        fsync(directory)


def exchange_paths(a: Path, b: Path) -> bool:
    """Swaps what `a` and `b` name (both must exist, on one file system) in one atomic step, Linux's
    `renameat2(RENAME_EXCHANGE)`: at no moment does either name stand empty, as it does between two renames.
    Returns False, having changed nothing, where that cannot be done here (another system, a C library without
    it, a file system that refuses the flag); raises OSError for any other failure."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), os.fspath(a), None, os.fspath(b))


@functools.cache
def _renameat2():
    """The C library's renameat2, or None (not Linux, or a C library older than glibc 2.28 or musl 1.2.2)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2")
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def save_figure(fig, path: Path, **savefig_kwargs) -> Path:
    """A matplotlib figure rendered in the format of `path`'s suffix (matplotlib's default format without one,
    or `format=`) and written with `write_atomically`. A PNG is stored with a palette of 256 colours (Pillow,
    which matplotlib needs anyway): a plot's few colours and their antialiased edges look the same at about a
    third of the RGBA file's bytes."""
    buffer = io.BytesIO()
    savefig_kwargs.setdefault("format", Path(path).suffix.lstrip(".").lower() or None)
    fig.savefig(buffer, **savefig_kwargs)
    if str(savefig_kwargs["format"]).lower() == "png":
        buffer = _palette_png(buffer.getvalue())
    return write_atomically(path, buffer.getvalue())


def _palette_png(png: bytes) -> io.BytesIO:
    """The PNG image `png` with its colours reduced to a 256-colour palette, without dithering."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, format="PNG", optimize=True)
    return out
