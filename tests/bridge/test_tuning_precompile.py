"""The tuner's concurrent compiles (bridge/tuning/precompile.py), without a GPU: the launch is played by a function
that asks `_compile` for a signature as cuda-tile's launch does on a miss of its in-memory cache."""
import pytest

pytest.importorskip("cuda.tile")

import cuda.tile._compile as cutile_compile  # noqa: E402
from cuda.tile._cext import default_tile_context  # noqa: E402

from jax_mamba2.bridge.tuning import precompile  # noqa: E402
from jax_mamba2.kernels.export import launch_signature  # noqa: E402
from jax_mamba2.kernels.rms_norm import NormDims, rms_norm_fwd_inputs, rms_norm_fwd_plan  # noqa: E402

SM90 = (9, 0)


def _norm_launch(group_size: int):
    """(kernel, signature) of the RMSNorm forward kernel for a small problem of `group_size` features."""
    dims = NormDims(rows=64, ngroups=1, group_size=group_size, dtype="float32", out_dtype="float32")
    plan = rms_norm_fwd_plan(dims)
    launch, = plan.launches
    return launch.kernel, launch_signature(launch, {**rms_norm_fwd_inputs(dims), **plan.buffers})


def _launch(kernel, grid, args):
    """cuda-tile's launch as far as compiling goes: the signature stands for the arguments it derives it from."""
    kernel._compile(args[0], default_tile_context, SM90)


@pytest.fixture
def empty_cutile_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(default_tile_context.config, "cache_dir", str(tmp_path))
    return tmp_path


def _cache_entries(folder) -> int:
    from cutile_cache._cache import cache_entries
    return sum(1 for _ in cache_entries(str(folder)))


def test_a_recorded_compile_is_what_cuda_tile_compiles_and_lands_in_its_disk_cache(empty_cutile_cache):
    kernel, signature = _norm_launch(96)
    recorded = precompile.record_compiles([(kernel, (1,), (signature,))], _launch)
    copy, = (r.kernel for r in recorded)  # launched as a replace_hints() copy: a fresh in-memory cache
    assert copy is not kernel and copy._pyfunc is kernel._pyfunc and copy._compiler_options == kernel._compiler_options
    assert recorded == [precompile.RecordedCompile(copy, signature, default_tile_context, SM90)]
    cubin, symbol, host, providers = precompile.compile_recorded(recorded[0])
    assert cubin[:4] == b"\x7fELF" and host is None
    assert _cache_entries(empty_cutile_cache) == 1
    # cuda-tile's own JIT compile of the same launch finds that cubin under its key (no second entry).
    own = kernel._compile(signature, default_tile_context, SM90)
    assert own[:2] == (cubin, symbol) and own[3] == providers
    assert _cache_entries(empty_cutile_cache) == 1


def test_compiled_ahead_answers_the_searchs_compiles_without_compiling_again(empty_cutile_cache, monkeypatch):
    launches = [_norm_launch(96), _norm_launch(160)]
    original = precompile.KERNEL_CLASS._compile
    with precompile.compiled_ahead([(k, (1,), (s,)) for k, s in launches], _launch) as prepared:
        assert prepared == 2
        monkeypatch.setattr(cutile_compile, "compile_tile", lambda *a, **k: pytest.fail("compiled during the search"))
        for kernel, signature in launches:
            # The search launches a replace_hints copy of each kernel: same function, same options.
            cubin, symbol, _, _ = kernel.replace_hints()._compile(signature, default_tile_context, SM90)
            assert cubin[:4] == b"\x7fELF" and symbol == signature.symbol
    assert precompile.KERNEL_CLASS._compile is original


def test_a_launch_not_recorded_compiles_as_cuda_tiles_own(empty_cutile_cache):
    recorded_kernel, recorded_signature = _norm_launch(96)
    other_kernel, other_signature = _norm_launch(160)
    with precompile.compiled_ahead([(recorded_kernel, (1,), (recorded_signature,))], _launch) as prepared:
        assert prepared == 1
        cubin, symbol, _, _ = other_kernel._compile(other_signature, default_tile_context, SM90)
    assert cubin[:4] == b"\x7fELF" and symbol == other_signature.symbol
    assert _cache_entries(empty_cutile_cache) == 2


def test_a_failed_compile_fails_the_search_once_with_its_error(monkeypatch):
    kernel, signature = _norm_launch(96)
    calls = []

    def failing(request):
        calls.append(request)
        raise RuntimeError("tileiras: out of registers")

    monkeypatch.setattr(precompile, "compile_recorded", failing)
    with precompile.compiled_ahead([(kernel, (1,), (signature,))], _launch):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="out of registers"):
                kernel._compile(signature, default_tile_context, SM90)
    assert len(calls) == 1


def test_a_launch_that_fails_before_compiling_records_nothing_and_compile_is_restored():
    kernel, _ = _norm_launch(96)
    original = precompile.KERNEL_CLASS._compile

    def bad_arguments(kernel, grid, args):
        raise TypeError("an argument does not fit the kernel")

    assert precompile.record_compiles([(kernel, (1,), ())], bad_arguments) == []
    assert precompile.KERNEL_CLASS._compile is original
    with pytest.raises(KeyError):
        with precompile.compiled_ahead([], bad_arguments):
            raise KeyError("the search failed")
    assert precompile.KERNEL_CLASS._compile is original
