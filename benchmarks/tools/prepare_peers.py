"""Lays out the peers the benchmarks compare with in a git-ignored folder (default .peers), from source checkouts of
state-spaces/mamba and Dao-AILab/causal-conv1d, each a work tree or a bare repository (a mirror, read at its HEAD),
and optionally a jax-linear-attention wheel. Nothing of theirs is ever committed here; benchmarks/README.md
("Setting up the GPU machine") says what each peer is for.

    python benchmarks/tools/prepare_peers.py --mamba ~/src/mamba --causal-conv1d ~/src/causal-conv1d \\
        [--jla-wheel jax_linear_attention-0.1.0-py3-none-any.whl] [--out .peers]

- OUT/mamba_ssm: mamba_ssm's Triton ops and utils, its `Mamba2` module and the tensor-parallel helpers that module
  imports, under empty package `__init__` files (mamba_ssm's own imports CUDA extensions no benchmark builds).
- OUT/cc: causal_conv1d's source, its setup.py building for sm_90 alone and its kernels instantiated for float32
  and bfloat16 only (every benchmark runs those two; fewer instantiations shorten the build, which
  `gpu_session.sh` runs on the GPU machine in the background of the parts that need it).
- OUT/jla: the `jla` package of the wheel, with --jla-wheel.

Then carry OUT to the GPU machine with the toolchain (the device call's `carry`), e.g. `--mamba-ssm .peers --jla
.peers --causal-conv1d /tmp/ccsite` for the benchmarks.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

# What the benchmarks import of each source tree (folders are taken whole).
MAMBA_PATHS = ("mamba_ssm/ops/triton", "mamba_ssm/utils", "mamba_ssm/modules/mamba2.py", "mamba_ssm/distributed")
MAMBA_EMPTY_INITS = ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton", "mamba_ssm/modules")
CAUSAL_CONV1D_PATHS = ("causal_conv1d", "csrc", "setup.py", "pyproject.toml", "README.md", "LICENSE", "AUTHORS",
                       "MANIFEST.in")
# setup.py's line before which the architectures are replaced (the last edit of cc_flag before the build uses it).
SETUP_ANCHOR = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
SM90_ONLY = ('    cc_flag = [f for f in cc_flag if f != "-gencode" and not f.startswith("arch=")] '
             '+ ["-gencode", "arch=compute_90,code=sm_90"]\n')
# A dispatch macro's float16 branch: `if (T == at::ScalarType::Half) { using t = at::Half; __VA_ARGS__(); } else if`,
# each line ending in a continuation backslash.
HALF_BRANCH = re.compile(r"if \((\w+) == at::ScalarType::Half\) \{\s*\\\n\s*using \w+ = at::Half;\s*\\\n"
                         r"\s*__VA_ARGS__\(\);\s*\\\n\s*\} else if")


def sm90_only(setup_py: str) -> str:
    """causal_conv1d's setup.py with its -gencode list replaced by sm_90 alone."""
    if setup_py.count(SETUP_ANCHOR) != 1:
        raise ValueError(f"prepare_peers: causal_conv1d's setup.py has no line {SETUP_ANCHOR.strip()!r} to insert "
                         "the sm_90 architecture before (a newer layout: edit it by hand)")
    return setup_py.replace(SETUP_ANCHOR, SM90_ONLY + SETUP_ANCHOR)


def without_half_dispatch(source: str) -> str:
    """causal_conv1d.cpp with the float16 branch of each dtype dispatch macro removed (its instantiations go too)."""
    patched, count = HALF_BRANCH.subn("if", source)
    if count == 0:
        raise ValueError("prepare_peers: causal_conv1d.cpp has no float16 branch in a dispatch macro (a newer "
                         "layout: edit it by hand)")
    return patched


def without_half_instantiations(source: str) -> str:
    """A kernel file with its explicit instantiations for float16 (`template void f<at::Half, ...>`) removed."""
    return "".join(line for line in source.splitlines(keepends=True)
                   if not (line.startswith("template void") and "at::Half" in line))


