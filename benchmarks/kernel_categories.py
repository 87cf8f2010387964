"""Folds a profiled program's GPU kernels into what they compute: matrix products, SSD, the SSD's non-finite
confinement, conv, norms, loss, optimizer, copies, elementwise.

A kernel's name says what library ran it (cuBLAS, a cuTile SSD kernel, a memcpy, and in a PyTorch peer's trace
mamba_ssm's Triton kernels, causal_conv1d's, ATen's); for XLA's own fusions the
name is the fusion's HLO instruction, whose metadata in the compiled module's text names the JAX op and,
through the module's stack-frame tables, the Python file that created it (the conv's and the norms' op and
reference modules, the loss's cross_entropy.py, the SSD's op.py / reference.py, optax). `jax.named_scope("loss")` and
`jax.named_scope("optimizer")` in the profiled program mark the rest; the SSD op's own scope
(`op.CONFINEMENT_SCOPE`) marks the XLA ops of its confinement of non-finite values.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple, Optional

CATEGORIES = ("matrix products", "SSD", "confinement", "conv", "norms", "loss", "optimizer", "copies",
              "elementwise")
# The name scope of the SSD op's confinement (jax_mamba2.op.CONFINEMENT_SCOPE; spelled out: this module imports
# no JAX).
_CONFINEMENT_SCOPE = "nonfinite_confinement"
# The SSD's kernels by name: the cuTile ones (jax_mamba2.kernels) and mamba_ssm's Triton ones (a leading
# underscore; state passing and the chunks' C B^T products are its own stages). The decode step's mixer kernel
# (conv step + state update) counts as SSD, its projection's product kernels (with a split K, the sum of the
# splits too) as matrix products (its norm kernel is a norm by name).
_SSD_KERNEL = re.compile(r"^_?(chunk_cumsum|chunk_state|chunk_scan|fused_scan|segment_states|param_grads|state_update"
                         r"|mixer_step|state_passing|bmm_chunk)\w*_kernel")
_MATMUL_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|matmul|^dot|_dot_|^decode_(project|split_sum)",
                            re.IGNORECASE)
# Device copies: XLA's and the driver's, and ATen's copies of strided tensors and concatenations.
_COPY_KERNEL = re.compile(r"memcpy|memset|^copy|^transpose|^wrapped_transpose|direct_copy_kernel|CatArrayBatchedCopy",
                          re.IGNORECASE)
# Kernels of other ops by their own names (cuTile and library kernels carry no HLO instruction name): the cuTile
# conv's and causal_conv1d's, any norm kernel (mamba_ssm's are Triton "_layer_norm_*"), the cuTile loss and
# ATen's log-softmax and NLL, ATen's fused AdamW (multi-tensor apply).
_NAMED_KERNELS = (("conv", re.compile(r"causal_conv1d|conv_grads", re.IGNORECASE)),
                  ("norms", re.compile(r"norm", re.IGNORECASE)),
                  ("loss", re.compile(r"cross_entropy|softmax_xent|_loss|SoftMax|nll_loss", re.IGNORECASE)),
                  ("optimizer", re.compile(r"multi_tensor_apply|adam", re.IGNORECASE)))
_SSD_SOURCES = ("jax_mamba2/op.py", "jax_mamba2/reference.py", "jax_mamba2/bridge/ops.py")
_CONV_SOURCES = ("jax_mamba2/flax_layers/conv.py", "jax_mamba2/conv1d.py", "jax_mamba2/conv1d_reference.py",
                 "jax_mamba2/bridge/conv_ops.py")
_NORM_SOURCES = ("jax_mamba2/flax_layers/norm.py", "jax_mamba2/norm.py", "jax_mamba2/norm_reference.py",
                 "jax_mamba2/bridge/norm_ops.py")
_LOSS_SOURCES = ("jax_mamba2/cross_entropy.py", "jax_mamba2/bridge/loss_ops.py")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*metadata=\{([^}]*)\}")


class Source(NamedTuple):
    op_name: str   # the JAX name stack, e.g. "jit(step)/jvp(loss_fn)/while/body/mul"
    file: str      # the innermost Python file of the op's traceback ("" if unknown)


def _table(text: str, header: str) -> dict[int, str]:
    """One of the compiled module's tables ("FileNames", "FileLocations", "StackFrames"): id -> entry text."""
    match = re.search(rf"^{header}\n((?:\d+ .*\n)+)", text, re.MULTILINE)
    if not match:
        return {}
    return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in match.group(1).splitlines()}


def _field(entry: str, name: str) -> Optional[int]:
    match = re.search(rf"\b{name}=(\d+)", entry)
    return int(match.group(1)) if match else None


def sanitized(name: str) -> str:
    """A kernel name as XLA derives it from an HLO instruction name (dots and dashes become underscores)."""
    return re.sub(r"[.\-]", "_", name)


