"""The record of a whole GPU test-suite run: `gpu_session.sh suite-1` and `suite-2` write JUnit XML, this turns
them into one JSON (each test's outcome and seconds, the counts, why any test skipped, how it was run).

    python benchmarks/tools/suite_record.py OUT_1 OUT_2 --git-sha SHA --out benchmarks/results/gpu_suite_h200.json

Each OUT is a folder a suite part wrote (suite_<half>.xml, suite_<half>.ids, gpu_name.txt), in the order they
ran: a test run again by a later part (suite-ids) takes that outcome, the earlier one kept in its entry. A test
listed in an .ids file that no XML reports (the part's time cap cut it) is counted as "not run", never as passed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

if __package__ in (None, ""):  # run as a script: benchmarks/tools/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jax_mamba2._files import write_atomically  # noqa: E402


def _test_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase: classname "tests.kernels.test_x" + name "test_y[p]"."""
    module_path = case.get("classname", "").replace(".", "/") + ".py"
    return f"{module_path}::{case.get('name')}"


def _outcome(case: ET.Element) -> tuple[str, str | None]:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            return outcome, found.get("message")
    return "passed", None


def read_part(folder: pathlib.Path) -> tuple[list[str], dict[str, dict], str]:
    """(the ids the part was given, {id: {"outcome", "seconds"[, "message"]}}, the GPU's name)."""
    ids, tests = [], {}
    for ids_file in sorted(folder.glob("suite_*.ids")):
        ids += [line for line in ids_file.read_text().splitlines() if line.strip()]
    for xml_file in sorted(folder.glob("suite_*.xml")):
        for case in ET.parse(xml_file).getroot().iter("testcase"):
            outcome, message = _outcome(case)
            entry = {"outcome": outcome, "seconds": round(float(case.get("time", 0.0)), 2)}
            if message is not None and outcome != "passed":
                entry["message"] = message[:300]
            tests[_test_id(case)] = entry
    name_file = folder / "gpu_name.txt"
    gpu = name_file.read_text().strip() if name_file.exists() else "unknown"
    return ids, tests, gpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=pathlib.Path, help="folders written by gpu_session.sh suite-N")
    parser.add_argument("--git-sha", required=True, help="the commit the suite ran at")
    parser.add_argument("--method", default="", help="extra words on how it ran, appended to the default")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args(argv)

    ids, tests, gpus = {}, {}, set()
    for folder in args.parts:  # a later part (suite-ids) may run again what an earlier one ran: its outcome is final,
        part_ids, part_tests, gpu = read_part(folder)  # the earlier one kept beside it
        ids.update(dict.fromkeys(part_ids))
        for test_id, entry in part_tests.items():
            if test_id in tests:
                entry["earlier_run"] = tests[test_id]
            tests[test_id] = entry
        gpus.add(gpu)
    for test_id in ids:  # given to a part but never reported: the cap cut it
        tests.setdefault(test_id, {"outcome": "not run", "seconds": None})
    counts = collections.Counter(entry["outcome"] for entry in tests.values())
    method = ("every test collected by `pytest -m gpu tests` at this commit, the ids alternately in two halves (the "
              "long sweeps first), each half one device call of `benchmarks/tools/gpu_session.sh suite-N`: pytest "
              "-n 16 or 8 --dist load (pytest-xdist workers sharing the GPU, XLA_PYTHON_CLIENT_PREALLOCATE=false), "
              "JAX_MAMBA2_AUTOTUNE=0; seconds are each test's own under that contention. " + args.method).strip()
    record = {
        "benchmark": "the GPU test suite (pytest -m gpu)",
        "git_sha": args.git_sha,
        "date": datetime.date.today().isoformat(),
        "gpu": " / ".join(sorted(gpus)),
        "method": method,
        "collected": len(ids),
        "counts": dict(sorted(counts.items())),
        "not_passed": {test_id: entry for test_id, entry in sorted(tests.items()) if entry["outcome"] != "passed"},
        "tests": dict(sorted(tests.items())),
    }
    write_atomically(args.out, (json.dumps(record, indent=1) + "\n").encode())
    print(f"{args.out}: {record['collected']} collected, {record['counts']}")


if __name__ == "__main__":
    main()
