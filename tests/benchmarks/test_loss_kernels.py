"""benchmarks/tools/loss_kernels.py on the CPU: every config spec it sweeps parses to a distinct valid config (the
default's first), whose plan of both kernels is well formed."""
import json

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools import loss_kernels  # noqa: E402
from jax_mamba2.kernels._common import kernel_name  # noqa: E402
from jax_mamba2.kernels.cross_entropy import (  # noqa: E402
    CrossEntropyConfig, CrossEntropyDims, cross_entropy_default_config)
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402

DIMS = CrossEntropyDims(rows=loss_kernels.ROWS, padded_vocab=loss_kernels.PADDED_VOCAB,
                        vocab_size=loss_kernels.VOCAB)


def test_specs_parse_to_distinct_configs_default_first():
    configs = [loss_kernels.parse_config(spec, DIMS) for spec in loss_kernels.DEFAULT_CONFIGS]
    assert configs[0] == cross_entropy_default_config(DIMS)
    assert len(set(configs[1:])) == len(configs) - 1
    for cfg in configs:
        plan = loss_kernels.loss_and_grad_plan(DIMS, cfg)
        assert_plan_well_formed(plan)
        assert [kernel_name(launch.kernel) for launch in plan.launches] == ["cross_entropy_fwd_kernel",
                                                                            "cross_entropy_bwd_kernel"]


@pytest.mark.parametrize("spec,expected", [
    ("4096,2", CrossEntropyConfig(BLOCK_ROWS=1, BLOCK_V=4096, FWD_OCCUPANCY=2, BWD_OCCUPANCY=2)),
    ("2048,4,3", CrossEntropyConfig(BLOCK_ROWS=1, BLOCK_V=2048, FWD_OCCUPANCY=4, BWD_OCCUPANCY=4, FWD_LATENCY=3,
                                    BWD_LATENCY=3)),
    ("2048,4,0,2", CrossEntropyConfig(BLOCK_ROWS=2, BLOCK_V=2048, FWD_OCCUPANCY=4, BWD_OCCUPANCY=4)),
])
def test_a_spec_sets_both_kernels_fields(spec, expected):
    assert loss_kernels.parse_config(spec, DIMS) == expected


def test_a_config_that_fails_is_a_record_with_its_error(capsys):
    """`timed_record` (both launch timers' record step): the times where the measurement ran, else the error."""
    from benchmarks.ssd import timed_record

    assert timed_record({"spec": "a"}, lambda: {"us": 1.5}) == {"spec": "a", "us": 1.5}

    def fails():
        raise RuntimeError("no kernel")

    assert timed_record({"spec": "b"}, fails) == {"spec": "b", "error": "RuntimeError: no kernel"}
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        {"spec": "a", "us": 1.5}, {"spec": "b", "error": "RuntimeError: no kernel"}]
