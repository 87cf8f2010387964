"""benchmarks/lm_train.py on the CPU: FLOP count, kernel categories, the JAX worker end to end (a tiny config,
the xla backend, one process per measurement), the PyTorch peer's step with a stand-in mixer."""
import functools
import gzip
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_mamba2

from benchmarks import kernel_categories, lm_bench, lm_train
from benchmarks.environment import local_gpu_slug
from benchmarks.tools import kernel_profile

TINY = "d64-l1-2x64"


def test_parameter_count_is_the_model_s():
    for name in (lm_train.DEFAULT_CONFIG, "d1536-l48-2x8192", "d64-l2-1x8"):
        config = lm_train.TrainConfig.parse(name)
        from jax_mamba2.flax_layers import Mamba2LMHeadModel
        abstract = nnx.eval_shape(lambda: Mamba2LMHeadModel(lm_train.mamba2_config(config), rngs=nnx.Rngs(0)))
        counted = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
        assert lm_train.parameter_count(config) == counted, name


def test_model_flops_add_the_ssd_to_six_params_per_token():
    config = lm_train.CONFIGS[lm_train.DEFAULT_CONFIG]
    flops = lm_train.model_flops(config)
    assert flops["tokens"] == 8 * 2048
    assert flops["dense_flops"] == 6 * flops["parameters"] * flops["tokens"]
    assert 0 < flops["ssd_flops"] < flops["dense_flops"]  # the SSD is a minor share at d_model 1024
    assert 180e6 < flops["parameters"] < 240e6           # the "210M parameters"


def test_config_names_parse_and_the_grid_has_eight():
    assert len(lm_train.CONFIGS) == 8 and lm_train.DEFAULT_CONFIG in lm_train.CONFIGS
    assert lm_train.TrainConfig.parse("d1536-l48-2x8192") == lm_train.TrainConfig(1536, 48, 2, 8192)
    with pytest.raises(ValueError, match="must be d<width>-l<layers>-<batch>x<seqlen>"):
        lm_train.TrainConfig.parse("370m")


def test_loss_choice_follows_what_the_model_offers():
    class WithLoss:
        def loss(self, inputs, targets):
            return 0.0

    assert lm_train.choose_loss("auto", WithLoss) == "model"
    assert lm_train.choose_loss("auto", object) == "plain"
    assert lm_train.choose_loss("plain", WithLoss) == "plain"
    with pytest.raises(ValueError, match="no Mamba2LMHeadModel.loss"):
        lm_train.choose_loss("model", object)


def test_kernels_fold_into_categories_through_the_compiled_module():
    compiled, *_ = lm_train.build_ours(lm_train.TrainConfig.parse("d64-l1-1x32"), "xla", "plain")
    hlo = compiled.as_text()
    sources = kernel_categories.hlo_sources(hlo)
    by_file = {}
    for name, source in sources.items():
        by_file.setdefault(source.file.rsplit("/", 2)[-1], name)
        if kernel_categories._in_scope(source.op_name, "loss"):
            by_file.setdefault("loss scope", name)
        if kernel_categories._in_scope(source.op_name, "optimizer"):
            by_file.setdefault("optimizer scope", name)
    kernels = [(by_file["conv1d_reference.py"], 0.0, 10.0), (by_file["norm_reference.py"], 0.0, 20.0),
               (by_file["reference.py"], 0.0, 30.0), (by_file["loss scope"], 0.0, 5.0),
               (by_file["optimizer scope"], 0.0, 6.0),
               ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0.0, 40.0),
               ("chunk_scan_fwd_kernel_Kt2_A4bf16", 0.0, 50.0), ("Memcpy DtoD (Device -> Device)", 0.0, 2.0),
               ("causal_conv1d_fwd_kernel_Kt1", 0.0, 1.0)]  # a kernel of another op, known by its name
    folded = kernel_categories.fold(kernels * 2, hlo, calls=2)
    us = {c: v["us"] for c, v in folded["categories"].items()}
    assert us == {"conv": 11.0, "norms": 20.0, "SSD": 80.0, "loss": 5.0, "optimizer": 6.0,
                  "matrix products": 40.0, "copies": 2.0}
    assert folded["busy_us"] == pytest.approx(164.0)
    assert folded["top_kernels"][0]["category"] == "SSD" and folded["top_kernels"][0]["launches"] == 1.0
    by_category = folded["top_kernels_by_category"]
    assert set(by_category) == set(us) and [k["us"] for k in by_category["SSD"]] == [50.0, 30.0]