def hlo_sources(hlo_text: str) -> dict[str, Source]:
    """Sanitized instruction name -> Source, for every instruction of a compiled module with metadata."""
    files = {i: entry.strip('"') for i, entry in _table(hlo_text, "FileNames").items()}
    locations = {i: files.get(_field(entry, "file_name_id"), "")
                 for i, entry in _table(hlo_text, "FileLocations").items()}
    frames = {i: locations.get(_field(entry, "file_location_id"), "")
              for i, entry in _table(hlo_text, "StackFrames").items()}
    sources = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        metadata = match.group(2)
        op_name = re.search(r'op_name="([^"]*)"', metadata)
        inline_file = re.search(r'source_file="([^"]*)"', metadata)  # older XLA: the file inline
        frame = _field(metadata, "stack_frame_id")
        file = inline_file.group(1) if inline_file else frames.get(frame, "")
        sources[sanitized(match.group(1))] = Source(op_name.group(1) if op_name else "", file)
    return sources


def _in_scope(op_name: str, scope: str) -> bool:
    """Whether a JAX name stack passes through `jax.named_scope(scope)`, also as transformed by jvp /
    transpose ("jvp(loss)", "transpose(jvp(loss))")."""
    return any(re.fullmatch(rf"(?:\w+\()*{scope}\)*", part) for part in op_name.split("/"))


def category(kernel: str, source: Optional[Source]) -> str:
    """The category (one of CATEGORIES) of a kernel named `kernel`, whose HLO instruction is `source`."""
    if _SSD_KERNEL.match(kernel):
        return "SSD"
    if _COPY_KERNEL.search(kernel):
        return "copies"
    if _MATMUL_KERNEL.search(kernel):
        return "matrix products"
    if source is None:
        return next((cat for cat, pattern in _NAMED_KERNELS if pattern.search(kernel)), "elementwise")
    file = source.file.replace("\\", "/")
    if _in_scope(source.op_name, "loss") or file.endswith(_LOSS_SOURCES):
        return "loss"
    if _in_scope(source.op_name, "optimizer") or "/optax/" in file:
        return "optimizer"
    if _in_scope(source.op_name, _CONFINEMENT_SCOPE):
        return "confinement"
    if file.endswith(_CONV_SOURCES):
        return "conv"
    if file.endswith(_NORM_SOURCES):
        return "norms"
    if file.endswith(_SSD_SOURCES):
        return "SSD"
    return "elementwise"


def idle_gaps(kernels: list[tuple[str, float, float]], calls: int, top: int = 10) -> dict:
    """Where the GPU waits inside a call: the idle time between consecutive launches (overlapping launches
    merged), per call, and the `top` gaps by total time, named by the launch before each ("previous": the one
    ending last) and after it ("next"). The calls - 1 longest gaps are taken as the host's syncs between calls
    and left out."""
    intervals = []  # [start, end, name of the launch ending last, name of the first launch]
    for name, start, duration in sorted(kernels, key=lambda k: k[1]):
        if intervals and start <= intervals[-1][1]:
            if start + duration > intervals[-1][1]:
                intervals[-1][1:3] = [start + duration, name]
        else:
            intervals.append([start, start + duration, name, name])
    gaps = sorted(((after[0] - before[1], before[2], after[3]) for before, after in zip(intervals, intervals[1:])),
                  reverse=True)[max(calls - 1, 0):]
    by_pair: dict[tuple, list] = {}
    for gap, before, after in gaps:
        entry = by_pair.setdefault((before[:80], after[:80]), [0.0, 0])
        entry[0] += gap / calls
        entry[1] += 1 / calls
    ranked = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {"idle_us": sum(g for g, _, _ in gaps) / calls,
            "top_gaps": [{"previous": previous, "next": next_, "us": t, "count": n}
                         for (previous, next_), (t, n) in ranked]}


def fold(kernels: list[tuple[str, float, float]], hlo_text: str, calls: int, top: int = 15,
         top_per_category: int = 5) -> dict:
    """Per call: microseconds and launches per category, the `top` kernels by time with their category, each
    category's `top_per_category` kernels (what a category's time is made of), and the GPU's idle time between
    launches with its largest gaps (`idle_gaps`).

    Args:
      kernels: (name, start_us, duration_us) per launch (benchmarks/tools/kernel_profile.py reads them from a trace).
      hlo_text: the profiled executable's `compiled.as_text()`.
      calls: how many calls of the program the kernels cover.
    """
    sources = hlo_sources(hlo_text)
    us, launches = defaultdict(float), defaultdict(float)
    by_kernel: dict[str, list] = {}
    for name, _, duration in kernels:
        source = sources.get(sanitized(name)) or sources.get(sanitized(name.split("(")[0]))
        cat = category(name, source)
        us[cat] += duration / calls
        launches[cat] += 1 / calls
        entry = by_kernel.setdefault(name, [cat, 0.0, 0.0])
        entry[1] += duration / calls
        entry[2] += 1 / calls
    busy = sum(us.values())
    ranked = [{"kernel": name[:160], "category": cat, "us": t, "launches": n}
              for name, (cat, t, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])]
    return {
        "calls": calls, "busy_us": busy, **idle_gaps(kernels, calls, top),
        "categories": {c: {"us": us[c], "launches": launches[c], "fraction": us[c] / busy if busy else None}
                       for c in CATEGORIES if c in us},
        "top_kernels": ranked[:top],
        "top_kernels_by_category": {c: [k for k in ranked if k["category"] == c][:top_per_category]
                                    for c in CATEGORIES if c in us},
    }
