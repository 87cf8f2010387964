"""benchmarks/torch_lm.py: the PyTorch peer LM's forward, prefill cache and decode step, with a stand-in mixer."""
import pytest

torch = pytest.importorskip("torch")

from benchmarks import torch_lm  # noqa: E402
from tests.benchmarks._torch_stand_in import stand_in_parts  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch_lm.TorchLM(d_model=16, n_layer=3, vocab_size=40, **stand_in_parts(16))


def test_add_rms_norm_keeps_the_residual_in_float32():
    norm = torch_lm.RMSNorm(8)
    norm.weight.data = torch.linspace(0.5, 2.0, 8)
    hidden, residual = torch.randn(2, 5, 8).bfloat16(), torch.randn(2, 5, 8)
    normed, new_residual = torch_lm.add_rms_norm(hidden, residual, norm)
    expected = hidden.float() + residual
    assert new_residual.dtype == torch.float32 and torch.equal(new_residual, expected)
    rms = expected.square().mean(-1, keepdim=True).add(norm.eps).rsqrt()
    assert normed.dtype == torch.bfloat16
    torch.testing.assert_close(normed.float(), (expected * rms * norm.weight).bfloat16().float())


def test_forward_ties_the_head_and_fills_the_prefill_cache():
    model, ids = _model(), torch.randint(0, 40, (2, 7))
    logits = model(ids)
    assert logits.shape == (2, 7, 40)
    assert torch_lm.parameter_count(model) == 40 * 16 + 3 * (16 * 32 + 32 * 16 + 16) + 16  # no separate head
    cache = torch_lm.PrefillCache(max_seqlen=7, max_batch_size=2)
    last = model(ids, inference_params=cache, last_only=True)
    torch.testing.assert_close(last, logits[:, -1:])
    assert sorted(cache.key_value_memory_dict) == [0, 1, 2]


def test_step_updates_every_layer_s_cache_in_place():
    model = _model()
    caches = model.allocate_inference_cache(3)
    before = [state.clone() for _, state in caches]
    logits = model.step(torch.tensor([1, 2, 3]), caches)
    assert logits.shape == (3, 40)
    assert all(not torch.equal(b, state) for b, (_, state) in zip(before, caches))
