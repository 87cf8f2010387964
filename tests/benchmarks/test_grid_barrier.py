"""benchmarks/tools/grid_barrier.py on the CPU: the barrier kernel on the emulator, its blocks in threads of their
own (as resident blocks would run), and its sm_90 build."""
import re
import threading

import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools import grid_barrier  # noqa: E402
from jax_mamba2.kernels._common import Buffer, Launch, kernel_signature  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402

BLOCKS = 6


def _arrays():
    """counter, stamps, late, as the emulator's arrays."""
    return tuple(a.view(emulator._EmulatedArray)
                 for a in (np.zeros(1, np.int32), np.zeros(BLOCKS, np.int32), np.full(BLOCKS, -1, np.int32)))


def test_every_block_sees_every_stamp_of_the_round_after_the_barrier(monkeypatch):
    monkeypatch.setattr(grid_barrier, "ct", emulator)
    counter, stamps, late = _arrays()
    rounds = 4
    emulator.run_concurrently(kernel_signature(grid_barrier.grid_barrier_kernel).pyfunc,
                              (counter, stamps, late, rounds, grid_barrier.SPIN_LIMIT), (BLOCKS,))
    assert counter[0] == rounds * BLOCKS
    np.testing.assert_array_equal(stamps, rounds)
    np.testing.assert_array_equal(late, 0)


def test_a_block_that_does_not_wait_is_counted_late(monkeypatch):
    """With no spinning allowed and the blocks run one after another, block b passes its barriers before block
    b + 1 has stamped: the check the GPU run reports must see it."""
    monkeypatch.setattr(grid_barrier, "ct", emulator)
    counter, stamps, late = _arrays()
    rounds = 3
    pyfunc = kernel_signature(grid_barrier.grid_barrier_kernel).pyfunc
    for block in range(BLOCKS):
        emulator._current.block, emulator._current.grid = (block, 0, 0), (BLOCKS, 1, 1)
        pyfunc(counter, stamps, late, rounds, 0)
    np.testing.assert_array_equal(late[:-1], rounds)  # the last block's neighbour (block 0) had stamped all
    assert late[-1] == 0 and counter[0] == rounds * BLOCKS


def test_concurrent_blocks_that_never_meet_are_reported_not_hung():
    released = threading.Event()  # set after the check, so that no thread outlives the test

    def waits_for_a_block_that_never_comes():
        released.wait()

    try:
        with pytest.raises(AssertionError, match="still running"):
            emulator.run_concurrently(waits_for_a_block_that_never_comes, (), (2,), timeout_s=0.2)
    finally:
        released.set()


def test_the_barrier_compiles_to_a_release_arrival_and_acquire_spins():
    from benchmarks.tools.sass import disassemble, resource_usage
    from jax_mamba2.kernels.export import compile_launch

    arrays = {"counter": Buffer((1,), "int32"), "stamps": Buffer((132,), "int32"), "late": Buffer((132,), "int32")}
    launch = Launch(grid_barrier.grid_barrier_kernel, (132,),
                    ("counter", "stamps", "late", 96, grid_barrier.SPIN_LIMIT), ("late",))
    _, cubin = compile_launch(launch, arrays)
    assert re.search(r"LOCAL:0\b", resource_usage(cubin)) and re.search(r"STACK:0\b", resource_usage(cubin))
    sass, _ = disassemble(cubin)
    atomics = re.findall(r"ATOMG\.E\.ADD\.STRONG\.GPU", sass)
    assert len(atomics) == 3, atomics  # the arrival, the first read, the spin's read: the rounds stay a loop
    assert sass.index("MEMBAR.ALL.GPU") < sass.index("ATOMG")  # release: the stamp is out before the arrival
    assert sass.count("CCTL.IVALL") == 2  # acquire: L1 invalidated after each read of the counter


