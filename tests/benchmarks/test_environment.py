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