def test_the_ssd_confinement_ops_fold_into_their_own_category(monkeypatch):
    """The XLA ops of the kernel SSD's non-finite confinement (the op's name scope, through jvp and transpose)
    count as "confinement", not as the SSD's file would have them; the rest of the op's XLA ops stay SSD."""
    pytest.importorskip("cuda.tile")
    from jax_mamba2 import backends, op
    from tests.bridge._emulated_backend import EMULATED
    monkeypatch.setitem(backends._REGISTRY["ssd"], EMULATED.name, EMULATED)
    x = jnp.ones((2, 64, 4, 16), jnp.bfloat16)
    dt, A, B = jnp.ones((2, 64, 4)), -jnp.ones((4,)), jnp.ones((2, 64, 1, 16), jnp.bfloat16)

    def objective(x):  # not "loss": the fold counts every op under a function of that name as the loss's
        y = jax_mamba2.ssd(x, dt, A, B, B, 64, dt_softplus=True, backend=EMULATED.name)
        return jnp.sum(y.astype(jnp.float32) ** 2)
    sources = kernel_categories.hlo_sources(jax.jit(jax.grad(objective)).lower(x).compile().as_text())
    scoped = {name: source for name, source in sources.items() if op.CONFINEMENT_SCOPE in source.op_name}
    assert {"jvp", "transpose"} <= {part.split("(")[0] for s in scoped.values() for part in s.op_name.split("/")}
    assert {kernel_categories.category(name, source) for name, source in scoped.items()} == {"confinement"}
    assert kernel_categories.category("fusion_1", kernel_categories.Source(
        "jit(objective)/jvp(ssd)/add", "/site/jax_mamba2/op.py")) == "SSD"


def test_idle_gaps_are_the_waits_inside_a_call_named_by_their_neighbours():
    """Two calls of a, b, c with a 2 us wait between a and b and b, c overlapping; the 100 us between the calls
    is the host's sync and left out."""
    call = [("a", 0.0, 10.0), ("b", 12.0, 8.0), ("c", 18.0, 7.0), ("d", 30.0, 1.0)]
    kernels = call + [(name, start + 125.0, duration) for name, start, duration in call]
    gaps = kernel_categories.idle_gaps(kernels, calls=2)
    assert gaps["idle_us"] == pytest.approx(7.0)
    assert gaps["top_gaps"] == [{"previous": "c", "next": "d", "us": pytest.approx(5.0), "count": 1.0},
                                {"previous": "a", "next": "b", "us": pytest.approx(2.0), "count": 1.0}]
    assert kernel_categories.fold(kernels, "HloModule m\n", calls=2)["idle_us"] == pytest.approx(7.0)


def test_the_model_loss_profiles_only_its_own_ops_as_loss():
    """With the model's loss, the XLA ops of the layers keep their categories (conv, norms, SSD, the mixer's
    elementwise glue) and only those of jax_mamba2/cross_entropy.py count as loss."""
    compiled, *_ = lm_train.build_ours(lm_train.TrainConfig.parse("d64-l1-1x32"), "xla", "model")
    categories = {}
    for name, source in kernel_categories.hlo_sources(compiled.as_text()).items():
        file = source.file.rsplit("/", 1)[-1]
        if file:
            categories.setdefault(file, set()).add(kernel_categories.category(name, source))
    assert "loss" in categories["cross_entropy.py"]
    elsewhere = {file for file, found in categories.items() if "loss" in found and file != "cross_entropy.py"}
    assert not elsewhere, categories
    for file, want in (("conv1d_reference.py", "conv"), ("norm_reference.py", "norms"), ("reference.py", "SSD"),
                       ("mamba2.py", "elementwise")):
        assert want in categories[file], (file, categories[file])


