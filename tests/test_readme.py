"""README.md holds what it promises: every Python snippet runs as written, on its own, with finite results; its
result tables are the ones benchmarks/report.py makes from the committed JSON records; its links resolve.
"""
import functools
import inspect
import json
import math
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_mamba2
from benchmarks import report
from jax_mamba2 import backends, cross_entropy

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def _inexact_arrays(value):
    """The floating-point arrays in a namespace value: arrays, containers of them, NNX modules' state."""
    if isinstance(value, nnx.Module):
        value = nnx.state(value)
    elif not isinstance(value, (jax.Array, tuple, list, dict)):
        return []
    return [leaf for leaf in jax.tree.leaves(value)
            if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)]


@functools.cache
def run_snippet(index: int) -> dict:
    """README snippet `index` run alone, as written, in a fresh namespace (once per test session)."""
    namespace = {"__name__": f"readme_snippet_{index}"}
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), namespace)
    return namespace


def _marks(snippet: str):
    # Compiling a training step of the LM takes ~40 s of CPU: the full suite runs it, the quick one does not.
    return [pytest.mark.slow] if "nnx.Optimizer" in snippet else []


def test_the_readme_has_its_snippets_and_stays_short():
    assert len(SNIPPETS) >= 2
    assert len(README.splitlines()) <= 200


@pytest.mark.parametrize("index", [pytest.param(i, marks=_marks(s), id=f"snippet{i}") for i, s in enumerate(SNIPPETS)])
def test_snippet_runs_alone_and_every_array_it_leaves_is_finite(index):
    namespace = run_snippet(index)
    arrays = {name: _inexact_arrays(value) for name, value in namespace.items() if not name.startswith("__")}
    assert any(arrays.values()), f"snippet {index} leaves no array to check"
    for name, leaves in arrays.items():
        for leaf in leaves:
            assert np.isfinite(np.asarray(leaf, dtype=np.float32)).all(), f"snippet {index}: {name} is not finite"


def test_the_op_snippet_returns_outputs_and_gradients_of_the_documented_shapes():
    ns = run_snippet(0)
    assert ns["y"].shape == ns["x"].shape and ns["y"].dtype == jnp.bfloat16
    assert ns["final_states"].shape == (2, 4, 32, 32)
    assert ns["grad_x"].shape == ns["x"].shape and ns["grad_B"].shape == ns["B"].shape
    assert float(jnp.abs(ns["grad_x"].astype(jnp.float32)).sum()) > 0


@pytest.mark.slow
def test_the_layer_snippet_trains_and_samples():
    ns = run_snippet(1)
    assert ns["out"].shape == (2, 48, 64)
    assert math.isfinite(float(ns["loss"]))
    assert ns["sample"].shape == (1, 8 + 16)
    assert int(ns["sample"].max()) < ns["config"].vocab_size


@pytest.mark.parametrize("record", ["ssd_fwd_h200.json", "ssd_fwd_bwd_h200.json"])
def test_result_tables_are_the_committed_records(record):
    table = report.markdown_table(report.load_records(REPO / "benchmarks" / "results" / record))
    assert table in README, f"README's table of {record} differs from `python -m benchmarks.report ... --markdown`"


def test_local_links_resolve_and_no_lab_history():
    targets = re.findall(r"\]\(([^)#]+)\)", README) + re.findall(r"`((?:benchmarks|docs|examples)/[\w./]+)`", README)
    local = [t for t in targets if not t.startswith("http")]
    assert local and all((REPO / t).exists() for t in local), [t for t in local if not (REPO / t).exists()]
    assert not re.search(r"\b(run|issue) \d+\b|\b[0-9a-f]{7}\b", README)


def _numbers(records: tuple[str, ...], fields: tuple[str, ...], decimals: int) -> set[str]:
    """Every value of `fields` (at any depth) in the records benchmarks/results/<records>, as text."""
    def values(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in fields and isinstance(value, (int, float)):
                    yield value
                yield from values(value)
        elif isinstance(node, list):
            for value in node:
                yield from values(value)

    return {f"{v:.{decimals}f}" for name in records
            for v in values(json.loads((REPO / "benchmarks" / "results" / name).read_text()))}


def _table_cells(start: str, end: str) -> list[list[str]]:
    """The cells of the data rows of the README's tables between the texts `start` and `end`."""
    section = README[README.index(start):README.index(end)]
    headers = ("| model", "| one H100", "| d_model")
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(headers) and "---" not in line]


