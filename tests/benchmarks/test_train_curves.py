import json

from benchmarks import train_curves


def _write(path, backend, losses):
    path.write_text(json.dumps({"backend": backend, "history": {
        "train": [[step, loss] for step, loss in losses], "eval": []}}))
    return path


def test_train_curves_compares_common_steps_and_plots(tmp_path):
    a = _write(tmp_path / "a.json", "xla", [(0, 5.0), (10, 3.0), (20, 2.0)])
    b = _write(tmp_path / "b.json", "cutile", [(0, 5.0), (10, 3.03), (20, 2.0), (30, 1.9)])
    png = tmp_path / "curves.png"
    assert train_curves.main([str(a), str(b), "--png", str(png)]) == 0
    assert png.stat().st_size > 0
    assert abs(train_curves.max_relative_gap(train_curves.load_run(a)[1], train_curves.load_run(b)[1])
               - 0.01) < 1e-9


def test_train_curves_fails_when_runs_diverge(tmp_path):
    a = _write(tmp_path / "a.json", "xla", [(0, 5.0), (10, 3.0)])
    b = _write(tmp_path / "b.json", "cutile", [(0, 5.0), (10, 4.0)])
    assert train_curves.main([str(a), str(b), "--png", str(tmp_path / "c.png")]) == 1
