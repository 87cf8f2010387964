"""The backend registry: which backends exist, which can run here and why not, and the package's metadata."""
import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

import jax
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2 import _version, backends
from tests._helpers import make_ssd_args

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = dict(batch=1, seqlen=16, nheads=2, headdim=8, ngroups=1, dstate=8)


def _cuda_tile_installed() -> bool:
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def ghost_backend(monkeypatch):
    """An optional backend whose module cannot be imported."""
    monkeypatch.setitem(backends.OPTIONAL_BACKENDS, "ghost", "jax_mamba2._no_such_module")
    return "ghost"


def test_backend_status_covers_every_known_backend_and_the_pure_jax_ones_run():
    status = jax_mamba2.backend_status()
    assert list(status) == list(backends.known_names())
    assert {"xla", "scan", "cutile", "cutile_callback"} <= set(status)
    for name in ("xla", "scan"):
        assert status[name] == backends.BackendStatus(True, None)
    for name, entry in status.items():
        assert entry.runnable == (entry.reason is None), name
        assert entry.reason is None or entry.reason.strip(), name


def test_available_backends_are_the_runnable_ones():
    status = jax_mamba2.backend_status()
    assert jax_mamba2.available_backends() == tuple(name for name, s in status.items() if s.runnable)
    assert {"xla", "scan"} <= set(jax_mamba2.available_backends())


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks a machine without a CUDA GPU")
def test_cutile_without_gpu_is_not_available_and_says_why():
    status = jax_mamba2.backend_status()
    expected = "no CUDA device is visible to JAX" if _cuda_tile_installed() else "cuda-tile is not installed"
    for name in ("cutile", "cutile_callback"):
        assert not status[name].runnable
        assert expected in status[name].reason
        assert name not in jax_mamba2.available_backends()


def test_optional_backend_that_cannot_be_imported_says_why(ghost_backend):
    status = jax_mamba2.backend_status()[ghost_backend]
    assert status == backends.BackendStatus(False, "No module named 'jax_mamba2._no_such_module'")
    args, kwargs = make_ssd_args(0, **SMALL)
    with pytest.raises(ValueError, match=r"ssd\(backend='ghost'\) is unavailable: No module named"):
        jax_mamba2.ssd(*args, 16, **kwargs, backend=ghost_backend)
    state = jax.numpy.zeros((1, 2, 8, 8))
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    with pytest.raises(ValueError, match=r"ssd_step\(backend='ghost'\) is unavailable: No module named"):
        jax_mamba2.ssd_step(state, x, dt, A, B, C, backend=ghost_backend)


def test_without_cuda_tile_the_cutile_backends_say_to_install_it():
    """A process where `import cuda.tile` fails (as where cuda-tile is not installed)."""
    code = """if True:
        import sys
        sys.modules["cuda"] = None  # makes `import cuda.tile` raise ModuleNotFoundError
        import jax.numpy as jnp
        import jax_mamba2
        reason = "cuda-tile is not installed (pip install 'jax-mamba2[cuda]')"
        status = jax_mamba2.backend_status()
        assert status["cutile"] == status["cutile_callback"] == (False, reason), status
        assert jax_mamba2.available_backends() == ("xla", "scan"), jax_mamba2.available_backends()
        x, B = jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 1, 4))
        try:
            jax_mamba2.ssd(x, jnp.ones((1, 8, 2)), -jnp.ones(2), B, B, 8, backend="cutile")
        except ValueError as e:
            assert str(e) == "ssd(backend='cutile') is unavailable: " + reason, e
        else:
            raise AssertionError("ssd(backend='cutile') ran without cuda-tile")
        """
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_kernels_replaced_swaps_a_layer_backend_s_kernels_inside_the_block_only():
    xla = backends.registered("rms_norm")["xla"]
    with pytest.raises(RuntimeError, match="inside"):
        with backends.kernels_replaced("rms_norm", "xla", "stand-in kernels"):
            swapped = backends.registered("rms_norm")["xla"]
            assert swapped.kernels == "stand-in kernels" and swapped.name == "xla"
            raise RuntimeError("inside")
    assert backends.registered("rms_norm")["xla"] is xla


def test_unknown_backend_error_lists_every_known_backend():
    args, kwargs = make_ssd_args(1, **SMALL)
    names = ", ".join(repr(n) for n in ("auto", *backends.known_names()))
    with pytest.raises(ValueError, match=f"ssd: backend='triton' must be one of {names}$"):
        jax_mamba2.ssd(*args, 16, **kwargs, backend="triton")
    with pytest.raises(ValueError, match=f"Mamba2: backend='triton' must be one of {names}$"):
        jax_mamba2.Mamba2(16, d_state=8, headdim=8, backend="triton", rngs=nnx.Rngs(0))


def test_registry_depends_on_no_other_module_of_the_package():
    """The op and the bridge import the registry, never each other: it imports nothing of jax_mamba2."""
    code = """if True:
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("registry", "jax_mamba2/backends.py")
        sys.modules["registry"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded = [m for m in sys.modules if m.startswith("jax_mamba2")]
        assert not loaded, loaded
        """
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_version_is_the_installed_metadata_or_the_source_trees(monkeypatch):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    try:
        assert jax_mamba2.__version__ == importlib.metadata.version("jax-mamba2")
    except importlib.metadata.PackageNotFoundError:
        assert jax_mamba2.__version__ == pyproject

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert _version._version() == pyproject


def test_package_ships_its_type_marker_and_license():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["jax_mamba2"]
    assert (REPO / "jax_mamba2" / "py.typed").is_file()
    assert "Apache License\n                           Version 2.0" in (REPO / "LICENSE").read_text()
    assert "License :: OSI Approved :: Apache Software License" in project["project"]["classifiers"]


def test_package_metadata_has_keywords_and_https_urls():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert {"jax", "mamba2", "cutile"} <= set(project["keywords"])
    assert project["urls"] and all(url.startswith("https://") for url in project["urls"].values())