@pytest.mark.slow
def test_the_jax_worker_writes_a_record_table_and_plot(tmp_path, capsys):
    argv = ["--configs", TINY, "--impls", "xla", "--steps", "2", "--warmup-seconds", "0", "--profile-steps", "1",
            "--pipelined-steps", "2", "--loss", "plain", "--out", str(tmp_path), "--hlo-dir", str(tmp_path / "hlo")]
    assert lm_train.main(argv) == 0
    results = json.loads((tmp_path / f"lm_train_{local_gpu_slug()}.json").read_text())
    (record,) = results["records"]
    assert record["error"] is None, record.get("log_tail")
    assert record["config"] == TINY and record["impl"] == "xla" and record["loss_impl"] == "plain"
    assert record["timing"]["steps"] == 2 and record["timing"]["ms_median"] > 0
    assert record["timing"]["ms_pipelined"] > 0  # rounds of two steps back to back
    assert record["tokens_per_s"] == pytest.approx(2 * 64 / (record["timing"]["ms_median"] * 1e-3))
    assert record["device_rates"]["matmul_tflops"] > 0 and record["mfu_measured"] > 0
    assert record["loss_first"] == pytest.approx(10.8, abs=0.5)  # ln(50280): a random model's loss
    assert record["memory_analysis"]["temp_size_in_bytes"] > 0
    # The layer scan compiled as a user compiles it: with the model's compiler options (no --xla-option asked).
    assert record["xla_options"] == {} and record["compiler_options"] == {"xla_gpu_enable_triton_gemm": False}
    assert "busy_us" in record["profile"]  # the CPU trace has no GPU kernels: the categories stay empty
    assert record["hlo_path"] == str(tmp_path / "hlo" / f"{TINY}-xla.hlo.txt.gz")
    assert gzip.decompress((tmp_path / "hlo" / f"{TINY}-xla.hlo.txt.gz").read_bytes()).startswith(b"HloModule")
    assert (tmp_path / f"lm_train_{local_gpu_slug()}.png").read_bytes()[:4] == b"\x89PNG"
    assert "jax-mamba2 Mamba2LMHeadModel, XLA SSD" in capsys.readouterr().out
    # A second run of the same (config, impl) replaces the record; another impl is added beside it.
    failing = ["--configs", TINY, "--impls", "cutile", "--steps", "1", "--warmup-seconds", "0", "--no-profile",
               "--out", str(tmp_path)]
    assert lm_train.main(failing) == 0
    records = json.loads((tmp_path / f"lm_train_{local_gpu_slug()}.json").read_text())["records"]
    assert [r["impl"] for r in records] == ["xla", "cutile"]
    assert "cutile" in records[1]["error"] and records[1]["log_tail"]  # no GPU here: the worker says why