def test_lm_and_decode_table_figures_are_in_the_committed_records():
    """The hand-written result tables quote records: each step time of the LM tables is a median of an
    lm_train record, each decode time or floor a decode record's (as rounded in the table), of the records
    the README cites there."""
    cited = ("lm_decode_h200.json", "lm_decode_64_h200.json", "lm_decode_8_256_h200.json", "lm_decode_h100.json",
             "lm_decode_f32_h100.json", "lm_train_peer_h100.json", "lm_train_h200.json")
    assert all(f"{name}`" in README for name in cited)
    decode = _numbers(tuple(n for n in cited if n.startswith("lm_decode")), ("ms_per_token", "weights_ms"), 3)
    rows = _table_cells("Decoding (`benchmarks/lm_decode.py`", "## Limitations")
    figures = [f for row in rows for cell in row[1:] for f in re.findall(r"(?<![\d.])\d+\.\d{3}(?![\dx])", cell)]
    assert len(figures) > 60 and not [f for f in figures if f not in decode]
    steps = _numbers(tuple(n for n in cited if n.startswith("lm_train")), ("ms_median",), 1)
    rows = _table_cells("The LM training step (`benchmarks/lm_train.py`)", "Decoding (`benchmarks/lm_decode.py`")
    columns = {6: (1, 2, 3), 9: (1, 2, 6)}  # the H100 table's and the H200 table's step columns, by row width
    figures = [cell.rstrip(" *") for row in rows for i in columns[len(row)] for cell in [row[i]] if cell != "-"]
    assert len(figures) > 20 and not [f for f in figures if f not in steps]


def test_the_install_line_names_the_python_and_jax_that_pyproject_requires():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    python = project["requires-python"].removeprefix(">=")
    (jax_min,) = [d.removeprefix("jax>=") for d in project["dependencies"] if d.startswith("jax>=")]
    assert f"(Python {python}+, JAX {jax_min}+)" in README


def _options_rows() -> list[list[str]]:
    """The cells of the rows of README's table "Options and environment variables"."""
    section = README[README.index("## Options and environment variables"):README.index("## Results")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]


def _readme_value(text: str):
    """A default as the options table writes it: None, True, False, an int, "(0, inf)" or a quoted string."""
    text = text.strip("`")
    return {"None": None, "True": True, "False": False, "(0, inf)": (0.0, math.inf)}.get(
        text, text.strip('"') if text.startswith('"') else int(text) if text.isdigit() else text)


def test_the_options_table_states_the_signature_defaults():
    """Each row of `ssd(...)` options, and the LM's `remat=, scan_layers=`, gives each option the default of its
    signature, in its order; the first row's functions all default to backend="auto"."""
    from jax_mamba2 import Mamba2LMHeadModel, ssd
    functions = {"ssd": ssd, "Mamba2LMHeadModel": Mamba2LMHeadModel.__init__}
    checked = 0
    for names, defaults, _ in _options_rows():
        match = re.fullmatch(r"`(ssd|Mamba2LMHeadModel)\(((?:\w+=(?:, )?)+)\)`", names)
        if not match:
            continue
        options = match.group(2).replace("=", "").split(", ")
        values = [_readme_value(v) for v in re.split(r", (?![^(]*\))", defaults)]
        signature = inspect.signature(functions[match.group(1)]).parameters
        assert values == [signature[name].default for name in options], names
        checked += 1
    assert checked >= 6
    (first, default, _) = _options_rows()[0]
    assert _readme_value(default) == "auto"
    for name in re.findall(r"`(\w+)`", first):
        assert inspect.signature(getattr(jax_mamba2, name)).parameters["backend"].default == "auto", name


def test_the_options_table_names_every_loss_backend_the_model_takes():
    """The row of `Mamba2LMHeadModel(loss_backend=)` lists every name the model accepts for it."""
    (row,) = [cells for cells in _options_rows() if "loss_backend=" in cells[0]]
    listed = set(re.findall(r'`"(\w+)"`', row[2].rsplit("; or ", 1)[1]))
    assert listed == {"auto", *backends.known_names(cross_entropy.OP)}


def test_the_test_command_is_the_one_ci_runs():
    """README's "everything CI runs" line is the pytest command of .ci/run."""
    (command,) = re.findall(r"^ {4}(python -m pytest [^#\n]*?)\s+# everything CI runs", README, re.M)
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(rf"^python3? {re.escape(command.removeprefix('python '))}$", ci, re.M), command