def _chain_arrays(rng, layers=2, d_model=32, in_features=80, out_k=64, block_m=16):
    """x, w_in, mid, w_out of a small product chain (bf16 values), the phase index and the counter."""
    def bf16(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(emulator.bfloat16)

    arrays = (bf16(block_m, d_model), bf16(layers, d_model, in_features, scale=d_model ** -0.5),
              np.zeros((block_m, in_features), emulator.bfloat16), bf16(layers, out_k, d_model, scale=out_k ** -0.5),
              np.zeros(1, np.int32), np.zeros(1, np.int32))
    return [a.view(emulator._EmulatedArray) for a in arrays]


def _chain_reference(x, w_in, w_out):
    """The chain in float32 with each product's output rounded to bf16, as the kernel stores it."""
    x = np.asarray(x, np.float32)
    for layer in range(w_in.shape[0]):
        mid = (x @ np.asarray(w_in[layer], np.float32)).astype(emulator.bfloat16).astype(np.float32)
        x = (mid[:, :w_out.shape[1]] @ np.asarray(w_out[layer], np.float32)).astype(emulator.bfloat16)
        x = x.astype(np.float32)
    return x


def test_the_persistent_product_chain_equals_a_launch_per_product_and_the_reference(monkeypatch):
    monkeypatch.setattr(grid_barrier, "ct", emulator)
    pyfunc = kernel_signature(grid_barrier.product_chain_kernel).pyfunc
    block_m, block_k, block_n = 16, 16, 32  # 80 columns: the last tile of in_proj's product partly past the edge
    x0 = _chain_arrays(np.random.default_rng(0))[0].copy()
    results = []
    for persistent in (True, False):
        x, w_in, mid, w_out, phase, counter = _chain_arrays(np.random.default_rng(0))
        constants = (block_m, block_k, block_n, persistent, grid_barrier.SPIN_LIMIT)
        if persistent:
            emulator.run_concurrently(pyfunc, (x, w_in, mid, w_out, phase, counter, *constants), (2,))
            assert counter[0] == 2 * w_in.shape[0] * 2  # every block arrived after every product
        else:
            for p in range(2 * w_in.shape[0]):
                phase[0] = p
                tiles = -(-(w_in if p % 2 == 0 else w_out).shape[2] // block_n)
                emulator.run_concurrently(pyfunc, (x, w_in, mid, w_out, phase, counter, *constants), (tiles,))
        results.append(np.asarray(x, np.float32))
    np.testing.assert_array_equal(results[0], results[1])
    expected = _chain_reference(x0, w_in, w_out)
    # within one bf16 rounding (2^-8): the emulator accumulates in float64, the reference in float32
    assert np.linalg.norm(results[0] - expected) / np.linalg.norm(expected) < 2 ** -8


def test_the_persistent_chain_compiles_to_one_block_per_sm_with_its_waits():
    """At the probe's shapes the persistent build must fit an SM (its grid is a block per SM, all resident at once)
    and keep the barrier's release and acquires; its products store with plain stores, which the release orders."""
    from benchmarks.tools.sass import disassemble, resource_usage
    from jax_mamba2.kernels.export import compile_launch

    c = grid_barrier.CHAIN
    arrays = {"x": Buffer((c["block_m"], c["d_model"]), "bfloat16"),
              "w_in": Buffer((c["layers"], c["d_model"], c["in_features"]), "bfloat16"),
              "mid": Buffer((c["block_m"], c["in_features"]), "bfloat16"),
              "w_out": Buffer((c["layers"], c["out_k"], c["d_model"]), "bfloat16"),
              "phase": Buffer((1,), "int32"), "counter": Buffer((1,), "int32")}
    launch = Launch(grid_barrier.product_chain_kernel, (132,),
                    ("x", "w_in", "mid", "w_out", "phase", "counter", c["block_m"], c["block_k"], c["block_n"], True,
                     grid_barrier.SPIN_LIMIT), ("x", "mid"))
    _, cubin = compile_launch(launch, arrays)
    usage = resource_usage(cubin)
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage)
    assert int(re.search(r"SHARED:(\d+)", usage).group(1)) <= 227 * 1024
    sass, _ = disassemble(cubin)
    assert sass.count("MEMBAR.ALL.GPU") == 1 and sass.count("CCTL.IVALL") == 2 and "UTMASTG" not in sass