def test_the_worker_measures_the_device_rates_after_its_work_is_freed(tmp_path, monkeypatch):
    """The matmul and copy rates are measured once `work` has returned and its garbage is collected, so the
    model it held is gone, even one in a reference cycle; a failing work leaves the error and no rates."""
    import weakref

    class Model:
        pass

    held = []

    def work(job):
        model = Model()
        model.itself = model  # a cycle: only the collector frees it
        held.append(weakref.ref(model))
        return {"steps": job["steps"]}

    def rates():
        assert held[0]() is None  # the work's model is freed before the rates' buffers are allocated
        return {"matmul_tflops": 1.0}

    monkeypatch.setattr(lm_bench, "jax_device_rates", rates)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"impl": "cutile", "steps": 3, "record_file": str(tmp_path / "record.json")}))
    assert lm_bench.worker_main(["--worker", str(job_file)], work, ours=("cutile",))
    record = json.loads((tmp_path / "record.json").read_text())
    assert record == {"impl": "cutile", "steps": 3, "device_rates": {"matmul_tflops": 1.0}, "error": None}

    def failing(job):
        raise MemoryError("out of memory")

    job_file.write_text(json.dumps({"impl": "cutile", "steps": 3, "record_file": str(tmp_path / "record.json")}))
    assert lm_bench.worker_main(["--worker", str(job_file)], failing, ours=("cutile",))
    assert json.loads((tmp_path / "record.json").read_text()) == {"impl": "cutile", "steps": 3,
                                                                  "error": "MemoryError: out of memory"}
    assert not lm_bench.worker_main(["--configs", "x"], work, ours=("cutile",))


def test_the_worker_measures_a_peer_jobs_rates_with_torch(tmp_path):
    """A job whose impl is not ours (mamba_ssm's) has its rates measured with torch (on the CPU here)."""
    pytest.importorskip("torch")
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"impl": "mamba_ssm", "record_file": str(tmp_path / "record.json")}))
    assert lm_bench.worker_main(["--worker", str(job_file)], lambda job: {}, ours=("cutile",))
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["error"] is None and record["device_rates"]["matmul_tflops"] > 0


def test_the_torch_step_runs_the_peer_lm_with_a_stand_in_mixer():
    torch = pytest.importorskip("torch")
    from tests.benchmarks._torch_stand_in import stand_in_parts

    job = {"config": "d32-l2-2x16", "impl": "mamba_ssm", "steps": 2, "warmup_seconds": 0.0, "pipelined_steps": 2}
    record = lm_train.train_torch_model(job, stand_in_parts(32), torch.device("cpu"))
    assert record["timing"]["steps"] == 2 and record["timing"]["ms_median"] > 0
    assert record["timing"]["ms_pipelined"] > 0
    assert record["loss_first"] == pytest.approx(10.8, abs=0.5)
    derived = lm_train.derive({**job, **record, "use_mem_eff_path": False, "causal_conv1d": None, "error": None})
    assert derived["label"] == "mamba_ssm Mamba2 modules (PyTorch), use_mem_eff_path=False, no causal_conv1d"
    assert derived["tokens_per_s"] > 0


def test_xla_options_reach_the_compile_and_key_the_record():
    assert lm_train.xla_options(["xla_gpu_enable_dynamic_slice_fusion=false", "xla_gpu_autotune_level=0"]) == {
        "xla_gpu_enable_dynamic_slice_fusion": False, "xla_gpu_autotune_level": 0}
    args = lm_train.parse_args(["--impls", "cutile", "mamba_ssm", "--xla-option",
                                "xla_gpu_enable_dynamic_slice_fusion=false"])
    ours, peer = lm_train.jobs(args)
    assert ours["xla_options"] == {"xla_gpu_enable_dynamic_slice_fusion": False} and "xla_options" not in peer
    plain = {"config": "d1024-l24-8x2048", "impl": "cutile"}
    assert lm_train.record_key(plain) != lm_train.record_key({**plain, "xla_options": ours["xla_options"]})
    assert lm_train.label({**plain, "xla_options": ours["xla_options"]}).endswith(
        ", xla_gpu_enable_dynamic_slice_fusion=False")

    def step(params, opt_state, x):
        return params * 2, opt_state, x
    ones = jax.numpy.ones(3)
    compiled, _ = lm_train.compile_step(step, ones, ones, ones, xla_options={"xla_gpu_autotune_level": 0})
    assert float(compiled(jax.numpy.ones(3), jax.numpy.ones(3), ones)[0][0]) == 2.0


