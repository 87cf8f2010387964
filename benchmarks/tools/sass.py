"""The SASS tileiras compiles the forward kernels to for sm_90, read without a GPU (cuobjdump and nvdisasm from
PATH or from the pip packages nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm of the [dev] extra).

    python benchmarks/tools/sass.py loops B,L,H,P,N,G [--chunk 64] [--features z initial_states seq_idx]
                                    [--config STAGE.FIELD=VALUE,...] [--all-loops]
        every launch of the forward plan: registers, stack and shared memory, and per loop with wgmma (a
        backward branch) its instructions, HGMMA and WARPGROUP.DEPBAR waits, the counts docs/experiments.md
        quotes
    python benchmarks/tools/sass.py fingerprints OUT.json [--compare OTHER.json]
        a hash of the machine code of every fused and segmented forward build (dstate 64 / 128 / 256, five
        feature sets, saving the states or not); with --compare, the builds whose hash differs (exit 1 if
        any): equal hashes mean a source change left tileiras' output as it was
    python benchmarks/tools/sass.py decode [--rows 1 8 64] [--d-model 1024] [--dependent 0 2]
        out_proj's product in the decode step of the LM of that width (2 d_model -> d_model, bf16) at each row
        count, in its three forms (`decode_out_proj_forms`), built at each DEPENDENT level (0: the FFI path's; 1,
        2: programmatic dependent launches, the merged token step's): its instructions, MUFU, FMUL and stack
        (LDL / STL: spills) counts and resources, the counts docs/design.md §8 quotes
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import site
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: benchmarks/tools/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ssd import Shape  # noqa: E402
from benchmarks.tools import stages  # noqa: E402
from jax_mamba2._files import write_atomically  # noqa: E402
from jax_mamba2.kernels import decode_projection, forward  # noqa: E402
from jax_mamba2.kernels._common import INDEPENDENT, WAITS, WAITS_AND_RELEASES  # noqa: E402
from jax_mamba2.kernels._common import SSDDims, kernel_name  # noqa: E402
from jax_mamba2.kernels.export import compile_launch  # noqa: E402

_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACKWARD_BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)")


class Loop(NamedTuple):
    """A loop of the SASS: addresses of its first and last (branching) instruction and what it holds."""
    start: int
    end: int
    instructions: int
    hgmma: int
    waits: int


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH or from the pip nvidia-cuda-cuobjdump package (with nvdisasm beside it)."""
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return found
    for packages in site.getsitepackages():
        for path in glob.glob(os.path.join(packages, "nvidia", "*", "bin", "cuobjdump")):
            if os.path.exists(os.path.join(os.path.dirname(path), "nvdisasm")):
                return path
    return None


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump -sass, cuobjdump -res-usage) of `cubin`. Raises FileNotFoundError without cuobjdump."""
    return _cuobjdump(cubin, "-sass"), resource_usage(cubin)


def resource_usage(cubin: bytes) -> str:
    """cuobjdump -res-usage of `cubin` (registers, shared memory, stack and local memory per function); needs no
    disassembler. Raises FileNotFoundError without cuobjdump."""
    return _cuobjdump(cubin, "-res-usage")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([cuobjdump, flag, str(path)], check=True, capture_output=True, text=True,
                              env=env).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without encoding) of every instruction of `sass`, in order."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]


def loops(sass: str) -> list[Loop]:
    """Every loop of `sass` (cuobjdump text): `listing_loops` of its instructions."""
    return listing_loops(instructions(sass))


def listing_loops(listing: list[tuple[int, str]]) -> list[Loop]:
    """Every loop of (address, instruction) pairs in address order: a branch back to an earlier instruction
    closes one. Branches past the last unconditional EXIT are left out: they close no loop but send
    out-of-line wait stubs back to their wait."""
    index = {address: i for i, (address, _) in enumerate(listing)}
    exits = [i for i, (_, text) in enumerate(listing) if text == "EXIT"]
    found = []
    for i, (address, text) in enumerate(listing[:exits[-1] if exits else len(listing)]):
        branch = _BACKWARD_BRANCH.search(text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < address and target in index:
            body = [t for _, t in listing[index[target]:i + 1]]
            found.append(Loop(target, address, len(body), sum("HGMMA" in t for t in body),
                              sum("WARPGROUP.DEPBAR" in t for t in body)))
    return found


def code_fingerprint(cubin: bytes) -> str:
    """A hash of the machine code of `cubin` (its .text sections; no disassembler needed: nvdisasm 13.x
    cannot disassemble every build). Names, debug information and the embedded PTX are left out."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entry_size) for i in range(count)]
    names = headers[names_index]
    names = cubin[names[4]:names[4] + names[5]]
    code = hashlib.sha1()
    for name_offset, _, _, _, offset, size, *_ in headers:
        if names[name_offset:].startswith(b".text."):
            code.update(cubin[offset:offset + size])
    return code.hexdigest()[:12]


