"""Overlays the loss curves of `examples/train_lm.py` runs (e.g. backend cutile vs xla) and compares them.

    python benchmarks/train_curves.py OUT_A/train_lm/metrics.json OUT_B/train_lm/metrics.json \
        --png benchmarks/results/train_curves_h200.png

Prints, for each run after the first, the largest relative difference of its training loss from the
first run's at the steps both logged, and exits 1 when it exceeds --tolerance (default 5%): two
backends that compute the same model must train the same way.
"""
import argparse
import json
import pathlib
import sys


def load_run(path: pathlib.Path) -> tuple[str, dict[int, float]]:
    metrics = json.loads(path.read_text())
    return metrics["backend"], {int(step): float(loss) for step, loss in metrics["history"]["train"]}


def max_relative_gap(reference: dict[int, float], other: dict[int, float]) -> float:
    steps = sorted(set(reference) & set(other))
    if not steps:
        raise ValueError("the runs logged no common step")
    return max(abs(other[s] - reference[s]) / abs(reference[s]) for s in steps)


def plot(runs: list[tuple[str, dict[int, float]]], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in runs:
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], label=f"backend {label}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", type=pathlib.Path, help="metrics.json files of train_lm runs")
    parser.add_argument("--png", type=pathlib.Path, required=True)
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args(argv)
    runs = [load_run(p) for p in args.metrics]
    plot(runs, args.png)
    worst = 0.0
    for label, losses in runs[1:]:
        gap = max_relative_gap(runs[0][1], losses)
        worst = max(worst, gap)
        print(f"{label} vs {runs[0][0]}: max relative training-loss difference {gap:.4f}")
    print(f"plot: {args.png}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
