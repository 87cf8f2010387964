"""benchmarks/environment.py: the GPU model that names the results files."""
from benchmarks import environment


def test_gpu_slug_is_the_model():
    assert environment.gpu_slug("NVIDIA H200") == "h200"
    assert environment.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert environment.gpu_slug("") == "gpu"


def test_local_gpu_slug_asks_nvidia_smi(monkeypatch):
    monkeypatch.setattr(environment, "_command_output",
                        lambda cmd: "NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3" if cmd[0] == "nvidia-smi" else None)
    assert environment.local_gpu_slug() == "h100"
    monkeypatch.setattr(environment, "_command_output", lambda cmd: None)
    assert environment.local_gpu_slug() == "cpu"


def test_the_kernel_benchmarks_exit_naming_why_where_the_kernels_cannot_run(monkeypatch, tmp_path):
    """Where the cutile backend cannot run (a CPU machine: faked here, so the test means the same on a GPU), the
    scripts that time the kernels exit with its reason before any work, no traceback and no timing of XLA's
    fallback under the kernels' names; --lower-only of first_step.py needs no GPU and is not refused."""
    import pytest

    import jax_mamba2
    from benchmarks import conv1d, decode_kernels, first_step, norm
    from jax_mamba2.backends import BackendStatus

    status = {**jax_mamba2.backend_status(), "cutile": BackendStatus(runnable=False, reason="no GPU (faked)")}
    monkeypatch.setattr(jax_mamba2, "backend_status", lambda: status)
    out = ["--out", str(tmp_path)]
    for name, main in (("conv1d.py", conv1d.main), ("norm.py", norm.main), ("decode_kernels.py", decode_kernels.main),
                       ("first_step.py", first_step.main)):
        with pytest.raises(SystemExit, match=rf"^{name}.*: the cuTile kernels cannot run here: no GPU \(faked\)$"):
            main(out)
    assert not list(tmp_path.iterdir())
