"""A directory written into place atomically (a checkpoint's save): filled under a staging name beside it, then
exchanged with the old one in one step where the system can. Staging directories that a killed save left behind are
found by their names (host and PID) and their lock files, and deleted by the next save on that host."""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
import shutil
import socket
import stat

try:
    import fcntl
except ImportError:  # Windows: abandoned staging directories are told by their writer's PID alone
    fcntl = None

from jax_mamba2._files import exchange_paths, short_name, sync_directory


def _sibling_path(path: pathlib.Path, kind: str) -> pathlib.Path:
    """A fresh hidden name beside `path` (same file system, so renames between them are atomic), naming the
    host and process that writes it."""
    return path.with_name(f".{_short_name(path)}.{kind}-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}")


def _short_name(path: pathlib.Path) -> str:
    """`path`'s name cut so that a sibling's name stays within the file system's 255 bytes."""
    return short_name(path, 120)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:64] or "host"


# The staging directories this process's saves hold now. Their locks do not guard them against this process
# itself: where a network file system emulates flock with POSIX record locks, those belong to the process, so a
# cleanup in another thread would take them, and closing its descriptor would drop them.
_LIVE_STAGING: set[str] = set()


@contextlib.contextmanager
def staging_dir(path: pathlib.Path):
    """A new staging directory beside `path` for the body to fill and rename into place, locked against
    `remove_abandoned_staging` until the body is done, and deleted if the body raises."""
    staging, lock = _new_locked_staging_name(path)
    _LIVE_STAGING.add(staging.name)
    try:
        os.mkdir(staging)  # mode from the umask (tempfile.mkdtemp would make it private)
        try:
            yield staging
        except BaseException:
            _remove_tree(staging)
            raise
    finally:
        _unlock_staging(staging, lock)
        _LIVE_STAGING.discard(staging.name)


def _lock_path(staging: pathlib.Path) -> pathlib.Path:
    """The lock file of a staging directory: beside it, not in it, so that it is never renamed into place
    with the checkpoint, and it stays locked until the directory is gone."""
    return staging.with_name(staging.name + ".lock")


def _new_locked_staging_name(path: pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """A fresh staging name beside `path` and the descriptor that holds its lock file locked (None where
    there is no lock: no `fcntl`, or a file system without `flock`, which leaves the PID rule).

    The lock file comes before the directory, so that a live save's directory always has one."""
    for _ in range(3):
        staging = _sibling_path(path, "tmp")
        if fcntl is None:
            return staging, None
        lock = _lock_path(staging)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return staging, fd
        except (BlockingIOError, FileNotFoundError):
            # Another save, cleaning up, took the new file for an abandoned one in the instant before our lock
            # (and deletes it): the directory would go unlocked, so take another name.
            pass
        except OSError:
            os.close(fd)
            lock.unlink(missing_ok=True)
            return staging, None
        os.close(fd)
    return _sibling_path(path, "tmp"), None  # raced every time (a file system whose flock misbehaves): no lock


def _unlock_staging(staging: pathlib.Path, lock: int | None) -> None:
    """Releases a staging directory's lock once the save is done with it."""
    if lock is None:
        return
    # A directory still there (its deletion failed) keeps its lock file, unlocked from now, so that the next save
    # deletes it whatever its PID field says.
    if not os.path.lexists(staging):
        _lock_path(staging).unlink(missing_ok=True)
    os.close(lock)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_abandoned_staging(path: pathlib.Path) -> None:
    """Deletes the staging directories (and their lock files) beside `path` that a save killed mid-way left
    behind on this host. The `.old-*` directories are kept: they hold a complete previous checkpoint.

    Only this host's are looked at: another host's may be in use, and `flock` need not reach across a network
    file system."""
    pattern = re.compile(rf"(\.{re.escape(_short_name(path))}\.tmp-{re.escape(_host_tag())}-(\d+)-[0-9a-f]{{8}})"
                         r"(\.lock)?")
    writers = {}  # staging name -> its writer's PID, for the directories and for lock files left alone
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match:
            writers[match.group(1)] = int(match.group(2))
    for name, pid in writers.items():
        if name not in _LIVE_STAGING:
            _remove_if_abandoned(path.parent / name, pid)


def _remove_if_abandoned(staging: pathlib.Path, pid: int) -> None:
    """Deletes `staging` and its lock file if no save holds the lock. A directory without a lock file (from a
    version that wrote none, or a system without `fcntl`) is deleted if process `pid` is gone; a PID may name
    another process in another PID namespace, which is why the lock is asked first."""
    if fcntl is None:
        _remove_if_writer_dead(staging, pid)
        return
    lock = _lock_path(staging)
    try:
        # Opened for writing: NFS emulates `flock` with byte-range locks, which need it for an exclusive lock.
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        _remove_if_writer_dead(staging, pid)
        return
    except OSError:  # another user's lock file: not ours to judge
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held, so its save runs (or a file system without flock, which cannot tell): keep it
        os.close(fd)
        return
    try:
        if staging.is_dir():
            _remove_tree(staging)
        if not os.path.lexists(staging):  # else the lock file stays, for a later save to try again
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _remove_if_writer_dead(staging: pathlib.Path, pid: int) -> None:
    if staging.is_dir() and not _process_alive(pid):
        _remove_tree(staging)


def carry_over(source: pathlib.Path, target: pathlib.Path, *, skip: re.Pattern) -> None:
    """Hard-links (or copies) every entry of directory `source` whose name `skip` does not match into directory
    `target`."""
    for entry in source.iterdir():
        if skip.fullmatch(entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, target / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target / entry.name)


def _link_or_copy(source, target) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def replace_dir(new: pathlib.Path, path: pathlib.Path) -> None:
    """Puts directory `new` at `path`. An existing `path` is exchanged with `new` in one atomic step where the
    system can (then deleted under `new`'s name); elsewhere it is first renamed aside and deleted only once
    `new` is in place (renamed back if that fails). Either way `path` never holds a mix of both."""
    if not path.exists():
        os.replace(new, path)
    elif exchange_paths(new, path):
        _remove_tree(new)  # the previous checkpoint, now under the staging name
    else:
        old = _sibling_path(path, "old")
        os.replace(path, old)
        try:
            os.replace(new, path)
        except BaseException:
            os.replace(old, path)
            raise
        # The new checkpoint is in place: what follows cannot undo the save, so it does not fail it.
        _remove_tree(old)
    sync_directory(path.parent)  # make the renames durable


def _remove_tree(directory: pathlib.Path) -> None:
    """Deletes `directory` and what it holds, whatever the modes of its directories (a save keeps a read-only
    checkpoint directory's mode, and carries over its subdirectories with theirs, whose entries could not be
    unlinked otherwise); what still cannot be deleted stays. A symlink is left alone, target and all."""
    if os.path.islink(directory):
        return
    _open_up(directory)
    for root, subdirectories, _ in os.walk(directory):  # top down: each opened up before it is listed
        for name in subdirectories:
            if not os.path.islink(os.path.join(root, name)):
                _open_up(os.path.join(root, name))
    shutil.rmtree(directory, ignore_errors=True)


def _open_up(directory) -> None:
    """Gives the owner read, write and search permission on `directory` (not through a symlink), where it can."""
    with contextlib.suppress(OSError):
        os.chmod(directory, stat.S_IMODE(os.lstat(directory).st_mode) | stat.S_IRWXU)
