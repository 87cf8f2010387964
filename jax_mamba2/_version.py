"""The package version: from the installed distribution's metadata, else from the source tree's pyproject.toml."""
import importlib.metadata
import pathlib
import tomllib

_PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def _version() -> str:
    try:
        return importlib.metadata.version("jax-mamba2")
    except importlib.metadata.PackageNotFoundError:
        pass
    if _PYPROJECT.is_file():  # a source tree that is not installed
        return tomllib.loads(_PYPROJECT.read_text())["project"]["version"]
    return "0+unknown"


__version__ = _version()
