"""The examples in the public API's docstrings run as written: every `>>>` line of the modules that define what
`jax_mamba2` and `jax_mamba2.flax_layers` export (and of `jax_mamba2.bridge.aot`, which README names), each in its
module's namespace, prints what the docstring shows. Examples that need a GPU or names they do not define are
marked `# doctest: +SKIP`, so that they read as illustrations rather than as a check that fails; a module whose
examples are all marked so (or that has none) is not a case here, and each case runs at least one example.
"""
import doctest
import importlib

import pytest

import jax_mamba2
from jax_mamba2 import flax_layers


def _runnable_examples(module_name: str) -> list[doctest.DocTest]:
    """The module's docstring examples, those of which at least one line is not marked SKIP."""
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder().find(module, module_name, globs=vars(module))
    return [test for test in tests if any(not example.options.get(doctest.SKIP) for example in test.examples)]


def _modules_with_examples() -> list[str]:
    """The modules that define what `jax_mamba2` and `jax_mamba2.flax_layers` export, and `jax_mamba2.bridge.aot`,
    that hold an example to run."""
    names = {getattr(jax_mamba2, name).__module__ for name in jax_mamba2.__all__ if name != "__version__"}
    names |= {getattr(flax_layers, name).__module__ for name in flax_layers.__all__}
    return sorted(name for name in names | {"jax_mamba2.bridge.aot"} if _runnable_examples(name))


@pytest.mark.parametrize("module_name", _modules_with_examples())
def test_docstring_examples_run_as_written(module_name):
    runner = doctest.DocTestRunner()
    report = []
    tests = _runnable_examples(module_name)
    failed = [test.name for test in tests if runner.run(test, out=report.append).failed]
    assert not failed, f"failing docstring examples in {failed}:\n" + "".join(report)
    assert runner.summarize(verbose=False).attempted > 0
