"""benchmarks/tools/callback_graph.py on the CPU: its kernel on the emulator at every DEPENDENT level, the sm_90
builds that wait for the predecessor and release the successor, and a run whose executors fail or hang recording
each as an error and going on."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools import callback_graph  # noqa: E402
from jax_mamba2.kernels._common import INDEPENDENT, WAITS, WAITS_AND_RELEASES, Buffer, Launch  # noqa: E402
from jax_mamba2.kernels.export import compile_launch  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402


def _launch(dependent):
    return Launch(callback_graph.add_one_kernel, (4,), ("x", "y", 8, dependent), ("y",))


@pytest.mark.parametrize("dependent", [INDEPENDENT, WAITS, WAITS_AND_RELEASES])
def test_the_kernel_adds_one_at_every_dependent_level(monkeypatch, dependent):
    monkeypatch.setattr(callback_graph, "ct", emulator)
    x, y = np.arange(32, dtype=np.float32), np.full(32, np.nan, np.float32)
    emulator.launch_blocks(_launch(dependent), [x, y, 8, dependent])
    np.testing.assert_array_equal(y, x + 1)


def test_the_dependent_builds_wait_and_release():
    from benchmarks.tools import sass
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    arrays = {"x": Buffer((32,), "float32"), "y": Buffer((32,), "float32")}
    found = {}
    for level in (INDEPENDENT, WAITS, WAITS_AND_RELEASES):
        listing = sass.disassemble(compile_launch(_launch(level), arrays, "sm_90")[1])[0]
        found[level] = {op for op in ("ACQBULK", "PREEXIT") if re.search(rf"\b{op}\b", listing)}
    assert found == {INDEPENDENT: set(), WAITS: {"ACQBULK"}, WAITS_AND_RELEASES: {"ACQBULK", "PREEXIT"}}


def test_an_executor_that_fails_or_hangs_is_recorded_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    outcomes = iter([subprocess.CompletedProcess([], 1, "", "Traceback\nRuntimeError: no graph"),
                     subprocess.TimeoutExpired([], 5),
                     subprocess.CompletedProcess([], 0, '{"executor": "replay", "ms_per_step": 0.1}\n', "")])

    real_run = subprocess.run

    def run(command, **kwargs):
        if command[0] != sys.executable:  # not a worker (the GPU's name, where the results file is named)
            return real_run(command, **kwargs)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    monkeypatch.setattr(callback_graph.subprocess, "run", run)
    monkeypatch.setenv("JAX_MAMBA2_GIT_SHA", "abc1234")
    callback_graph.main(["--executors", "ffi", "callback", "replay", "--blocks", "1", "--worker-timeout", "5",
                         "--out", str(tmp_path)])
    written = json.loads(next(tmp_path.glob("callback_graph_*.json")).read_text())
    assert written["git_sha"] == "abc1234"
    assert [r.get("error", "") for r in written["records"]] == [
        "exit 1: RuntimeError: no graph", "timed out after 5.0 s", ""]
    assert written["records"][2]["ms_per_step"] == 0.1
