"""The cuTile backends with every kernel plan run on the NumPy emulator of tests/kernels/_cutile_emulator.py
(float64, through `jax.pure_callback`), without a GPU: `EMULATED`, bridge/ops.py's forward, saving forward,
backward, decode step and vmap rules (register it, `monkeypatch.setitem(backends._REGISTRY["ssd"], ...)`, to reach it
through `ssd(backend="cutile_emulated")`), and `emulate_layer_kernels` for the ops of the layers.
"""
from jax_mamba2 import backends
from jax_mamba2.bridge import ops
from tests.kernels import _cutile_emulator as emulator

EMULATED = backends.Backend(
    name="cutile_emulated", forward=ops.make_forward(emulator.jax_run_plan),
    forward_saving=ops.make_forward_saving(emulator.jax_run_plan),
    backward=ops.make_backward(emulator.jax_run_plan), unsupported_reason=lambda inputs, static: None,
    step=ops.make_step(emulator.jax_run_plan))


def emulate_layer_kernels(monkeypatch, op: str, ops_module) -> None:
    """backend="cutile" of `op` (a layer op: "rms_norm", "cross_entropy") runs the kernels of `ops_module`
    (its bridge module: `make_kernels`, `unsupported_reason`) on the emulator, as if on a GPU."""
    monkeypatch.setitem(backends._REGISTRY[op], "cutile", backends.LayerBackend(
        "cutile", ops_module.make_kernels(emulator.jax_run_plan), ops_module.unsupported_reason, auto_priority=2))
    monkeypatch.setattr(ops_module, "gpu_unavailable_reason", lambda: None)
