"""benchmarks/tools/decode_launches.py on the CPU: the plans it times are well formed, each case's default config
comes first and no config repeats."""
import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools import decode_launches  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402


def test_cases_time_well_formed_plans_default_first():
    cases = decode_launches.cases(param_dtypes=("bfloat16", "float32"))
    assert {name for name, *_ in cases} == {"in_proj", "out_proj", "head", "mixer"}
    mixers = [(dims, configs) for name, dims, _, _, configs in cases if name == "mixer"]
    assert {dims.ssm_state_dtype for dims, _ in mixers} == {"bfloat16", "float32"}
    for case in ("in_proj", "out_proj", "head"):  # the projections in both weight dtypes
        assert {dims.weight_dtype for name, dims, *_ in cases if name == case} == {"bfloat16", "float32"}
    for dims, configs in mixers:  # heads per block swept where the grid has blocks to spare
        assert (max(cfg.HEADS for cfg in configs) > 1) == (dims.rows >= 64)
    for name, dims, make_plan, _, configs in cases:
        assert len(set(configs)) == len(configs)
        swept = name != "mixer" and dims.rows not in decode_launches.SWEPT_ROWS
        assert len(configs) == 1 if swept else len(configs) > 1
        for cfg in configs:
            plan = make_plan(dims, cfg)
            assert_plan_well_formed(plan)
            if name != "mixer":  # the norm's launch (at a few rows out_proj's product normalizes from the mixer's
                # sums of squares), then the product's (and with a split K the splits' sum)
                norm = 0 if dims.norm_parts else 1
                assert len(plan.launches) == norm + (1 if cfg.SPLIT_K == 1 else 2) and cfg.BLOCK_N >= 32


def test_the_mixer_cases_take_mamba2_370m_s_48_layers_into_the_int64_kernel():
    from jax_mamba2.kernels import decode_mixer

    (_, dims, make_plan, _, configs), = decode_launches.cases((256,), ("mixer",), mixer_layers=48)
    assert dims.layers == 48 and decode_mixer.needs_int64_index(dims)
    for cfg in configs:
        assert_plan_well_formed(make_plan(dims, cfg))


def test_d_model_sizes_the_cases_and_names_the_file():
    """--d-model 2048 times mamba2-1.3b's projections and mixer (in_proj 2048 x 8512, 64 heads) into a file of its
    own; the default width keeps the plain name."""
    by_name = {name: dims for name, dims, *_ in decode_launches.cases((64,), d_model=2048)}
    assert (by_name["in_proj"].features, by_name["in_proj"].out_features) == (2048, 8512)
    assert (by_name["out_proj"].features, by_name["out_proj"].out_features) == (4096, 2048)
    assert by_name["mixer"].nheads == 64
    assert decode_launches.results_name(2048, "h100") == "decode_launches_d2048_h100.json"
    assert decode_launches.results_name(decode_launches.D_MODEL, "h100") == "decode_launches_h100.json"
