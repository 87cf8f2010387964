"""Probe: what a grid-wide barrier inside one cuTile kernel costs, against what a kernel boundary costs.

A decode token step at one row is ~100 launches of microseconds of work each; the launches, not the bytes, set
its time (docs/design.md, Decode). A persistent kernel would run a layer's phases (norm, in_proj, mixer step,
out_proj) in one launch, its blocks waiting for each other between phases. cuTile has what that wait needs
(`ct.atomic_add` with release / acquire order at device scope, `while` loops) but no cooperative launch, so the
grid is sized to be resident at once (SMs x blocks per SM) and the barrier is a counter in global memory.

`grid_barrier_kernel` runs ROUNDS barriers: each block stamps its slot, arrives (a release add on the counter),
spins until every block has arrived (acquire reads), then checks that its neighbour's stamp of the round is
visible. `empty_kernel` is the boundary it would replace: ROUNDS launches of a kernel that does nothing, on the
same grid. Both run in CUDA graphs (`benchmarks.ssd.time_cuda_graph`; the counter is zeroed by a memset node in
the graph): per barrier (t(ROUNDS) - t(0)) / ROUNDS, per launch t / ROUNDS.

`product_chain_kernel` puts that wait between real work: the matrix products of d1024-l24's token step at one
tile of rows (per layer x @ in_proj, then its first 2048 columns @ out_proj; `CHAIN`), all 48 in one launch of a
block per SM with a wait after each, against a launch per product over its column tiles. Same tiles, same
order, so the two give the same bits (`identical`); the weights' floor is their bytes at 4.8 TB/s.

On the GPU machine (torch and cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/grid_barrier.py --out $OUT
Writes <out>/grid_barrier_<gpu>.json (one record per probe and grid) and prints one line per record.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import cuda.tile as ct

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ssd import PEAK_HBM_TBPS, raise_gpu_clocks, time_cuda_graph  # noqa: E402

# A block that spins this often without seeing every block arrive gives up (and counts the round as late), so a
# grid that is not resident at once ends instead of hanging the GPU.
SPIN_LIMIT = 1 << 22
BUDGET_S, WARMUP_S = 0.2, 0.1


def _grid_wait(counter, arrivals, SPIN_LIMIT):
    """Arrives at a grid-wide barrier on `counter` ((1,) int32) and waits until it holds `arrivals` (every block's
    arrival at this barrier and the ones before it). The arrival is a release add, so what the block wrote before
    is visible to every block that sees it; the wait spins on acquire reads, giving up after SPIN_LIMIT."""
    ct.atomic_add(counter, 0, 1, memory_order=ct.MemoryOrder.RELEASE)
    seen = ct.atomic_add(counter, 0, 0, memory_order=ct.MemoryOrder.ACQUIRE)
    spins = 0
    while (seen < arrivals) & (spins < SPIN_LIMIT):
        seen = ct.atomic_add(counter, 0, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        spins += 1


@ct.kernel
def grid_barrier_kernel(counter, stamps, late, ROUNDS: ct.Constant[int], SPIN_LIMIT: ct.Constant[int]):
    """ROUNDS grid-wide barriers on `counter` ((1,) int32, zero at launch). `stamps`: (blocks,) int32, each block's
    last round; `late`: (blocks,) int32 out, the rounds after whose barrier a block did not see its neighbour's
    stamp (0 when the barrier holds)."""
    block = ct.bid(0)
    blocks = ct.num_blocks(0)
    missed = ct.zeros((), dtype=ct.int32)
    for r in range(ROUNDS):
        ct.scatter(stamps, block, r + 1)
        _grid_wait(counter, (r + 1) * blocks, SPIN_LIMIT)
        neighbour = ct.gather(stamps, (block + 1) % blocks)
        missed += ct.where(neighbour < r + 1, 1, 0)
    ct.scatter(late, block, missed)


def _product(a, weight, layer, out, BLOCK_M, BLOCK_K, BLOCK_N):
    """out = a[:, :K] @ weight[layer] ((K, N)), (BLOCK_M, BLOCK_N) tiles shared out over the grid's blocks
    round-robin, rounded to out's dtype; plain stores (not TMA), which the release of a barrier orders."""
    k_steps = weight.shape[1] // BLOCK_K
    for t in range(ct.bid(0), ct.cdiv(weight.shape[2], BLOCK_N), ct.num_blocks(0)):
        acc = ct.zeros((BLOCK_M, BLOCK_N), ct.float32)
        for k in range(k_steps):
            rows = ct.load(a, index=(0, k), shape=(BLOCK_M, BLOCK_K), latency=4)
            w = ct.load(weight, index=(layer, k, t), shape=(1, BLOCK_K, BLOCK_N), padding_mode=ct.PaddingMode.ZERO,
                        latency=4)
            acc = ct.mma(rows, w.reshape((BLOCK_K, BLOCK_N)), acc)
        ct.store(out, index=(0, t), tile=acc.astype(out.dtype), allow_tma=False)


