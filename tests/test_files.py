"""jax_mamba2._files: the old file or the whole new one, never a part; permissions, symlinks, a missing directory;
figures in their suffix's format."""
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


def test_a_new_file_gets_the_umask_s_permissions_and_a_replaced_one_keeps_its_own(tmp_path):
    new, kept = tmp_path / "out.cubin", tmp_path / "kept.json"
    kept.write_bytes(b"old")
    kept.chmod(0o664)
    old_umask = os.umask(0o077)
    try:
        _files.write_atomically(new, b"first")
        _files.write_atomically(kept, b"second")
    finally:
        os.umask(old_umask)
    assert (new.stat().st_mode & 0o777) == 0o600 and (kept.stat().st_mode & 0o777) == 0o664
    assert kept.read_bytes() == b"second"


def test_a_symlink_is_written_through_and_a_missing_directory_is_named(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert _files.write_atomically(link, b"new") == target
    assert link.is_symlink() and target.read_bytes() == b"new"
    with pytest.raises(FileNotFoundError, match=r"cannot write .*missing/out.json: its directory does not exist"):
        _files.write_atomically(tmp_path / "missing" / "out.json", b"x")


def test_a_long_non_ascii_name_is_replaced_where_its_directory_cannot_be_synced(tmp_path, monkeypatch):
    """The temporary name beside a 255-byte name (125 two-byte characters) stays within 255 bytes; a file system
    that cannot sync a directory does not fail a write that has happened."""
    path = tmp_path / ("\u00e9" * 125 + ".json")
    path.write_bytes(b"old")
    _files.write_atomically(path, b"new")
    real_fsync = _files.fsync

    def fsync_files_only(target):
        if os.path.isdir(target):
            raise OSError(22, "Invalid argument")
        real_fsync(target)
    monkeypatch.setattr(_files, "fsync", fsync_files_only)
    _files.write_atomically(path, b"newer")
    assert path.read_bytes() == b"newer" and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("name,magic", [("plot.png", b"\x89PNG"), ("plot.SVG", b"<?xml"), ("plot.pdf", b"%PDF")])
def test_a_figure_is_written_in_its_suffix_s_format(tmp_path, name, magic):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = _files.save_figure(fig, tmp_path / name, dpi=50)
    plt.close(fig)
    assert path.read_bytes().startswith(magic)


def test_a_png_figure_is_stored_with_a_palette_and_keeps_its_colours(tmp_path):
    """save_figure stores a PNG in 256 palette colours: the plot's pure colours come back exactly."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.bar([0, 1], [1, 2], color=["#ff0000", "#0000ff"])
    path = _files.save_figure(fig, tmp_path / "plot.png", dpi=50)
    plt.close(fig)
    image = Image.open(path)
    assert image.mode == "P"
    colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=256)}
    assert {(255, 0, 0), (0, 0, 255), (255, 255, 255)} <= colours
