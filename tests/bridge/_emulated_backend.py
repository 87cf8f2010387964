"""The cuTile backend with every kernel plan run on the NumPy emulator of tests/kernels/_cutile_emulator.py
(float64, through `jax.pure_callback`): bridge/ops.py's forward, saving forward, backward and vmap rules
without a GPU. Register it (`monkeypatch.setitem(backends._REGISTRY["ssd"], ...)`) to reach it through
`ssd(backend="cutile_emulated")`.
"""
from jax_mamba2 import backends
from jax_mamba2.bridge import ops
from tests.kernels import _cutile_emulator as emulator

EMULATED = backends.Backend(
    name="cutile_emulated", forward=ops.make_forward(emulator.jax_run_plan),
    forward_saving=ops.make_forward_saving(emulator.jax_run_plan),
    backward=ops.make_backward(emulator.jax_run_plan), unsupported_reason=lambda inputs, static: None)
