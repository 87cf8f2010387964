"""A pure-PyTorch stand-in for mamba_ssm's `Mamba2` with its interface (forward with inference_params,
allocate_inference_cache, step updating the states in place), so that the PyTorch peer's harness
(benchmarks/torch_lm.py and the benchmarks' torch paths) runs on a CPU. It computes no SSD."""
import torch
from torch import nn

from benchmarks import torch_lm


class StandInMixer(nn.Module):
    def __init__(self, d_model: int, layer_idx: int, d_conv: int = 4, nheads: int = 2, headdim: int = 4,
                 d_state: int = 8):
        super().__init__()
        self.layer_idx, self.d_conv, self.shape = layer_idx, d_conv, (nheads, headdim, d_state)
        self.in_proj = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out_proj = nn.Linear(2 * d_model, d_model, bias=False)

    def forward(self, u, inference_params=None):
        xz = self.in_proj(u)
        if inference_params is not None:
            conv_state, ssm_state = self.allocate_inference_cache(u.shape[0], 1, dtype=xz.dtype)
            conv_state.copy_(xz[:, -self.d_conv:].transpose(1, 2))
            inference_params.key_value_memory_dict[self.layer_idx] = (conv_state, ssm_state)
        return self.out_proj(torch.nn.functional.silu(xz))

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        dtype = dtype or self.in_proj.weight.dtype
        device = self.in_proj.weight.device
        return (torch.zeros(batch_size, self.in_proj.out_features, self.d_conv, device=device, dtype=dtype),
                torch.zeros(batch_size, *self.shape, device=device, dtype=dtype))

    def step(self, hidden_states, conv_state, ssm_state):
        xz = self.in_proj(hidden_states[:, 0])
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = xz
        ssm_state.mul_(0.5).add_(1.0)
        return self.out_proj(torch.nn.functional.silu(xz))[:, None], conv_state, ssm_state


def stand_in_parts(d_model: int) -> dict:
    """`TorchLM` keyword arguments with stand-in mixers and the plain-PyTorch add + RMSNorm."""
    return dict(make_mixer=lambda i: StandInMixer(d_model, i), make_norm=lambda: torch_lm.RMSNorm(d_model),
                add_norm=torch_lm.add_rms_norm)