def _resource_line(resources: str) -> str:
    return next((line.strip() for line in resources.splitlines() if "REG:" in line), "")


def _kernel_name(launch) -> str:
    return kernel_name(launch.kernel)


def fingerprint_builds() -> dict[str, str]:
    """{build: code_fingerprint} of the fused and segmented forward launches at (4, L, H, 64, N, 1) bf16, chunk 64,
    N in 64 / 128 / 256, with no feature, z, z + initial states + seq_idx, initial states, seq_idx, saving the
    states or not (L, H: 8192, 32 for the fused layout, 65536, 4 for the segmented one)."""
    prints = {}
    for dstate in (64, 128, 256):
        for features in ("", "z", "zis", "i", "s"):
            for seqlen, nheads in ((8192, 32), (65536, 4)):
                dims = SSDDims(batch=4, seqlen=seqlen, nheads=nheads, headdim=64, ngroups=1, dstate=dstate,
                               chunk_size=64, dtype="bfloat16", dt_dtype="bfloat16", dt_softplus=True,
                               has_z="z" in features, has_init="i" in features, has_seq_idx="s" in features)
                layout = forward.forward_layout(dims)
                for save in (False, True):
                    arrays = forward.forward_arrays(dims, layout, save)
                    for launch in forward.forward_plan(dims, layout=layout, save_states=save).launches[1:]:
                        key = (f"dstate={dstate} features={features or '-'} L={seqlen} {layout} save={save} "
                               f"{_kernel_name(launch)}")
                        prints[key] = code_fingerprint(compile_launch(launch, arrays)[1])
    return prints


def decode_out_proj_forms(rows: int, d_model: int = 1024) -> dict[str, decode_projection.ProjectionDims]:
    """out_proj of the decode step of the LM of width d_model (expand 2, headdim 64, d_state 128, one group; 2
    d_model -> d_model, bf16, 24 stacked layers, a count its build does not depend on) at `rows` rows: "plain",
    the product of rows a norm launch wrote; "gated", normalizing its rows from sums of squares, the gate applied
    per element in the product; "mixer_gated", normalizing the mixer step's gated float32 output (what the LM runs
    up to flax_layers.mamba2.GATED_NORM_IN_MIXER_ROWS rows). The sums come in four pieces per head, the mixer
    step's at one row (128 at d_model 1024)."""
    d_inner = 2 * d_model
    nheads = d_inner // 64
    in_proj_width = 2 * d_inner + 2 * 128 + nheads  # z, x, B, C, dt: where the gate z is read
    common = dict(rows=rows, features=d_inner, out_features=d_model, layers=24, has_norm=True, out_parts=True)
    return {
        "plain": decode_projection.ProjectionDims(**common),
        "gated": decode_projection.ProjectionDims(**common, z_width=in_proj_width, norm_parts=4 * nheads),
        "mixer_gated": decode_projection.ProjectionDims(**common, dtype="float32", norm_parts=4 * nheads),
    }


def decode_product_cubin(dims: decode_projection.ProjectionDims, dependent: int = INDEPENDENT) -> bytes:
    """The sm_90 cubin of the product launch of `dims`'s default plan, built at DEPENDENT level `dependent`."""
    plan = decode_projection.norm_project_plan(dims)
    (launch,) = [launch for launch in plan.launches if _kernel_name(launch) == "decode_project_kernel"]
    launch = launch.dependent(dependent)
    return compile_launch(launch, {**decode_projection.norm_project_inputs(dims), **plan.buffers})[1]