def _assert_variant_reaches_ours_and_keys_the_record(flags, field, value, default, label_end):
    """`flags` set `field` to `value` in the job of ours only; the record key tells it from `default` (and a
    record that spells the default keys as one that omits it); the label ends with `label_end`."""
    ours, peer = lm_train.jobs(lm_train.parse_args(["--impls", "cutile", "mamba_ssm", *flags]))
    assert ours[field] == value and type(ours[field]) is type(value) and field not in peer
    if field in lm_train.MODEL_OPTIONS:  # what the worker hands to Mamba2LMHeadModel
        assert lm_train.model_options(ours)[field] == value
    plain = {"config": "d1024-l24-8x2048", "impl": "cutile"}
    assert lm_train.record_key(plain) != lm_train.record_key({**plain, field: value})
    assert lm_train.record_key(plain) == lm_train.record_key({**plain, field: default})
    assert lm_train.label({**plain, field: value}).endswith(label_end)


def test_logits_dtype_reaches_the_model_loss_and_keys_the_record():
    _assert_variant_reaches_ours_and_keys_the_record(["--logits-dtype", "bfloat16"], "logits_dtype", "bfloat16",
                                                     None, ", bfloat16 logits")
    # The step's one head product that stores logits (the loss's forward, which takes the gradient too) is the
    # only one that changes its result dtype (traced, not compiled: the loss's numerics have their own tests in
    # tests/flax_layers/test_loss.py).
    config = lm_train.TrainConfig.parse("d64-l1-1x32")
    bf16_products = {}
    for dtype in (None, "bfloat16"):
        step, *args = lm_train.make_train_step(config, "xla", "model", abstract=True, logits_dtype=dtype)
        text = str(jax.make_jaxpr(step)(*args))
        bf16_products[dtype] = text.count("preferred_element_type=bfloat16")
    assert bf16_products["bfloat16"] == bf16_products[None] + 1


def test_unroll_layers_reaches_the_model_and_keys_the_record():
    _assert_variant_reaches_ours_and_keys_the_record(["--unroll-layers"], "scan_layers", False, True,
                                                     ", layers unrolled")
    config = lm_train.TrainConfig.parse("d64-l2-1x32")
    step, *step_args = lm_train.make_train_step(config, "xla", "model", abstract=True, scan_layers=False)
    assert "length=2" not in str(jax.make_jaxpr(step)(*step_args))  # no scan over the two layers


def test_loss_backend_reaches_the_model_and_keys_the_record():
    _assert_variant_reaches_ours_and_keys_the_record(["--loss-backend", "xla"], "loss_backend", "xla", None,
                                                     ", loss softmax xla")
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import aot
    config = lm_train.TrainConfig.parse("d64-l1-1x32")
    calls = {}
    with aot.cuda_target("sm_90"):  # traced for the GPU, the SSD in XLA: only the loss may call kernels
        for loss_backend in ("xla", "cutile"):
            step, *step_args = lm_train.make_train_step(config, "xla", "model", abstract=True,
                                                        loss_backend=loss_backend)
            calls[loss_backend] = str(jax.make_jaxpr(step)(*step_args)).count("custom_vmap_call")
    assert calls == {"xla": 0, "cutile": 2}  # the softmax's forward and backward kernels


def test_no_check_finite_reaches_the_model_and_keys_the_record():
    _assert_variant_reaches_ours_and_keys_the_record(["--no-check-finite"], "check_finite", False, True,
                                                     ", SSD inputs unchecked")
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import aot
    config = lm_train.TrainConfig.parse("d64-l1-1x32")
    tests = {}
    with aot.cuda_target("sm_90"):  # traced for the GPU: the SSD on the kernels, checked or not
        for check_finite in (True, False):
            # The loss on the kernels by name: its default ("auto") would add lax.platform_dependent's cond.
            step, *step_args = lm_train.make_train_step(config, "cutile", "model", abstract=True,
                                                        check_finite=check_finite, loss_backend="cutile")
            program = str(jax.make_jaxpr(step)(*step_args))
            assert " cond[" not in program
            tests[check_finite] = program.count("is_finite")
    # The SSD's finite parts (x, dt, A, B, C, y's cotangent...) only with the check; the loss's test either way.
    assert tests[True] > tests[False]


