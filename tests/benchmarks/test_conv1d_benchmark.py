"""benchmarks/conv1d.py on the CPU (xla only, a tiny shape): the floor and the JSON records."""
import json

from benchmarks import conv1d


def test_floor_bytes_count_one_pass_over_each_tensor():
    # (8, 2048, 2304) bf16: 151 MB forward (x, y), 377 MB forward + backward (x, y; x, dy, dx).
    assert conv1d.floor_bytes((8, 2048, 2304), "fwd") == 2 * 2 * 8 * 2048 * 2304
    assert conv1d.floor_bytes((8, 2048, 2304), "fwd_bwd") == 5 * 2 * 8 * 2048 * 2304


def test_cli_writes_records_with_errors_against_float32(tmp_path, capsys):
    assert conv1d.main(["--impls", "xla", "--shapes", "2,37,24", "--budget-seconds", "0.05",
                        "--out", str(tmp_path)]) == 0
    for direction, names in (("fwd", {"y"}), ("fwd_bwd", {"y", "dx", "dkernel", "dbias"})):
        (path,) = [p for p in tmp_path.glob("conv1d_*.json") if p.name.rsplit("_", 1)[0] == f"conv1d_{direction}"]
        (record,) = json.loads(path.read_text())
        assert record["impl"] == "xla" and record["shape"] == [2, 37, 24] and record["ms_pipelined"] > 0
        assert set(record["errors"]) == names and max(record["errors"].values()) < 1e-2
    assert capsys.readouterr().out.count("xla") == 2
