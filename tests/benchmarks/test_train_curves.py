import json

import pytest

from benchmarks import train_curves


def _metrics(backend, losses):
    return {"backend": backend, "history": {"train": [[step, loss] for step, loss in losses], "eval": []}}


def _write(path, backend, losses):
    path.write_text(json.dumps(_metrics(backend, losses)))
    return path


def test_train_curves_compares_common_steps_and_plots(tmp_path):
    a = _write(tmp_path / "a.json", "xla", [(0, 5.0), (10, 3.0), (20, 2.0)])
    b = _write(tmp_path / "b.json", "cutile", [(0, 5.0), (10, 3.03), (20, 2.0), (30, 1.9)])
    png = tmp_path / "curves.png"
    assert train_curves.main([str(a), str(b), "--png", str(png)]) == 0
    assert png.stat().st_size > 0
    (_, losses_a), = train_curves.load_runs(a)
    (_, losses_b), = train_curves.load_runs(b)
    assert abs(train_curves.max_relative_gap(losses_a, losses_b) - 0.01) < 1e-9


def test_train_curves_fails_when_runs_diverge(tmp_path):
    a = _write(tmp_path / "a.json", "xla", [(0, 5.0), (10, 3.0)])
    b = _write(tmp_path / "b.json", "cutile", [(0, 5.0), (10, 4.0)])
    assert train_curves.main([str(a), str(b), "--png", str(tmp_path / "c.png")]) == 1


def test_a_record_of_runs_keyed_by_backend_compares_against_the_reference(tmp_path, capsys):
    record = tmp_path / "train_lm.json"
    record.write_text(json.dumps({"cutile": _metrics("cutile", [(1, 4.0), (2, 2.02)]),
                                  "xla": _metrics("xla", [(1, 4.0), (2, 2.0)])}))
    assert [label for label, _ in train_curves.load_runs(record)] == ["cutile", "xla"]
    assert train_curves.main([str(record), "--reference", "xla", "--png", str(tmp_path / "c.png")]) == 0
    assert "cutile vs xla: max relative training-loss difference 0.0100" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_curves.main([str(record), "--reference", "scan", "--png", str(tmp_path / "c.png")])


def test_signed_gaps_and_the_difference_panel(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    reference, other = {1: 2.0, 2: 4.0}, {1: 2.0, 2: 3.0, 3: 1.0}
    assert train_curves.relative_gaps(reference, other) == {1: 0.0, 2: -0.25}
    with pytest.raises(ValueError, match="no common step"):
        train_curves.relative_gaps(reference, {5: 1.0})
    saved = []
    render = plt.Figure.savefig  # the figure is kept for the assertions and still rendered
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: (saved.append(fig), render(fig, path, **kw)))
    train_curves.plot([("xla", reference), ("cutile", other)], tmp_path / "c.png")
    losses_ax, gap_ax = saved[0].axes
    assert [line.get_linestyle() for line in losses_ax.get_lines()] == ["-", "--"]
    assert list(gap_ax.get_lines()[0].get_ydata()) == [0.0, -25.0]
