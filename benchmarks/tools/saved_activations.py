"""What one LM block keeps from its forward for its backward: every saved array with its shape, dtype, bytes and
the operation that made it, per layer and over the model's layers, as JAX's autodiff plans it.

The block is traced, not run: with `--backend cutile` for an H200 (sm_90) on any machine, so the kernels' custom
VJPs save what they save on the GPU. The block's parameters and its inputs (hidden states, residual stream) are
listed too: a layer scan keeps each block's inputs for the backward, and the parameters live anyway.
`--remat matmuls` wraps the block in the policy of `Mamba2LMHeadModel(remat="matmuls")` (only in_proj's output
besides the inputs), `--remat dots` in `jax.checkpoint(policy=dots_saveable)`.

  python benchmarks/tools/saved_activations.py --d-model 1536 --batch 8 --seqlen 2048 --layers 48
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_SHORT_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
                      "u32": 4, "s64": 8, "u64": 8, "bool": 1}
_SAVED_LINE = re.compile(r"^(\w+)\[([\d,]*)\]\s+(.*)$")


def parse_saved(printed: str) -> list[dict]:
    """The arrays of `jax.ad_checkpoint.print_saved_residuals`'s output: dtype, shape, bytes, source."""
    saved = []
    for line in printed.splitlines():
        match = _SAVED_LINE.match(line.strip())
        if match is None:
            continue
        dtype, dims, source = match.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        saved.append({"dtype": dtype, "shape": shape, "bytes": math.prod(shape) * _SHORT_DTYPE_BYTES.get(dtype, 4),
                      "source": source, "is_input": source.startswith("from the argument")})
    return saved


def block_saved(d_model: int, batch: int, seqlen: int, *, d_state: int = 128, headdim: int = 64,
                backend: str = "cutile", remat: str = "none") -> list[dict]:
    """`parse_saved` of one `Mamba2Block`'s forward (bf16 compute, f32 parameters and residual stream) for
    (batch, seqlen, d_model) inputs; remat "none", "matmuls" (the LM's policy of that name) or "dots"
    (jax.checkpoint with dots_saveable)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.ad_checkpoint import print_saved_residuals

    from jax_mamba2.bridge import aot
    from jax_mamba2.flax_layers import Mamba2Block, Mamba2Config
    from jax_mamba2.flax_layers.lm import remat_policy

    config = Mamba2Config(d_model=d_model, n_layer=1, vocab_size=256,
                          ssm_cfg=dict(d_state=d_state, headdim=headdim, chunk_size=64))
    target = aot.cuda_target("sm_90") if backend == "cutile" else contextlib.nullcontext()
    with target:
        graphdef, state = nnx.split(Mamba2Block(config, backend=backend, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

        def block(state, hidden, residual):
            return nnx.merge(graphdef, state)(hidden, residual)

        policies = {"dots": jax.checkpoint_policies.dots_saveable,
                    "matmuls": remat_policy("matmuls")}
        if remat in policies:
            block = jax.checkpoint(block, policy=policies[remat])

        def loss(state, hidden, residual):
            out, new_residual = block(state, hidden, residual)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(new_residual)

        hidden = jnp.zeros((batch, seqlen, d_model), jnp.bfloat16)
        residual = jnp.zeros((batch, seqlen, d_model), jnp.float32)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(loss, state, hidden, residual)
    return parse_saved(printed.getvalue())


def summary(saved: list[dict], layers: int) -> dict:
    """Bytes per layer of the activations (not the parameters) and over `layers` layers."""
    activations = sum(s["bytes"] for s in saved if not s["source"].startswith("from the argument state"))
    return {"activation_bytes_per_layer": activations, "activation_bytes": activations * layers, "layers": layers}


def main(argv=None) -> int:
    from jax_mamba2._files import write_atomically

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24, help="layers the per-layer bytes are multiplied by")
    parser.add_argument("--backend", choices=("cutile", "xla"), default="cutile")
    parser.add_argument("--remat", choices=("none", "matmuls", "dots"), default="none")
    parser.add_argument("--min-mib", type=float, default=1.0, help="list arrays of at least this many MiB")
    parser.add_argument("--json", type=Path, help="also write the arrays and the summary here")
    args = parser.parse_args(argv)
    saved = block_saved(args.d_model, args.batch, args.seqlen, d_state=args.d_state, headdim=args.headdim,
                        backend=args.backend, remat=args.remat)
    for s in sorted(saved, key=lambda s: -s["bytes"]):
        if s["bytes"] >= args.min_mib * 2 ** 20:
            print(f"{s['bytes'] / 2 ** 20:9.1f} MiB  {s['dtype']}{list(s['shape'])}  {s['source'][:110]}")
    totals = summary(saved, args.layers)
    print(f"activations kept per layer: {totals['activation_bytes_per_layer'] / 2 ** 20:.1f} MiB; "
          f"x {args.layers} layers: {totals['activation_bytes'] / 2 ** 30:.2f} GiB")
    if args.json:
        write_atomically(args.json, json.dumps({"args": vars(args) | {"json": str(args.json)}, "saved": saved,
                                                "summary": totals}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