def _is_bare_repository(source: pathlib.Path) -> bool:
    return (source / "HEAD").is_file() and (source / "objects").is_dir() and not (source / ".git").exists()


def copy_tree_paths(source: pathlib.Path, paths: tuple[str, ...], dest: pathlib.Path) -> None:
    """Copies `paths` (files or folders, relative to the tree's root) of a work tree, or of a bare repository's
    HEAD, into `dest`; a path the tree lacks raises FileNotFoundError naming it."""
    dest.mkdir(parents=True, exist_ok=True)
    if _is_bare_repository(source):
        found = subprocess.run(["git", "-C", str(source), "ls-tree", "--name-only", "HEAD", "--", *paths],
                               check=True, capture_output=True, text=True).stdout.split()
        missing = [p for p in paths if p not in found]
        if missing:
            raise FileNotFoundError(f"prepare_peers: {source} has no {', '.join(missing)} at HEAD")
        archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", "HEAD", "--", *paths],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            # The "data" filter (Python 3.11.4+) refuses links and paths outside dest.
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return
    for path in paths:
        origin = source / path
        if origin.is_dir():
            shutil.copytree(origin, dest / path, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info"))
        elif origin.is_file():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, dest / path)
        else:
            raise FileNotFoundError(f"prepare_peers: {source} has no {path}")


def prepare_mamba(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """OUT/mamba_ssm from a state-spaces/mamba tree; returns the package folder."""
    shutil.rmtree(out / "mamba_ssm", ignore_errors=True)
    copy_tree_paths(source, MAMBA_PATHS, out)
    for package in MAMBA_EMPTY_INITS:
        (out / package / "__init__.py").write_text("")
    return out / "mamba_ssm"


def prepare_causal_conv1d(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """OUT/cc from a Dao-AILab/causal-conv1d tree, patched to build for sm_90 in float32 and bfloat16; returns it."""
    dest = out / "cc"
    shutil.rmtree(dest, ignore_errors=True)
    copy_tree_paths(source, CAUSAL_CONV1D_PATHS, dest)
    setup_py = dest / "setup.py"
    setup_py.write_text(sm90_only(setup_py.read_text()))
    dispatch = dest / "csrc" / "causal_conv1d.cpp"
    dispatch.write_text(without_half_dispatch(dispatch.read_text()))
    for kernel_file in sorted((dest / "csrc").glob("*.cu")):
        kernel_file.write_text(without_half_instantiations(kernel_file.read_text()))
    return dest


def prepare_jla(wheel: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """OUT/jla from a jax-linear-attention wheel; returns it."""
    shutil.rmtree(out / "jla", ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith("jla/")]
        if not members:
            raise FileNotFoundError(f"prepare_peers: {wheel} holds no jla/ package")
        archive.extractall(out, members)
    return out / "jla"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mamba", type=pathlib.Path, help="a state-spaces/mamba work tree or bare repository")
    parser.add_argument("--causal-conv1d", type=pathlib.Path,
                        help="a Dao-AILab/causal-conv1d work tree or bare repository")
    parser.add_argument("--jla-wheel", type=pathlib.Path, help="a jax-linear-attention wheel")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".peers"),
                        help="the git-ignored folder to lay them out in (default: .peers)")
    args = parser.parse_args(argv)
    if not (args.mamba or args.causal_conv1d or args.jla_wheel):
        parser.error("name at least one peer: --mamba, --causal-conv1d or --jla-wheel")
    for name in ("mamba", "causal_conv1d", "jla_wheel"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            parser.error(f"--{name.replace('_', '-')} {path}: no such file or folder")
    done = []
    if args.mamba:
        done.append(prepare_mamba(args.mamba, args.out))
    if args.causal_conv1d:
        done.append(prepare_causal_conv1d(args.causal_conv1d, args.out))
    if args.jla_wheel:
        done.append(prepare_jla(args.jla_wheel, args.out))
    print("\n".join(f"wrote {path}" for path in done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
