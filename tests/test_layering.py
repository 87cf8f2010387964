"""The package's data flow, read off its import statements: flax_layers -> the op modules -> bridge -> kernels,
with the pure-JAX references below the ops and never reaching a kernel (docs/design.md §1)."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_mamba2"
# Modules every layer may use: argument checks, the backend registry, atomic file and directory writes,
# shard_map's varying axes, where call primitives keep their jaxprs.
FOUNDATIONS = {"checks", "backends", "ssd_args", "_files", "_staging", "_vma", "_version", "_jaxpr_calls"}
REFERENCES = {"reference", "conv1d_reference", "norm_reference", "decode_reference", "projection"}
OPS = {"op", "conv1d", "norm", "decode", "cross_entropy", "autotuning"}


def _layer(module: str) -> str:
    """'kernels', 'bridge', 'flax_layers', 'references', 'ops', 'foundations' or 'package' (the top __init__)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in ("kernels", "bridge", "flax_layers"):
        return parts[1]
    for layer, names in (("references", REFERENCES), ("ops", OPS), ("foundations", FOUNDATIONS)):
        if parts[1] in names:
            return layer
    raise AssertionError(f"{module}: a module this test does not place in a layer; add it to one")


# What each layer may import, besides itself and the foundations.
ALLOWED = {
    "kernels": set(),
    "bridge": {"kernels"},
    "references": set(),
    "ops": {"references", "bridge"},
    "flax_layers": {"ops", "references"},
    "foundations": set(),
    "package": {"ops", "flax_layers"},
}


def _imports(path: pathlib.Path) -> set[str]:
    """The jax_mamba2 modules (or their names) that a file imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jax_mamba2")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_mamba2"):
            # `from jax_mamba2 import op` names a module; `from jax_mamba2.op import ssd` a name of one.
            found |= {f"{node.module}.{a.name}" if node.module == "jax_mamba2" else node.module for a in node.names}
    return found


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_from_its_own_layer_and_those_below(path):
    layer = _layer(_module(path))
    wrong = {name for name in _imports(path)
             if _layer(name) not in ALLOWED[layer] | {layer, "foundations"}}
    assert not wrong, f"{_module(path)} ({layer}) imports {sorted(wrong)}"


def test_the_rule_catches_an_import_against_the_flow(tmp_path):
    """The check itself: a bridge module importing an op module, or a layer a kernel, is found."""
    assert _layer("jax_mamba2.op") == "ops" and "ops" not in ALLOWED["bridge"]
    assert "kernels" not in ALLOWED["flax_layers"] and "bridge" not in ALLOWED["flax_layers"]
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from jax_mamba2 import op as ssd_op\n"
                      "    from jax_mamba2.kernels.forward import x\n")
    assert _imports(source) == {"jax_mamba2.op", "jax_mamba2.kernels.forward"}
