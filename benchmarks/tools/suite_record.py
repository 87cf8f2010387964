"""The record of a whole GPU test-suite run: the parts `gpu_session.sh suite-1`, `suite-2` (and `suite-3`) write
JUnit XML, this turns them into one JSON (each test's outcome and seconds, the counts, why any test skipped, how
it was run).

    python benchmarks/tools/suite_record.py OUT_1 OUT_2 [OUT_3] --git-sha SHA \
        --out benchmarks/results/gpu_suite_h200.json

Each OUT is a folder a suite part wrote (suite_<half>.xml, .ids, .rc, .settings and gpu_name.txt), in the order
they ran: a test run again by a later part (suite-ids) takes that outcome, the earlier one kept in its entry and
counted apart ("passed on a rerun"). A test listed in an .ids file that no XML reports (the part's time cap cut
it: the cap interrupts pytest, which then writes the tests that ended) is counted as "not run", never as passed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import sys
import xml.etree.ElementTree as ET
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: benchmarks/tools/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jax_mamba2._files import write_atomically  # noqa: E402


def _junit_key(test_id: str) -> tuple[str, str]:
    """What JUnit XML calls pytest's node id "tests/k/test_x.py::TestY::test_z[p]": ("tests.k.test_x.TestY",
    "test_z[p]")."""
    path, *classes, name = test_id.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *classes]), name


def _test_id(case: ET.Element, listed: dict[tuple[str, str], str]) -> str:
    """The node id of a JUnit testcase: the listed id it names, else one made of its classname (a module)."""
    key = (case.get("classname", ""), case.get("name"))
    return listed.get(key) or f"{key[0].replace('.', '/')}.py::{key[1]}"


def _outcome(case: ET.Element) -> tuple[str, str | None]:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            return outcome, found.get("message")
    return "passed", None


class Part(NamedTuple):
    ids: list[str]            # the ids the part was given
    tests: dict[str, dict]    # id -> {"outcome", "seconds"[, "message"]}
    gpu: str
    runs: dict[str, dict]     # per suite_<half>: its exit status and settings, as the part wrote them


def _read_text(path: pathlib.Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def read_part(folder: pathlib.Path) -> Part:
    ids, tests, runs = [], {}, {}
    for ids_file in sorted(folder.glob("suite_*.ids")):
        ids += [line for line in ids_file.read_text().splitlines() if line.strip()]
        runs[ids_file.stem] = {"exit": _read_text(ids_file.with_suffix(".rc")),
                               "settings": _read_text(ids_file.with_suffix(".settings"))}
    listed = {_junit_key(test_id): test_id for test_id in ids}
    for xml_file in sorted(folder.glob("suite_*.xml")):
        for case in ET.parse(xml_file).getroot().iter("testcase"):
            if case.get("name") is None:  # a test the part's cap interrupted: pytest writes it without a name
                continue
            outcome, message = _outcome(case)
            entry = {"outcome": outcome, "seconds": round(float(case.get("time", 0.0)), 2)}
            if message is not None and outcome != "passed":
                entry["message"] = message[:300]
            tests[_test_id(case, listed)] = entry
    return Part(ids, tests, _read_text(folder / "gpu_name.txt") or "unknown", runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=pathlib.Path, help="folders written by gpu_session.sh suite-N")
    parser.add_argument("--git-sha", required=True, help="the commit the suite ran at")
    parser.add_argument("--method", default="", help="extra words on how it ran, appended to the default")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args(argv)

    ids, tests, gpus, runs = {}, {}, set(), {}
    for folder in args.parts:  # a later part (suite-ids) may run again what an earlier one ran: its outcome is final,
        part = read_part(folder)  # the earlier one kept beside it
        ids.update(dict.fromkeys(part.ids))
        for test_id, entry in part.tests.items():
            if test_id in tests:
                entry["earlier_run"] = tests[test_id]
            tests[test_id] = entry
        gpus.add(part.gpu)
        runs.update({f"{folder.name}/{name}": run for name, run in part.runs.items()})
    for test_id in ids:  # given to a part but never reported: the cap cut it
        tests.setdefault(test_id, {"outcome": "not run", "seconds": None})
    counts = collections.Counter(entry["outcome"] for entry in tests.values())
    rerun = {test_id: entry["earlier_run"]["outcome"] for test_id, entry in sorted(tests.items())
             if "earlier_run" in entry and entry["earlier_run"]["outcome"] != entry["outcome"]}
    method = ("every test collected by `pytest -m gpu tests` at this commit, the ids dealt in turn to the parts (the "
              "long sweeps first; how many parts: `parts` in each run's settings), each part one device call of "
              "`benchmarks/tools/gpu_session.sh suite-N`: "
              "pytest-xdist workers sharing the GPU (each part's settings under `runs`), JAX_MAMBA2_AUTOTUNE=0; "
              "seconds are each test's own under that contention. " + args.method).strip()
    record = {
        "benchmark": "the GPU test suite (pytest -m gpu)",
        "git_sha": args.git_sha,
        "date": datetime.date.today().isoformat(),
        "gpu": " / ".join(sorted(gpus)),
        "method": method,
        "runs": runs,
        "collected": len(ids),
        "counts": dict(sorted(counts.items())),
        "passed_on_a_rerun": {test_id: earlier for test_id, earlier in rerun.items()
                              if tests[test_id]["outcome"] == "passed"},
        "not_passed": {test_id: entry for test_id, entry in sorted(tests.items()) if entry["outcome"] != "passed"},
        "tests": dict(sorted(tests.items())),
    }
    write_atomically(args.out, (json.dumps(record, indent=1) + "\n").encode())
    print(f"{args.out}: {record['collected']} collected, {record['counts']}, "
          f"{len(record['passed_on_a_rerun'])} passed on a rerun")


if __name__ == "__main__":
    main()
