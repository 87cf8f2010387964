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
    sass = disassemble(cubin)
    sass = sass if isinstance(sass, str) else "\n".join(map(str, sass))
    atomics = re.findall(r"ATOMG\.E\.ADD\.STRONG\.GPU", sass)
    assert len(atomics) == 3, atomics  # the arrival, the first read, the spin's read: the rounds stay a loop
    assert sass.index("MEMBAR.ALL.GPU") < sass.index("ATOMG")  # release: the stamp is out before the arrival
    assert sass.count("CCTL.IVALL") == 2  # acquire: L1 invalidated after each read of the counter
