"""Generate text with a Mamba-2 language model through its decode cache, and report tokens per second.

--model-dir is a local checkpoint directory in HF transformers or mamba_ssm format (config.json plus
model.safetensors / sharded safetensors / pytorch_model.bin), for example a `state-spaces/mamba2-*`
download or the model/ folder that examples/train_lm.py writes. Without it, a randomly initialized small
byte-level model is used (its text is noise; the timing is real).

Tokens: a 256-token vocabulary is read as bytes. Larger vocabularies need a HuggingFace `tokenizer.json`
(--tokenizer, or one inside --model-dir) and the `tokenizers` package; the state-spaces/mamba2-*
checkpoints use the EleutherAI/gpt-neox-20b tokenizer.

    python examples/generate.py                                         # random small model
    python examples/generate.py --model-dir examples/out/train_lm/model --prompt "def "
    python examples/generate.py --model-dir ~/mamba2-130m --tokenizer ~/gpt-neox-20b/tokenizer.json \\
        --prompt "Mamba is" --max-new-tokens 128 --batch 16                           # GPU

Generation is one jitted program (prefill, then a lax.scan of O(1) cached steps). The fast path is the
default: on a GPU the cuTile kernels, bfloat16 computation and bfloat16 weights, converted once when the
model is loaded so that no token step converts them again (--dtype / --param-dtype float32 for exact
float32; --cache-dtype bfloat16 then keeps the decode state in bfloat16, half the bytes a large batch's token step
moves). It reports decoding tokens/s without the prefill (generate with 1 and with --max-new-tokens new
tokens, differenced; the first calls compile) and the prefill's time. A greedy run is also checked against
the full (uncached) forward pass. Several --prompt make one batch of prompts of different lengths, left-padded
(`generate(prompt_lengths=)`), each decoded as it would be alone; --stream then prints the first one's
continuation as it is generated (`generate_stream`). --eos-token-id ends each sample's text before its first
end-of-text token (the gpt-neox-20b tokenizer's <|endoftext|> is id 0). Writes generate.json to --out/generate/.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import (INT32_MAX, add_common_flags, axis_size, describe_device, in_range, make_parser, model_flags,
                     output_dir, positive_int, power_of_two, prompt_bytes, resolve_backend, sequence_length, token_id,
                     write_atomically)
from jax_mamba2.checks import check_axis_length, check_element_count
from jax_mamba2.flax_layers import (Mamba2Config, Mamba2LMHeadModel, cast_params, generate, generate_stream,
                                    load_pretrained)

BYTE_VOCAB = 256
DEFAULT_PROMPT = "def fibonacci(n):\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens (the vocabulary of examples/train_lm.py)."""

    def encode(self, text: str) -> list[int]:
        return list(prompt_bytes(text))  # a --prompt byte that is not UTF-8 as that byte

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizer.json`, through the `tokenizers` package."""

    def __init__(self, path: pathlib.Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise SystemExit(f"generate.py: reading {path} needs the tokenizers package "
                             "(pip install tokenizers)") from e
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def pick_tokenizer(vocab_size: int, tokenizer_file: pathlib.Path | None, model_dir: pathlib.Path | None):
    """Bytes for a 256-token vocabulary, else a tokenizer.json (--tokenizer, or inside --model-dir)."""
    if tokenizer_file is None and model_dir is not None and (model_dir / "tokenizer.json").is_file():
        tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file is not None:
        return HFTokenizer(tokenizer_file)
    if vocab_size == BYTE_VOCAB:
        return ByteTokenizer()
    raise SystemExit(f"generate.py: the model's vocab_size={vocab_size} is not byte-level ({BYTE_VOCAB}); "
                     "pass --tokenizer path/to/tokenizer.json (for state-spaces/mamba2-*: the "
                     "EleutherAI/gpt-neox-20b tokenizer)")


def resolve_dtypes(args) -> tuple[jnp.dtype, jnp.dtype]:
    """(computation dtype, parameter dtype): "auto" is bfloat16 on a GPU and float32 elsewhere; the
    parameters follow the computation unless --param-dtype says otherwise."""
    dtype = jnp.dtype(("bfloat16" if jax.default_backend() == "gpu" else "float32") if args.dtype == "auto"
                      else args.dtype)
    return dtype, dtype if args.param_dtype == "auto" else jnp.dtype(args.param_dtype)


def load_model(args, backend: str, dtype, param_dtype) -> Mamba2LMHeadModel:
    if args.model_dir is not None:
        print(f"loading {args.model_dir}")
        return load_pretrained(args.model_dir, dtype=dtype, param_dtype=param_dtype, backend=backend,
                               scan_layers=not args.unroll_layers)
    with model_flags("--d-model", "--layers", "--d-state", "--headdim", "--chunk-size"):
        config = Mamba2Config(d_model=args.d_model, n_layer=args.layers, vocab_size=BYTE_VOCAB,
                              ssm_cfg=dict(d_state=args.d_state, headdim=args.headdim, chunk_size=args.chunk_size))
    print("no --model-dir: a randomly initialized byte-level model (its text is noise)")
    model = Mamba2LMHeadModel(config, backend=backend, dtype=dtype, scan_layers=not args.unroll_layers,
                              rngs=nnx.Rngs(params=args.seed))
    return cast_params(model, param_dtype)  # initialized in float32, converted once


@nnx.jit
def full_forward_argmax(model, tokens):
    """Greedy next-token predictions of the uncached forward pass: (batch, seqlen) int32."""
    return jnp.argmax(model(tokens)[..., :model.config.vocab_size], axis=-1).astype(jnp.int32)


def cache_agreement(model, tokens, prompt_lengths: list[int]) -> float:
    """Fraction of greedily generated tokens that the full forward pass predicts too, each row run alone from
    its own prompt (rows are left-padded to the longest prompt)."""
    padded_len = max(prompt_lengths)
    agree = []
    for row, length in zip(np.asarray(tokens), prompt_lengths):
        sequence = jnp.asarray(row[padded_len - length:])[None]
        predicted = full_forward_argmax(model, sequence[:, :-1])[:, length - 1:]
        agree.append(np.asarray(predicted == sequence[:, length:]))
    return float(np.mean(agree))


def left_padded(prompts: list[list[int]]) -> tuple[jax.Array, list[int] | None]:
    """(prompt_ids (rows, longest) int32 left-padded with 0, prompt_lengths, or None when all are as long)."""
    longest = max(len(p) for p in prompts)
    ids = jnp.asarray([[0] * (longest - len(p)) + p for p in prompts], jnp.int32)
    lengths = [len(p) for p in prompts]
    return ids, None if len(set(lengths)) == 1 else lengths


def cache_dtype(args) -> str | None:
    """generate's cache_dtype from --cache-dtype (None for auto: the weights' dtype)."""
    return None if args.cache_dtype == "auto" else args.cache_dtype


def sampling_kwargs(args, rng) -> dict:
    """generate's sampling controls and decode-state dtype from the flags."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, rng=rng if args.temperature > 0 else None,
                cache_dtype=cache_dtype(args))


def timed_generate(model, prompt_ids, prompt_lengths, new_tokens: int, args, rng):
    """Generates twice (compile, then timed): (tokens, compile+run seconds, run seconds)."""
    kwargs = dict(sampling_kwargs(args, rng), prompt_lengths=prompt_lengths)
    began = time.perf_counter()
    jax.block_until_ready(generate(model, prompt_ids, new_tokens, **kwargs))
    first = time.perf_counter() - began
    began = time.perf_counter()
    tokens = jax.block_until_ready(generate(model, prompt_ids, new_tokens, **kwargs))
    return tokens, first, time.perf_counter() - began


def until_eos(continuation, eos_ids) -> list[int]:
    """The continuation's token ids before the first of `eos_ids` (all of them without one)."""
    ids = [int(i) for i in continuation]
    return next((ids[:i] for i, token in enumerate(ids) if token in eos_ids), ids)


def stream_text(model, tokenizer, prompt: list[int], args, rng) -> str:
    """Prints the prompt, then its continuation token by token as `generate_stream` yields it (text is printed
    once it decodes to whole characters) until an --eos-token-id; returns the whole text."""
    ids = list(prompt)
    shown = tokenizer.decode(ids)
    print(shown, end="", flush=True)
    for tokens in generate_stream(model, jnp.asarray([prompt], jnp.int32), args.max_new_tokens,
                                  **sampling_kwargs(args, rng)):
        if int(tokens[0]) in args.eos_token_id:
            break
        ids.append(int(tokens[0]))
        text = tokenizer.decode(ids)
        if text.startswith(shown) and not text.endswith("\ufffd"):  # a character split over tokens waits
            print(text[len(shown):], end="", flush=True)
            shown = text
    return tokenizer.decode(ids)


# The flags of the random model's shape: (argparse type, default, help).
RANDOM_MODEL_FLAGS = {"d_model": (positive_int, 256, "model width"), "layers": (positive_int, 4, "Mamba-2 blocks"),
                      "d_state": (positive_int, 64, "SSM state size N"),
                      "headdim": (positive_int, 64, "SSM head size P"),
                      "chunk_size": (power_of_two, 64, "SSD chunk length, a power of two")}


def parse_args(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--model-dir", type=pathlib.Path,
                        help="HF or mamba_ssm checkpoint directory; None: a random small byte-level model")
    parser.add_argument("--tokenizer", type=pathlib.Path,
                        help="HuggingFace tokenizer.json; None: the one in --model-dir, else bytes")
    parser.add_argument("--prompt", action="append",
                        help="text the generation continues; repeat it for a batch of prompts of different lengths "
                             f"(left-padded, each decoded as it would be alone; without one: {DEFAULT_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=sequence_length, default=64,
                        help="tokens generated per sequence, >= 2 and at most 2**31 - 1 with the prompt's")
    parser.add_argument("--eos-token-id", type=token_id, nargs="+", default=[],
                        help="end-of-text token ids: a sample's text ends before the first (the timed runs "
                             "generate --max-new-tokens whatever they draw)")
    parser.add_argument("--batch", type=axis_size, default=1,
                        help="copies of each prompt decoded together, at most 2**31 - 1 rows in all")
    parser.add_argument("--temperature", type=in_range(0.0, float("inf")), default=0.0,
                        help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="sample among the k most likely tokens; None: among all")
    parser.add_argument("--top-p", type=in_range(0.0, 1.0, low_open=True), default=None,
                        help="sample among the most likely tokens whose probabilities sum to p; None: among all")
    parser.add_argument("--min-p", type=in_range(0.0, 1.0), default=None,
                        help="sample among tokens at least p times as likely as the most likely; None: among all")
    parser.add_argument("--repetition-penalty", type=in_range(0.0, float("inf"), low_open=True), default=1.0,
                        help="> 0: the logits of tokens already in the text are divided by this where positive, "
                             "multiplied where negative (1: off)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="computation dtype; auto = bfloat16 on a GPU, float32 elsewhere")
    parser.add_argument("--param-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the weights' dtype, converted once at load; auto = the computation dtype")
    parser.add_argument("--cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the decode state's dtype (generate's cache_dtype); auto = the weights', as "
                             "mamba_ssm; bfloat16 with float32 weights halves the state a large batch moves")
    parser.add_argument("--stream", action="store_true",
                        help="then print the first prompt's continuation as it is generated (generate_stream)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="scan_layers=False: the prompt's blocks unrolled (a longer compile); the fused "
                             "decode step runs its layers unrolled either way")
    random_model = parser.add_argument_group("random model (without --model-dir)")
    for name, (kind, default, text) in RANDOM_MODEL_FLAGS.items():  # absent from args unless given
        random_model.add_argument(f"--{name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS,
                                  help=f"{text} (default: {default})")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in RANDOM_MODEL_FLAGS if hasattr(args, name)]
    if args.model_dir is not None and given:
        parser.error(f"{', '.join(given)} shape a random model; with --model-dir the checkpoint's config.json does")
    for name, (_, default, _) in RANDOM_MODEL_FLAGS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2")
    args.prompt = args.prompt or [DEFAULT_PROMPT]
    if len(args.prompt) * args.batch > INT32_MAX:  # the rows of the prompts' array
        parser.error(f"--batch={args.batch} copies of {len(args.prompt)} --prompt must make at most 2**31 - 1 rows "
                     "(an array axis)")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        hint = " (its model/ folder holds one)" if (args.model_dir / "model" / "config.json").is_file() else ""
        parser.error(f"--model-dir={args.model_dir} must be a checkpoint folder with a config.json{hint}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer={args.tokenizer} is not a file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_dir(args.out / "generate")
    print(f"device: {describe_device()}")
    backend = resolve_backend(args.backend)
    dtype, param_dtype = resolve_dtypes(args)
    print(f"computation {dtype.name}, weights {param_dtype.name}")
    model = load_model(args, backend, dtype, param_dtype)
    if args.top_k is not None and args.top_k > model.config.vocab_size:
        raise SystemExit(f"generate.py: --top-k {args.top_k} must be at most the model's vocabulary "
                         f"({model.config.vocab_size} tokens)")
    if args.temperature == 0 and any(v is not None for v in (args.top_k, args.top_p, args.min_p)):
        print("note: --top-k, --top-p and --min-p sample; at --temperature 0 (greedy) they change nothing")
    beyond = [i for i in args.eos_token_id if i >= model.config.vocab_size]
    if beyond:
        raise SystemExit(f"generate.py: --eos-token-id {beyond[0]} must be below the model's vocabulary "
                         f"({model.config.vocab_size} tokens)")
    tokenizer = pick_tokenizer(model.config.vocab_size, args.tokenizer, args.model_dir)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    if not all(prompts):
        raise SystemExit("generate.py: a --prompt encodes to no tokens")
    # generate's checks of its output, (rows, prompt + new tokens) ids, made now: known once the prompts are
    # tokens, they would otherwise fail only after the timed 1-token run.
    tokens = max(len(p) for p in prompts) + args.max_new_tokens
    try:
        check_axis_length("generate.py", "the longest --prompt's tokens + --max-new-tokens", tokens)
        check_element_count("generate.py", "the output", "(rows, tokens)", (len(prompts) * args.batch, tokens))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    rows = [p for p in prompts for _ in range(args.batch)]
    prompt_ids, prompt_lengths = left_padded(rows)
    batch = len(rows)

    rng = jax.random.key(args.seed)
    try:  # the prefill and 1st token; also where generate checks the options argparse let through
        _, _, prefill_s = timed_generate(model, prompt_ids, prompt_lengths, 1, args, rng)
    except (ValueError, TypeError) as error:  # its message names the option (or the prompt's token id)
        raise SystemExit(f"generate.py: {error}") from None
    tokens, first_s, run_s = timed_generate(model, prompt_ids, prompt_lengths, args.max_new_tokens, args, rng)
    decode_s, steps = run_s - prefill_s, args.max_new_tokens - 1
    print(f"generated {batch} x {args.max_new_tokens} tokens after prompts of {sorted({len(p) for p in prompts})} "
          f"tokens: {batch * args.max_new_tokens / run_s:,.0f} tokens/s with the prefill "
          f"({prefill_s * 1e3:.1f} ms, first token included); first call with compilation {first_s:.1f} s")
    if decode_s > 0:
        print(f"decoding alone: {batch * steps / decode_s:,.0f} tokens/s "
              f"({decode_s * 1e3 / steps:.3f} ms per token step for the batch)")
    else:
        print("decoding alone: too short to time apart from the prefill (raise --max-new-tokens)")
    padded_len = prompt_ids.shape[1]
    texts = [tokenizer.decode(p + until_eos(np.asarray(tokens[i * args.batch])[padded_len:], args.eos_token_id))
             for i, p in enumerate(prompts)]
    for text in texts:
        print(f"--- sample (temperature {args.temperature}) ---\n{text}\n---")
    streamed = None
    if args.stream:
        print("--- streamed ---")
        streamed = stream_text(model, tokenizer, prompts[0], args, rng)
        print("\n---")

    record = {"device": describe_device(), "backend": backend, "model_dir": str(args.model_dir),
              "dtype": dtype.name, "param_dtype": param_dtype.name,
              "cache_dtype": cache_dtype(args),
              "prompt_tokens": [len(p) for p in prompts], "eos_token_id": args.eos_token_id,
              "batch": batch, "max_new_tokens": args.max_new_tokens,
              "tokens_per_s": batch * args.max_new_tokens / run_s,
              "decode_tokens_per_s": batch * steps / decode_s if decode_s > 0 else None,
              "ms_per_token_step": decode_s * 1e3 / steps if decode_s > 0 else None, "prefill_ms": prefill_s * 1e3,
              "first_call_s": first_s, "texts": texts, "streamed_text": streamed,
              "sampling": {name: getattr(args, name)
                           for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}}
    if args.temperature == 0 and args.repetition_penalty == 1:  # plain greedy: the forward's argmax
        agreement = cache_agreement(model, tokens, [len(p) for p in rows])
        print(f"cached decoding vs full forward: {agreement:.1%} of greedy tokens agree")
        record["cache_agreement"] = agreement
    write_atomically(out / "generate.json", json.dumps(record, indent=1).encode())
    print(f"wrote {out / 'generate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
