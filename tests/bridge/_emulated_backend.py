"""The cuTile backend with every kernel plan run on the NumPy emulator of tests/kernels/_cutile_emulator.py
(float64, through `jax.pure_callback`): bridge/ops.py's forward, saving forward, backward and vmap rules, and
bridge/decode_ops.py's fused decode step, without a GPU. Register it (`monkeypatch.setitem(backends._REGISTRY["ssd"],
...)`) to reach it through `ssd(backend="cutile_emulated")` and `mamba2_decode_step(backend="cutile_emulated")`.
"""
from jax_mamba2 import backends
from jax_mamba2.bridge import decode_ops, ops
from jax_mamba2.kernels import decode_step as decode_kernels
from tests.kernels import _cutile_emulator as emulator


def _decode_step_unsupported_reason(inputs, static):
    """What the kernel itself cannot take (no GPU needed)."""
    return decode_kernels.decode_step_unsupported_reason(decode_ops.kernel_dims(inputs, static))


EMULATED = backends.Backend(
    name="cutile_emulated", forward=ops.make_forward(emulator.jax_run_plan),
    forward_saving=ops.make_forward_saving(emulator.jax_run_plan),
    backward=ops.make_backward(emulator.jax_run_plan), unsupported_reason=lambda inputs, static: None,
    decode_step=decode_ops.make_decode_step(emulator.jax_run_plan),
    decode_step_unsupported_reason=_decode_step_unsupported_reason)
