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

On the GPU machine (torch and cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/grid_barrier.py --out $OUT
Writes <out>/grid_barrier_<gpu>.json (one record per grid and variant) and prints one line per record.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cuda.tile as ct

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# A block that spins this often without seeing every block arrive gives up (and counts the round as late), so a
# grid that is not resident at once ends instead of hanging the GPU.
SPIN_LIMIT = 1 << 22
BUDGET_S, WARMUP_S = 0.2, 0.1


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
        # release: the stamp is visible to whoever sees this arrival
        ct.atomic_add(counter, 0, 1, memory_order=ct.MemoryOrder.RELEASE)
        seen = ct.atomic_add(counter, 0, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        spins = 0
        while (seen < (r + 1) * blocks) & (spins < SPIN_LIMIT):
            seen = ct.atomic_add(counter, 0, 0, memory_order=ct.MemoryOrder.ACQUIRE)
            spins += 1
        neighbour = ct.gather(stamps, (block + 1) % blocks)
        missed += ct.where(neighbour < r + 1, 1, 0)
    ct.scatter(late, block, missed)


@ct.kernel
def empty_kernel(late):
    """Nothing but a launch (the block that is never 0 at once writes nothing)."""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks-per-sm", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=96, help="barriers (and empty launches) per graph")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.environment import environment, gpu_slug
    from benchmarks.lm_bench import write_json
    from benchmarks.ssd import raise_gpu_clocks, time_cuda_graph

    raise_gpu_clocks(torch)
    env, records = environment(), []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = args.out / f"grid_barrier_{gpu_slug(env.get('gpu', 'gpu'))}.json"
    for per_sm in args.blocks_per_sm:
        blocks = sms * per_sm
        record = {"blocks": blocks, "blocks_per_sm": per_sm, "rounds": args.rounds}
        try:
            (counter, _, late), once = barrier_launch(torch, blocks, args.rounds)
            once()
            torch.cuda.synchronize()
            record.update(counter=int(counter.item()), late_rounds=int(late.sum().item()))
            times = {rounds: time_cuda_graph(barrier_launch(torch, blocks, rounds)[1], BUDGET_S, WARMUP_S)[0]
                     for rounds in (0, args.rounds)}
            record["barrier_us"] = (times[args.rounds].ms_median - times[0].ms_median) * 1e3 / args.rounds
            record["barrier_graph_ms"] = {str(k): t.ms_median for k, t in times.items()}
            empty_late = torch.zeros(1, device="cuda", dtype=torch.int32)

            def empties():
                for _ in range(args.rounds):
                    ct.launch(torch.cuda.current_stream(), (blocks,), empty_kernel, (empty_late,))

            empty = time_cuda_graph(empties, BUDGET_S, WARMUP_S)[0]
            record["launch_us"] = empty.ms_median * 1e3 / args.rounds
        except Exception as exc:  # noqa: BLE001 - a grid that fails to launch is a record too
            record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(record), flush=True)
        records.append(record)
        write_json(path, {"benchmark": "grid_barrier", "environment": env, "method": __doc__, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