def test_chunk_states_reach_the_model_and_key_the_record():
    _assert_variant_reaches_ours_and_keys_the_record(["--chunk-states", "saved"], "save_chunk_states", True, False,
                                                     ", chunk states saved")
    # Without the flag the job records the model's default: kept under remat, recomputed without it.
    for flags, saved in (([], False), (["--remat", "matmuls"], True), (["--remat", "matmuls", "--chunk-states",
                                                                        "recomputed"], False)):
        job, = lm_train.jobs(lm_train.parse_args(["--impls", "cutile", *flags]))
        assert job["save_chunk_states"] is saved
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import aot
    config = lm_train.TrainConfig.parse("d64-l1-1x32")  # 2 heads of 64, d_state 128, one chunk
    states = {}
    with aot.cuda_target("sm_90"):  # traced for the GPU: the SSD on the kernels
        for save in (True, False):
            step, *step_args = lm_train.make_train_step(config, "cutile", "model", abstract=True,
                                                        save_chunk_states=save)
            states[save] = str(jax.make_jaxpr(step)(*step_args)).count("bf16[1,1,2,64,128]")
    assert 0 < states[False] < states[True]  # the forward no longer hands its bf16 chunk states to the backward


@pytest.mark.parametrize("flag,value", [("matmuls", "matmuls"), ("full", True)])
def test_remat_reaches_the_model_and_keys_the_record(flag, value):
    _assert_variant_reaches_ours_and_keys_the_record(["--remat", flag], "remat", value, False, f", remat {value}")


