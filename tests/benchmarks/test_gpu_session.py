"""benchmarks/tools/gpu_session.sh: every benchmark command it runs parses with that script's own arguments (a flag
renamed in a script must not leave a session step that exits at once on the GPU machine)."""
import re
import shlex
from pathlib import Path

import pytest

from benchmarks import lm_decode, lm_train, ssd

SESSION = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "gpu_session.sh"
PARSERS = {"lm_train": lm_train.parse_args, "lm_decode": lm_decode.parse_args, "ssd": ssd.parse_args}


def _commands():
    """(script name, argv) of each `python benchmarks/<name>.py ...` of the session with a parser here, a command
    ending at a line end, `;`, `|` or `&&`: the output folder "$out" stands in as a path, array expansions (optional
    peer flags) are left out, and a command with another shell variable (a loop's value) is skipped."""
    text = re.sub(r"\\\n\s*", " ", SESSION.read_text())
    text = re.sub(r'"\$\{\w+\[@\]\}"', "", text).replace('"$out"', "/tmp/out")
    found = []
    for match in re.finditer(r"python benchmarks/(\w+)\.py([^\n;|&]*)", text):
        if match.group(1) in PARSERS and "$" not in match.group(2):
            found.append((match.group(1), shlex.split(match.group(2))))
    return found


def test_the_session_runs_the_benchmarks_it_can_parse():
    assert {name for name, _ in _commands()} == set(PARSERS)


@pytest.mark.parametrize("name,argv", _commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_session_command_parses(name, argv):
    PARSERS[name](argv)
