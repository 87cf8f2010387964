"""The PyTorch peer of `Mamba2LMHeadModel`: an LM of the same shape around any Mamba-2 mixer module.

  embedding -> n_layer x (fused add + RMSNorm -> mixer) -> add + RMSNorm -> tied LM head

as mamba_ssm's `MambaLMHeadModel` with `fused_add_norm` and `residual_in_fp32` (the residual stream in
float32). The benchmarks build it from mamba_ssm's `Mamba2` and its Triton add + RMSNorm (`mamba_ssm_parts`);
the tests from pure-PyTorch stand-ins with the same interface, so everything but those calls runs on a CPU.

A mixer module takes (batch, seqlen, d_model) and an optional `inference_params` (a `PrefillCache`: it
writes its decode state there), and has `allocate_inference_cache(batch, max_seqlen, dtype)` and
`step(hidden (batch, 1, d_model), conv_state, ssm_state) -> (out, conv_state, ssm_state)`, updating the
states in place, as mamba_ssm's `Mamba2`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# add_norm(hidden, residual or None, norm) -> (normed hidden, new residual in float32)
AddNorm = Callable[[torch.Tensor, "torch.Tensor | None", nn.Module], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class PrefillCache:
    """What mamba_ssm's `Mamba2.forward(..., inference_params=)` reads and fills (the fields of mamba_ssm's
    `InferenceParams`, whose module also imports transformers): per layer_idx the (conv_state, ssm_state)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    key_value_memory_dict: dict = dataclasses.field(default_factory=dict)


class RMSNorm(nn.Module):
    """Plain RMSNorm (weight, eps), the interface of mamba_ssm's Triton `RMSNorm`."""

    def __init__(self, features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(features))
        self.register_parameter("bias", None)


def add_rms_norm(hidden, residual, norm):
    """residual = hidden + residual in float32; returns (rmsnorm(residual) in hidden's dtype, residual)."""
    residual = hidden.float() if residual is None else hidden.float() + residual
    normed = residual * torch.rsqrt(residual.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    return normed.to(hidden.dtype), residual


class TorchLM(nn.Module):
    """Embedding, mixers with pre-norms, final norm, tied head.

    Args:
      d_model, n_layer, vocab_size: the shape.
      make_mixer: layer_idx -> mixer module.
      make_norm: () -> norm module (weight, bias, eps); default `RMSNorm(d_model)`.
      add_norm: the fused residual add + norm (see `AddNorm`).
    """

    def __init__(self, *, d_model: int, n_layer: int, vocab_size: int, make_mixer: Callable[[int], nn.Module],
                 make_norm: Callable[[], nn.Module] | None = None, add_norm: AddNorm = add_rms_norm):
        super().__init__()
        make_norm = make_norm or (lambda: RMSNorm(d_model))
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.mixers = nn.ModuleList(make_mixer(i) for i in range(n_layer))
        self.norms = nn.ModuleList(make_norm() for _ in range(n_layer))
        self.norm_f = make_norm()
        self.add_norm = add_norm

    def _logits(self, hidden, residual):
        hidden, _ = self.add_norm(hidden, residual, self.norm_f)
        return F.linear(hidden, self.embedding.weight.to(hidden.dtype))

    def forward(self, input_ids, inference_params: PrefillCache | None = None, last_only: bool = False):
        """input_ids (batch, seqlen) -> logits (batch, seqlen or 1 if last_only, vocab). With inference_params,
        every mixer writes its decode state into it (mamba_ssm's prefill)."""
        hidden, residual = self.embedding(input_ids), None
        extra = {} if inference_params is None else {"inference_params": inference_params}
        for norm, mixer in zip(self.norms, self.mixers):
            hidden, residual = self.add_norm(hidden, residual, norm)
            hidden = mixer(hidden, **extra)
        if last_only:
            hidden, residual = hidden[:, -1:], residual[:, -1:]
        return self._logits(hidden, residual)

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (conv_state, ssm_state), zeros (the mixers' own allocation)."""
        return [mixer.allocate_inference_cache(batch_size, 1, dtype=dtype) for mixer in self.mixers]

    def step(self, input_ids, caches):
        """One token per row: input_ids (batch,) -> logits (batch, vocab); caches updated in place."""
        hidden, residual = self.embedding(input_ids)[:, None], None
        for norm, mixer, (conv_state, ssm_state) in zip(self.norms, self.mixers, caches):
            hidden, residual = self.add_norm(hidden, residual, norm)
            hidden, _, _ = mixer.step(hidden, conv_state, ssm_state)
        return self._logits(hidden, residual)[:, 0]


def mamba_ssm_parts(d_model: int, *, d_state: int, headdim: int, expand: int, chunk_size: int,
                    use_mem_eff_path: bool, device=None) -> dict:
    """`TorchLM` keyword arguments for mamba_ssm's `Mamba2` mixers and Triton fused add + RMSNorm."""
    from mamba_ssm.modules.mamba2 import Mamba2
    from mamba_ssm.ops.triton.layer_norm import RMSNorm as TritonRMSNorm
    from mamba_ssm.ops.triton.layer_norm import layer_norm_fn

    def add_norm(hidden, residual, norm):
        return layer_norm_fn(hidden, norm.weight, norm.bias, residual=residual, prenorm=True,
                             residual_in_fp32=True, eps=norm.eps, is_rms_norm=True)

    return dict(
        make_mixer=lambda i: Mamba2(d_model, d_state=d_state, headdim=headdim, expand=expand,
                                    chunk_size=chunk_size, use_mem_eff_path=use_mem_eff_path, layer_idx=i,
                                    device=device),
        make_norm=lambda: TritonRMSNorm(d_model, eps=1e-5, device=device),
        add_norm=add_norm)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (the tied head is the embedding)."""
    return sum(p.numel() for p in model.parameters())
