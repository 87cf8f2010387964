"""README.md holds what it promises: every Python snippet runs as written, on its own, with finite results; its
result tables are the ones benchmarks/report.py makes from the committed JSON records; its links resolve.
"""
import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import report

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
