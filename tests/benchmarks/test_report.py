"""benchmarks/report.py's README table and plot, from records shaped as benchmarks/ssd.py writes them."""
import json
import pathlib
import re

import pytest

from benchmarks import report, ssd


def _record(impl, ms, shape=ssd.Shape(4, 2048, 32, 64, 128, 1), *, error=None, tuning=None):
    line = ssd.roofline(shape, chunk_size=64)
    return {"op": "ssd", "direction": "fwd", "impl": impl, "shape": shape._asdict(), "dtype": "bfloat16",
            "chunk_size": 64, "error": error, "ms_median": ms, "ms_p20": ms, "ms_p80": ms,
            "ms_pipelined": None if error else ms, "roofline": line, "gpu": "NVIDIA H200", "tuning": tuning}


@pytest.fixture
def records():
    wide = ssd.Shape(4, 8192, 32, 64, 256, 1)
    return [_record("cutile", 0.2, tuning={"chunk_cumsum": {}, "fused_scan": {}}), _record("xla", 2.0),
            _record("mamba_ssm", 0.6), _record("jla", 0.25),
            _record("cutile", 0.3, wide, tuning={"chunk_cumsum": {}, "segment_states": {}, "segmented_scan": {}}),
            _record("mamba_ssm", 0.9, wide), _record("jla", 0.0, wide, error="ValueError: head dims")]


def test_layout_is_read_off_the_tuned_stage_names(records):
    assert [report.layout(r) for r in records if r["impl"] == "cutile"] == ["fused", "segmented"]
    assert report.layout(records[1]) is None


def test_markdown_table_has_speedups_over_each_peer_and_na_for_a_peer_that_failed(records):
    lines = report.markdown_table(records).splitlines()
    assert lines[0].startswith("| shape (B, L, H, P, N, G) | plan | cuTile | mamba_ssm | jax-linear-attention |")
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    floor = ssd.roofline(ssd.Shape(4, 2048, 32, 64, 128, 1), chunk_size=64)["floor_ms"]
    assert lines[2] == (f"| (4, 2048, 32, 64, 128, 1) | fused | 0.200 | 0.600 | 0.250 | 2.000 | 3.00x | 1.25x "
                        f"| {floor:.3f} |")
    assert "| (4, 8192, 32, 64, 256, 1) | segmented | 0.300 | 0.900 | n/a | n/a | 3.00x | n/a |" in lines[3]


def test_plot_has_a_time_panel_on_a_log_axis_and_a_speedup_panel(records, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    saved = []
    render = plt.Figure.savefig  # the figure is kept for the assertions and still rendered
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: (saved.append(fig), render(fig, path, **kw)))
    report.plot_records(records, tmp_path / "plot.png")
    (fig,) = saved
    times, speedups = fig.axes
    assert times.get_yscale() == "log"
    legend = [t.get_text() for t in times.get_legend().get_texts()]
    assert legend == ["roofline floor (ideal fused kernel)", "jax-mamba2 cuTile", "jax-linear-attention (Pallas)",
                      "mamba_ssm (Triton)", "jax-mamba2 XLA (pure JAX)"]
    heights = sorted(round(p.get_height(), 6) for p in speedups.patches)
    assert heights == [1.25, 3.0, 3.0]  # 0.6/0.2, 0.25/0.2, 0.9/0.3; none for the failed jla run


def test_plot_writes_a_png(records, tmp_path):
    assert report.plot_records(records, tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_committed_record_names_its_commit_as_a_bare_id():
    """A record's `git_sha` is the commit id it ran (what varied lives in other fields, e.g. `variant`), so that
    `git show` finds the tree of every figure."""
    def shas(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "git_sha":
                    yield value
                yield from shas(value)
        elif isinstance(node, list):
            for value in node:
                yield from shas(value)

    results = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    found = {(path.name, sha) for path in results.glob("*.json") for sha in shas(json.loads(path.read_text()))}
    assert len(found) > 50
    assert not [(name, sha) for name, sha in found if not re.fullmatch(r"[0-9a-f]{7,40}", str(sha))]
