"""benchmarks/tools/suite_record.py: the GPU suite's record from the parts' JUnit XML, where a test the cap cut is
"not run" (never passed) and a rerun's outcome is final with the first one kept beside it."""
import json

from benchmarks.tools import suite_record

_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{}</testsuite></testsuites>"""


def _case(module, name, seconds, inner=""):
    return f'<testcase classname="tests.{module}" name="{name}" time="{seconds}">{inner}</testcase>'


def _part(folder, half, ids, cases, gpu="NVIDIA H100 80GB HBM3"):
    folder.mkdir()
    (folder / f"suite_{half}.ids").write_text("".join(f"{i}\n" for i in ids))
    (folder / f"suite_{half}.xml").write_text(_XML.format("".join(cases)))
    (folder / "gpu_name.txt").write_text(gpu + "\n")
    (folder / f"suite_{half}.rc").write_text("123\n")  # xargs: some pytest exited 1 (a test failed)
    (folder / f"suite_{half}.settings").write_text("workers=8 allocator=platform cap_s=540\n")
    return folder


def test_the_record_counts_cut_tests_as_not_run_and_keeps_a_rerun_s_first_outcome(tmp_path):
    """Three tests listed; one cut by the cap (interrupted: a nameless testcase), one failed then passed on a rerun, one in a class (JUnit names
    its class in the classname)."""
    a, b, c = "tests/test_x.py::TestK::test_a[p1]", "tests/test_x.py::test_b", "tests/test_x.py::test_c"
    first = _part(tmp_path / "one", 1, [a, b, c], [
        _case("test_x.TestK", "test_a[p1]", 1.5),
        _case("test_x", "test_b", 2.0, '<failure message="RESOURCE_EXHAUSTED: out of memory">trace</failure>'),
        '<testcase time="0.000" />'])  # what pytest writes for a test its interruption at the cap cut short
    rerun = _part(tmp_path / "rerun", "ids", [b], [_case("test_x", "test_b", 3.25)])
    out = tmp_path / "record.json"
    suite_record.main([str(first), str(rerun), "--git-sha", "abc1234", "--out", str(out)])

    record = json.loads(out.read_text())
    assert record["collected"] == 3 and record["git_sha"] == "abc1234"
    assert record["counts"] == {"not run": 1, "passed": 2}
    assert record["tests"][a] == {"outcome": "passed", "seconds": 1.5}
    assert record["tests"][b]["outcome"] == "passed"
    assert record["tests"][b]["earlier_run"]["outcome"] == "failed"
    assert "out of memory" in record["tests"][b]["earlier_run"]["message"]
    assert record["not_passed"] == {c: {"outcome": "not run", "seconds": None}}
    assert record["passed_on_a_rerun"] == {b: "failed"}  # counted apart, not only inside the entry
    assert record["runs"]["one/suite_1"] == {"exit": "123", "settings": "workers=8 allocator=platform cap_s=540"}
    assert record["gpu"] == "NVIDIA H100 80GB HBM3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "record.json", "rerun"]  # no stray temporary
