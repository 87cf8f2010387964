"""jax_mamba2._files.write_atomically: the old file or the whole new one, never a part; the umask's permissions."""
import os

import pytest

from jax_mamba2 import _files


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "cache.json"
    _files.write_atomically(path, b"old")

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(_files.os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        _files.write_atomically(path, b"new and longer")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_a_write_replaces_the_file_with_the_umask_s_permissions(tmp_path):
    path = tmp_path / "out.cubin"
    old_umask = os.umask(0o027)
    try:
        _files.write_atomically(path, b"first")
        _files.write_atomically(path, b"second")
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"second" and (path.stat().st_mode & 0o777) == 0o640
