"""Compares the loss curves of `examples/train_lm.py` runs (e.g. backend cutile vs xla) and plots them.

    python benchmarks/train_curves.py benchmarks/results/train_lm_h200.json \
        --png benchmarks/results/train_curves_h200.png
    python benchmarks/train_curves.py OUT_A/train_lm/metrics.json OUT_B/train_lm/metrics.json --png OUT.png

Each file is one run's metrics.json (it names its "backend") or a record of several runs keyed by backend
(benchmarks/results/train_lm_h200.json). The reference is the run of --reference (default: the first).
Prints, for each other run, the largest relative difference of its training loss from the reference's at the
steps both logged, and exits 1 when it exceeds --tolerance: two backends that compute the same model must
train the same way. The plot has the training losses on one axis (each run in its own line style, so equal
curves stay visible) and, below, each run's difference from the reference in percent.
"""
import argparse
import json
import pathlib
import sys

# Line styles per run, in order: the reference wide and solid, the others narrower and dashed on top of it.
_STYLES = ({"color": "#8c8c8c", "linewidth": 3.0, "linestyle": "-"},
           {"color": "#76b900", "linewidth": 1.4, "linestyle": "--"},
           {"color": "#1f77b4", "linewidth": 1.2, "linestyle": ":"})


def load_runs(path: pathlib.Path) -> list[tuple[str, dict[int, float]]]:
    """The runs of a metrics.json (one) or of a record keyed by backend (one per key, in file order)."""
    metrics = json.loads(pathlib.Path(path).read_text())
    runs = [metrics] if "backend" in metrics else list(metrics.values())
    return [(run["backend"], {int(step): float(loss) for step, loss in run["history"]["train"]}) for run in runs]


def relative_gaps(reference: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """(other - reference) / |reference| at every step both logged."""
    steps = sorted(set(reference) & set(other))
    if not steps:
        raise ValueError("the runs logged no common step")
    return {s: (other[s] - reference[s]) / abs(reference[s]) for s in steps}


def max_relative_gap(reference: dict[int, float], other: dict[int, float]) -> float:
    return max(abs(gap) for gap in relative_gaps(reference, other).values())


def plot(runs: list[tuple[str, dict[int, float]]], path: pathlib.Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jax_mamba2._files import save_figure

    fig, (losses_ax, gap_ax) = plt.subplots(2, 1, figsize=(8, 6.2), sharex=True,
                                            gridspec_kw={"height_ratios": [3, 1.6]})
    reference_label, reference = runs[0]
    for k, (label, losses) in enumerate(runs):
        steps = sorted(losses)
        losses_ax.plot(steps, [losses[s] for s in steps], label=f"backend {label}", **_STYLES[k % len(_STYLES)])
    losses_ax.set_ylabel("training loss (nats per byte)")
    losses_ax.legend()
    losses_ax.grid(alpha=0.3)
    for k, (label, losses) in enumerate(runs[1:], start=1):
        gaps = relative_gaps(reference, losses)
        style = dict(_STYLES[k % len(_STYLES)], linestyle="-", linewidth=1.0)
        gap_ax.plot(list(gaps), [100 * g for g in gaps.values()], label=f"{label} - {reference_label}", **style)
        worst = max(gaps, key=lambda s: abs(gaps[s]))
        gap_ax.annotate(f"largest: {100 * gaps[worst]:+.2f}% at step {worst}", (worst, 100 * gaps[worst]),
                        xytext=(8, 0), textcoords="offset points", fontsize=8, va="center")
    gap_ax.axhline(0.0, color="k", linewidth=0.8)
    gap_ax.set_ylabel(f"difference from\n{reference_label} (% of its loss)")
    gap_ax.set_xlabel("training step")
    gap_ax.legend(fontsize=8, loc="lower left")
    gap_ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", type=pathlib.Path,
                        help="metrics.json files of train_lm runs, or records of several runs keyed by backend")
    parser.add_argument("--png", type=pathlib.Path, required=True, help="where to write the plot")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest relative training-loss difference that passes (default: %(default)s)")
    parser.add_argument("--reference", help="backend of the run the others are compared with (default: the "
                        "first run's)")
    parser.add_argument("--title", default="", help="the plot's title (default: none)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.metrics if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    runs = [run for path in args.metrics for run in load_runs(path)]
    if len(runs) < 2:
        parser.error(f"need at least two runs to compare, got {len(runs)}")
    if args.reference is not None:
        backends = [label for label, _ in runs]
        if args.reference not in backends:
            parser.error(f"--reference {args.reference!r} is not one of the runs' backends {backends}")
        runs.insert(0, runs.pop(backends.index(args.reference)))
    plot(runs, args.png, args.title)
    worst = 0.0
    for label, losses in runs[1:]:
        gap = max_relative_gap(runs[0][1], losses)
        worst = max(worst, gap)
        print(f"{label} vs {runs[0][0]}: max relative training-loss difference {gap:.4f}")
    print(f"plot: {args.png}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