@ct.kernel
def product_chain_kernel(x, w_in, mid, w_out, phase_index, counter, BLOCK_M: ct.Constant[int],
                         BLOCK_K: ct.Constant[int], BLOCK_N: ct.Constant[int], PERSISTENT: ct.Constant[bool],
                         SPIN_LIMIT: ct.Constant[int]):
    """The matrix products of a decode token step, a layer's two after another: phase 2l is mid = x @ w_in[l],
    phase 2l + 1 is x = mid[:, :K_out] @ w_out[l]. x: (BLOCK_M, D) bf16, read and rewritten; w_in: (L, D, N_in);
    mid: (BLOCK_M, N_in); w_out: (L, K_out, D); all bf16. PERSISTENT: every phase in this launch, a grid-wide wait
    on `counter` ((1,) int32, zero at launch) after each; else the phase `phase_index` ((1,) int32) alone."""
    if PERSISTENT:
        for p in range(2 * w_in.shape[0]):
            if p % 2 == 0:
                _product(x, w_in, p // 2, mid, BLOCK_M, BLOCK_K, BLOCK_N)
            else:
                _product(mid, w_out, p // 2, x, BLOCK_M, BLOCK_K, BLOCK_N)
            _grid_wait(counter, (p + 1) * ct.num_blocks(0), SPIN_LIMIT)
    else:
        p = ct.load(phase_index, index=(0,), shape=(1,)).item()
        if p % 2 == 0:
            _product(x, w_in, p // 2, mid, BLOCK_M, BLOCK_K, BLOCK_N)
        else:
            _product(mid, w_out, p // 2, x, BLOCK_M, BLOCK_K, BLOCK_N)


@ct.kernel
def empty_kernel(late):
    """Nothing but a launch: no block writes (a block index is never negative)."""
    if ct.bid(0) < 0:
        ct.scatter(late, 0, 1)


def barrier_launch(torch, blocks: int, rounds: int):
    """(arrays, a callable that zeroes the counter and launches `rounds` barriers over `blocks` blocks)."""
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    stamps = torch.zeros(blocks, device="cuda", dtype=torch.int32)
    late = torch.zeros(blocks, device="cuda", dtype=torch.int32)

    def launch():
        counter.zero_()
        ct.launch(torch.cuda.current_stream(), (blocks,), grid_barrier_kernel,
                  (counter, stamps, late, rounds, SPIN_LIMIT))
        return late

    return (counter, stamps, late), launch


# The product chain's shapes: the products of d1024-l24's token step (in_proj 1024 x 4384, out_proj 2048 x 1024),
# one tile of rows, the decode products' 64-column tiles and K steps of 128.
CHAIN = dict(layers=24, d_model=1024, in_features=4384, out_k=2048, block_m=16, block_k=128, block_n=64)


def chain_arrays(torch, layers: int, d_model: int, in_features: int, out_k: int, block_m: int, **_):
    """x0, w_in, mid, w_out (bf16, random weights scaled by 1 / sqrt(K)) and the counter of a product chain."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(torch.bfloat16)

    return (normal(block_m, d_model), normal(layers, d_model, in_features, scale=d_model ** -0.5),
            torch.empty(block_m, in_features, device="cuda", dtype=torch.bfloat16),
            normal(layers, out_k, d_model, scale=out_k ** -0.5), torch.zeros(1, device="cuda", dtype=torch.int32))


def chain_launches(torch, blocks: int, arrays, x, persistent: bool, *, block_m: int, block_k: int, block_n: int,
                   **_):
    """A callable that resets x and runs the chain: one launch over `blocks` blocks (persistent), else a launch per
    phase over that product's column tiles."""
    x0, w_in, mid, w_out, counter = arrays
    phases = [torch.tensor([p], device="cuda", dtype=torch.int32) for p in range(2 * w_in.shape[0])]
    tiles = [-(-w.shape[2] // block_n) for w in (w_in, w_out)]

    def run():
        x.copy_(x0)
        stream = torch.cuda.current_stream()
        constants = (block_m, block_k, block_n, persistent, SPIN_LIMIT)
        if persistent:
            counter.zero_()
            ct.launch(stream, (blocks,), product_chain_kernel, (x, w_in, mid, w_out, phases[0], counter, *constants))
        else:
            for p, phase in enumerate(phases):
                ct.launch(stream, (tiles[p % 2],), product_chain_kernel,
                          (x, w_in, mid, w_out, phase, counter, *constants))
        return x

    return run


def barrier_record(torch, blocks: int, per_sm: int, rounds: int) -> dict:
    """Per barrier and per empty launch at `blocks` blocks, and whether the barrier held."""
    record = {"probe": "barrier", "blocks": blocks, "blocks_per_sm": per_sm, "rounds": rounds}
    (counter, _, late), once = barrier_launch(torch, blocks, rounds)
    once()
    torch.cuda.synchronize()
    record.update(counter=int(counter.item()), late_rounds=int(late.sum().item()))
    times = {r: time_cuda_graph(barrier_launch(torch, blocks, r)[1], BUDGET_S, WARMUP_S)[0] for r in (0, rounds)}
    record["barrier_us"] = (times[rounds].ms_median - times[0].ms_median) * 1e3 / rounds
    record["barrier_graph_ms"] = {str(k): t.ms_median for k, t in times.items()}
    empty_late = torch.zeros(1, device="cuda", dtype=torch.int32)

    def empties():
        for _ in range(rounds):
            ct.launch(torch.cuda.current_stream(), (blocks,), empty_kernel, (empty_late,))

    record["launch_us"] = time_cuda_graph(empties, BUDGET_S, WARMUP_S)[0].ms_median * 1e3 / rounds
    return record


def chain_record(torch, sms: int) -> dict:
    """The product chain persistent (a block per SM) and as a launch per phase: GPU time per graph replay, and
    whether the two give the same x and mid bit for bit."""
    record = {"probe": "product_chain", "blocks": sms, **CHAIN}
    arrays = chain_arrays(torch, **CHAIN)
    outputs = {}
    for persistent in (True, False):
        x = torch.empty_like(arrays[0])
        run = chain_launches(torch, sms, arrays, x, persistent, **CHAIN)
        run()
        torch.cuda.synchronize()
        outputs[persistent] = (x.clone(), arrays[2].clone())
        timing = time_cuda_graph(run, BUDGET_S, WARMUP_S)[0]
        record["persistent_ms" if persistent else "launches_ms"] = timing.ms_median
    record["identical"] = all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))
    # should the two builds order a tile's sums differently: how far apart, against the output's scale
    x_persistent, x_launches = (out[0].float() for out in (outputs[True], outputs[False]))
    record["relative_difference"] = float((x_persistent - x_launches).norm() / x_launches.norm())
    record["finite"] = bool(torch.isfinite(outputs[True][0].float()).all())
    weight_bytes = 2 * CHAIN["layers"] * (CHAIN["d_model"] * CHAIN["in_features"] + CHAIN["out_k"] * CHAIN["d_model"])
    record["weight_floor_ms"] = weight_bytes / (PEAK_HBM_TBPS * 1e9)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks-per-sm", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=96, help="barriers (and empty launches) per graph")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.environment import environment, gpu_slug
    from benchmarks.lm_bench import write_json

    raise_gpu_clocks(torch)
    env, records = environment(), []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = args.out / f"grid_barrier_{gpu_slug(env.get('gpu', 'gpu'))}.json"
    jobs = [functools.partial(barrier_record, torch, sms * per_sm, per_sm, args.rounds)
            for per_sm in args.blocks_per_sm] + [functools.partial(chain_record, torch, sms)]
    for job in jobs:
        try:
            record = job()
        except Exception as exc:  # noqa: BLE001 - a probe that fails to launch is a record too
            record = {"probe": job.func.__name__, "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(record), flush=True)
        records.append(record)
        write_json(path, {"benchmark": "grid_barrier", "environment": env, "method": __doc__, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