def instruction_counts(sass: str) -> dict[str, int]:
    """Static instruction count of a listing, and of its MUFU (special function), FMUL and stack (LDL, STL: the
    spills' loads and stores) instructions."""
    opcodes = [text.split()[0].split(".")[0] for _, text in instructions(sass)]
    return {"instructions": len(opcodes), **{op: opcodes.count(op) for op in ("MUFU", "FMUL", "LDL", "STL")}}


def _decode_report(args) -> int:
    for rows in args.rows:
        for form, dims in decode_out_proj_forms(rows, args.d_model).items():
            for level in args.dependent:
                sass, resources = disassemble(decode_product_cubin(dims, level))
                counts = ", ".join(f"{k} {v}" for k, v in instruction_counts(sass).items())
                print(f"d_model {args.d_model} rows {rows} {form} DEPENDENT {level}: {counts}; "
                      f"{_resource_line(resources)}")
    return 0


def _loops_report(args) -> int:
    dims = stages.dims_of(args.shape, args.chunk, tuple(args.features))
    configs = {}
    if args.config:
        _, fields = stages.parse_variant(f"config:{args.config}", stages=forward.FORWARD_STAGES)
        configs = stages.variant_configs(dims, fields)
    layout = stages.variant_layout(dims, configs)
    arrays = forward.forward_arrays(dims, layout)
    for stage, launch in zip(forward.FORWARD_LAYOUTS[layout], forward.forward_plan(dims, configs, layout).launches):
        sass, resources = disassemble(compile_launch(launch, arrays)[1])
        print(f"{_kernel_name(launch)} ({layout}: {configs.get(stage) or 'default config'})")
        print(f"  {_resource_line(resources)}")
        for loop in loops(sass) if args.all_loops else [loop for loop in loops(sass) if loop.hgmma]:
            print(f"  loop {loop.start:#x}-{loop.end:#x}: {loop.instructions} instructions, {loop.hgmma} HGMMA, "
                  f"{loop.waits} waits")
    return 0


def _fingerprints(args) -> int:
    prints = fingerprint_builds()
    write_atomically(args.out, (json.dumps(prints, indent=1) + "\n").encode())
    print(f"wrote {args.out} ({len(prints)} builds)")
    if args.compare is None:
        return 0
    other = json.loads(args.compare.read_text())
    differing = sorted(k for k in prints if other.get(k) != prints[k])
    print("\n".join(differing) or f"every build equals {args.compare}'s")
    return 1 if differing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    loops_parser = commands.add_parser("loops", help="resources and loops of every launch of a forward plan")
    loops_parser.add_argument("shape", type=Shape.parse, help="B,L,H,P,N,G")
    loops_parser.add_argument("--chunk", type=int, default=64)
    loops_parser.add_argument("--features", nargs="+", choices=tuple(stages.FEATURES), default=())
    loops_parser.add_argument("--config", help="STAGE.FIELD=VALUE,... on the stages' default configs, e.g. "
                                               "fused_scan.WORKER_WARPS=8,fused_scan.WEIGHT_X=0")
    loops_parser.add_argument("--all-loops", action="store_true",
                              help="also the loops without wgmma (barrier and spin waits, prologue copies)")
    prints_parser = commands.add_parser("fingerprints", help="machine-code hashes of every fused / segmented forward "
                                                             "build")
    prints_parser.add_argument("out", type=Path)
    prints_parser.add_argument("--compare", type=Path, help="a fingerprints JSON written before")
    decode_parser = commands.add_parser("decode", help="instruction counts of out_proj's decode product forms")
    decode_parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64])
    decode_parser.add_argument("--d-model", type=int, default=1024)
    decode_parser.add_argument("--dependent", nargs="+", type=int, choices=(INDEPENDENT, WAITS, WAITS_AND_RELEASES),
                               default=[INDEPENDENT], help="DEPENDENT levels to build at")
    args = parser.parse_args(argv)
    return {"loops": _loops_report, "fingerprints": _fingerprints, "decode": _decode_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