def test_command_buffers_reach_the_worker_environment_and_key_the_record(monkeypatch):
    _assert_variant_reaches_ours_and_keys_the_record(["--command-buffers", "loop"], "command_buffers", "loop",
                                                     "default", ", command buffers loop")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert lm_bench.command_buffer_env("loop") == {"XLA_FLAGS": "--xla_dump_to=/tmp/x "
                                                   "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                                                   "--xla_gpu_graph_min_graph_size=1"}
    monkeypatch.delenv("XLA_FLAGS")
    assert lm_bench.command_buffer_env("default") == {}


def test_conv_configs_reach_the_worker_and_key_the_record(monkeypatch):
    spec = "8x256x2,16x8x64x2"
    _assert_variant_reaches_ours_and_keys_the_record(["--conv-configs", spec], "conv_configs", spec, None,
                                                     f", conv kernels {spec}")
    pytest.importorskip("cuda.tile")
    from jax_mamba2 import backends, conv1d
    from jax_mamba2.bridge import conv_ops
    seen = []
    monkeypatch.setattr(lm_train, "train_ours", lambda job: seen.append(backends.registered(conv1d.OP)["cutile"]))
    registered = backends.registered(conv1d.OP)["cutile"]
    lm_train.work({"impl": "cutile", "conv_configs": spec})
    assert backends.registered(conv1d.OP)["cutile"] == registered  # restored after the worker's run
    assert seen[0].unsupported_reason is registered.unsupported_reason
    kernels = seen[0].kernels
    assert kernels.run_plan is conv_ops.KERNELS["cutile"].run_plan
    assert (kernels.fwd_config.BLOCK_C, kernels.fwd_config.OCCUPANCY, kernels.bwd_config.BLOCK_L,
            kernels.bwd_config.BLOCK_C) == (256, 2, 16, 64)


def test_the_speedup_takes_the_peer_of_ours_commit_where_there_is_one():
    def record(impl, ms, sha, **extra):
        return {"config": "d8-l1-1x8", "impl": impl, "timing": {"ms_median": ms}, "environment": {"git_sha": sha},
                "label": lm_train.LABELS[impl], **extra}
    ours = record("cutile", 10.0, "b")
    older_peer, same_run_peer = record("mamba_ssm", 40.0, "a"), record("mamba_ssm", 30.0, "b")
    assert lm_train._speedup([ours, same_run_peer, older_peer], "d8-l1-1x8") == ("d8-l1-1x8", 3.0, True)
    assert lm_train._speedup([ours, older_peer], "d8-l1-1x8") == ("d8-l1-1x8", 4.0, False)
    assert lm_train._speedup([ours], "d8-l1-1x8") is None


def test_the_speedup_judges_a_record_by_the_defaults_of_the_day_it_ran():
    """A record's label names the variants it changed against the defaults of then: a record that kept the chunk
    states when that was the default is a user's run, one that asked for what is the default today is not; XLA
    options and other variants are never a user's run; the layer mode is the user's choice."""
    def record(ms, **extra):
        job = {"config": "d8-l1-1x8", "impl": "cutile", "timing": {"ms_median": ms}, "environment": {"git_sha": "b"},
               **extra}
        return {**job, "label": lm_train.label(job)}
    then_default = {**record(9.0, save_chunk_states=True), "label": lm_train.LABELS["cutile"]}
    asked_then = {**record(7.0, save_chunk_states=False), "label": lm_train.LABELS["cutile"] + ", chunk states "
                  "recomputed"}
    unrolled, unchecked = record(8.0, scan_layers=False), record(6.0, scan_layers=False, check_finite=False)
    flagged = record(5.0, xla_options={"xla_gpu_enable_command_buffer": ""})
    assert lm_train._user_ours(record(10.0)) and lm_train._user_ours(then_default) and lm_train._user_ours(unrolled)
    assert not any(lm_train._user_ours(r) for r in (asked_then, unchecked, flagged))
    peer = {"config": "d8-l1-1x8", "impl": "mamba_ssm", "timing": {"ms_median": 40.0}, "environment": {"git_sha": "b"},
            "label": lm_train.LABELS["mamba_ssm"]}
    assert lm_train._speedup([then_default, asked_then, unrolled, unchecked, flagged, peer], "d8-l1-1x8") == (
        "d8-l1-1x8", 5.0, True)


def test_cutile_launches_lists_the_package_s_kernels_in_hlo_order():
    from jax_mamba2.bridge.aot import CUTILE_CUSTOM_CALL

    def launch(name, kernel, target=CUTILE_CUSTOM_CALL):
        return (f'  %{name} = bf16[8]{{0}} custom-call(%p), custom_call_target="{target}", '
                f'backend_config={{function_name = "{kernel}_Kt2_A1", grid_x = 1 : i32}}')
    hlo = "\n".join([
        "HloModule step", "",
        "%body.3 (p: bf16[8]) -> bf16[8] {", launch("a", "norm_kernel"), launch("b", "mixer_kernel"), "}",
        "", "ENTRY %main.7 (p: bf16[8]) -> bf16[8] {", launch("c", "norm_kernel"),
        launch("d", "other_kernel", target="cutile_launch"),
        "  ROOT %call = bf16[8]{0} call(%p), to_apply=%body.3", "}"])
    assert lm_bench.cutile_launches(hlo, CUTILE_CUSTOM_CALL) == [
        "norm_kernel_Kt2_A1", "mixer_kernel_Kt2_A1", "norm_kernel_Kt2_A1"]
    assert lm_bench.cutile_launches(hlo, "cutile_launch") == ["other_kernel_Kt2_A1"]


def test_layer_loop_reaches_the_worker_and_keys_the_record(monkeypatch):
    """--layer-loop lax-scan / unfilled run the model's layer scan as lax.scan differentiates it, or with the
    residuals stacked after each layer (the A/B baselines), inside the worker only; not with --unroll-layers."""
    _assert_variant_reaches_ours_and_keys_the_record(["--layer-loop", "lax-scan"], "layer_loop", "lax-scan",
                                                     "routed", ", layer loop lax-scan")
    from jax_mamba2.flax_layers import layer_loop, lm
    seen = []
    monkeypatch.setattr(lm_train, "train_ours", lambda job: seen.append(lm.scan_blocks))
    lm_train.work({"impl": "cutile", "layer_loop": "lax-scan"})
    lm_train.work({"impl": "cutile", "layer_loop": "unfilled"})
    lm_train.work({"impl": "cutile"})
    assert seen[0] is layer_loop.lax_scan_blocks and seen[2] is layer_loop.scan_blocks
    assert seen[1].func is layer_loop.scan_blocks and seen[1].keywords == {"route_residuals": False}
    assert lm.scan_blocks is layer_loop.scan_blocks
    with pytest.raises(SystemExit):
        lm_train.parse_args(["--layer-loop", "lax-scan", "--unroll-layers"])


def test_a_torch_peer_s_trace_folds_into_the_same_categories_by_kernel_name():
    """The device events of a torch.profiler Chrome trace (kernels, memcpys, memsets; not the host's ops) fold
    by name: mamba_ssm's Triton SSD and norm kernels, causal_conv1d's, cuBLAS, ATen's loss, AdamW and copies."""
    names = {
        "_chunk_scan_fwd_kernel": "SSD", "_state_passing_bwd_kernel": "SSD", "_bmm_chunk_fwd_kernel": "SSD",
        "_chunk_scan_chunk_state_bwd_dx_kernel": "SSD", "segment_states_kernel_Kt2": "SSD",
        "void causal_conv1d_channellast_fwd_kernel<Causal_conv1d_channellast_fwd_kernel_traits<128, 4>>": "conv",
        "_layer_norm_fwd_1pass_kernel": "norms", "_layer_norm_bwd_kernel": "norms",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matrix products",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxEpilogue>":
            "loss",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4, ADAM_MODE::ADAMW>>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copies",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
            "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>": "elementwise",
    }
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0}]
    for i, name in enumerate(names):
        events.append({"ph": "X", "cat": "gpu_memcpy" if name.startswith("Memcpy") else "kernel", "name": name,
                       "ts": 100.0 + 10 * i, "dur": 2.0 + i})
    kernels = kernel_profile.torch_trace_kernels({"traceEvents": events})
    assert [k[0] for k in kernels] == list(names)
    folded = kernel_categories.fold(kernels, "", calls=1)
    assert folded["busy_us"] == sum(2.0 + i for i in range(len(names)))
    for name, cat in names.items():
        assert kernel_categories.category(name, None) == cat, name
    assert folded["categories"]["SSD"]["launches"] == 5
    assert folded["categories"]["loss"]["us"] == (2.0 + 9) + (2.0 + 10)


def test_a_rerun_replaces_its_commit_s_record_and_keeps_other_commits_records(tmp_path):
    """The results files keep every commit's measurement (the docs cite them); a rerun at one commit replaces
    that commit's record of the same measurement, in place."""
    def record(sha, ms, **variant):
        return {"config": TINY, "impl": "cutile", "environment": {"git_sha": sha}, "timing": {"ms_median": ms},
                **variant}

    path = tmp_path / "lm_train_gpu.json"
    merge = functools.partial(lm_bench.merge_results, path, "lm_train", key=lm_train.record_key)
    merge([record("aaa", 1.0)])
    merge([record("bbb", 2.0), record("bbb", 4.0, scan_layers=False)])
    results = merge([record("bbb", 3.0)])
    assert [(r["environment"]["git_sha"], r["timing"]["ms_median"]) for r in results["records"]] == [
        ("aaa", 1.0), ("bbb", 3.0), ("bbb", 4.0)]
    assert json.loads(path.read_text()) == results
