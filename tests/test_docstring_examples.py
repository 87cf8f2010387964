"""The examples in the public API's docstrings run as written: every `>>>` line of the modules that define what
`jax_mamba2` and `jax_mamba2.flax_layers` export (and of `jax_mamba2.bridge.aot`, which README names), each in its
module's namespace, prints what the docstring shows. Examples that need a GPU or names they do not define are
marked `# doctest: +SKIP`, so that they read as illustrations rather than as a check that fails.
"""
import doctest
import importlib

import pytest

import jax_mamba2
from jax_mamba2 import flax_layers


def _public_modules() -> list[str]:
    names = {getattr(jax_mamba2, name).__module__ for name in jax_mamba2.__all__ if name != "__version__"}
    names |= {getattr(flax_layers, name).__module__ for name in flax_layers.__all__}
    return sorted(names | {"jax_mamba2.bridge.aot"})


@pytest.mark.parametrize("module_name", _public_modules())
def test_docstring_examples_run_as_written(module_name):
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner()
    tests = doctest.DocTestFinder().find(module, module_name, globs=vars(module))
    report = []
    failed = [test.name for test in tests if runner.run(test, out=report.append).failed]
    assert not failed, f"failing docstring examples in {failed}:\n" + "".join(report)
