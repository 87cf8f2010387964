"""benchmarks/lm_decode.py on the CPU: configs, floors, the JAX worker end to end (a tiny model, the xla
backend, command buffers set per process), the PyTorch peer's decode and prefill with a stand-in mixer."""
import json

import pytest

from benchmarks import lm_bench, lm_decode
from benchmarks.environment import local_gpu_slug


def test_configs_are_the_presets_and_the_training_lm():
    assert lm_decode.lm_config("mamba2-780m").d_model == 1536 and lm_decode.lm_config("mamba2-1.3b").n_layer == 48
    config = lm_decode.lm_config("d1024-l24")
    assert (config.d_model, config.n_layer, config.padded_vocab_size) == (1024, 24, 50280)
    with pytest.raises(ValueError, match="must be one of"):
        lm_decode.lm_config("mamba2-7b")


def test_floors_count_weights_once_and_the_state_read_and_written():
    floor = lm_decode.floors(weight_bytes=4_000_000_000, state_bytes_per_row=1_000_000, batch=8, copy_gbps=4000)
    assert floor["weights_ms"] == pytest.approx(1.0)
    assert floor["weights_and_state_ms"] == pytest.approx(1.0 + 2 * 8 * 1e6 / 4e12 * 1e3)


def test_jobs_set_xla_flags_per_process_for_ours_only():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "cutile", "mamba_ssm", "--param-dtypes",
                                 "bfloat16", "--command-buffers", "default", "off", "loop"])
    jobs = lm_decode.jobs(args)
    assert [(j["impl"], j["command_buffers"]) for j, _ in jobs] == [
        ("cutile", "default"), ("cutile", "off"), ("cutile", "loop"), ("mamba_ssm", None)]
    envs = [env.get("XLA_FLAGS", "") for _, env in jobs]
    assert "--xla_gpu_enable_command_buffer=" not in envs[0]
    assert envs[1].endswith("--xla_gpu_enable_command_buffer=")
    assert "+WHILE,+CONDITIONAL" in envs[2] and envs[3] == ""


def test_sampling_makes_a_job_of_ours_each_and_keys_the_record():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "cutile", "mamba_ssm", "--param-dtypes",
                                 "bfloat16", "--sampling", "greedy", "top-p"])
    assert [(j["impl"], j.get("sampling")) for j, _ in lm_decode.jobs(args)] == [
        ("cutile", "greedy"), ("cutile", "top-p"), ("mamba_ssm", None)]
    plain = {"config": "d64-l1", "impl": "cutile", "param_dtype": "bfloat16", "command_buffers": "default"}
    assert lm_decode.record_key(plain) == lm_decode.record_key({**plain, "sampling": "greedy"})  # older records
    assert lm_decode.record_key({**plain, "sampling": "top-p"}) != lm_decode.record_key(plain)
    assert lm_decode.label({**plain, "sampling": "top-p"}).endswith(", top-p")
    sampled = lm_decode._controls({"sampling": "top-p"})
    assert sampled["top_p"] == 0.9 and sampled["temperature"] == 1.0 and "rng" in sampled
    assert lm_decode._controls({"sampling": "penalty"}) == {"repetition_penalty": 1.2}


def test_mixer_heads_make_a_cutile_job_each_and_key_the_record():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "cutile", "xla", "mamba_ssm", "--param-dtypes",
                                 "bfloat16", "--mixer-heads", "1", "4"])
    assert [(j["impl"], j.get("mixer_heads")) for j, _ in lm_decode.jobs(args)] == [
        ("cutile", 1), ("cutile", 4), ("xla", None), ("mamba_ssm", None)]
    assert [j.get("mixer_heads") for j, _ in lm_decode.jobs(lm_decode.parse_args(["--configs", "d64-l1", "--impls",
                                                                                  "cutile"]))] == [None, None]
    plain = {"config": "d64-l1", "impl": "cutile", "param_dtype": "bfloat16", "command_buffers": "default"}
    # A record of the default config is keyed apart from one that forced a head count, 1 included.
    assert len({lm_decode.record_key({**plain, **heads}) for heads in ({}, {"mixer_heads": 1},
                                                                       {"mixer_heads": 4})}) == 3
    assert lm_decode.label(plain).endswith("command buffers default")
    assert lm_decode.label({**plain, "mixer_heads": 4}).endswith(", 4 heads per mixer block from 64 rows")


def test_the_callback_backend_is_one_of_ours_with_a_model_and_label_of_its_own():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "cutile", "cutile_callback", "--param-dtypes",
                                 "bfloat16", "--mixer-heads", "4"])
    jobs = [job for job, _ in lm_decode.jobs(args)]
    # The mixer-head variants replace the cutile backend's kernels only: the callback backend runs its defaults.
    assert [(j["impl"], j.get("mixer_heads")) for j in jobs] == [("cutile", 4), ("cutile_callback", None)]
    assert lm_decode.ours_model(jobs[1]).layers.mixer.backend == "cutile_callback"
    assert lm_decode.label({**jobs[1], "command_buffers": "default"}).startswith(
        "jax-mamba2 generate, cuTile from buffer_callbacks (the token step one, replaying a CUDA graph), bfloat16 "
        "params, command buffers default")
    assert lm_decode.record_key(jobs[0]) != lm_decode.record_key({**jobs[0], "impl": "cutile_callback"})


def test_cache_dtypes_make_a_job_of_ours_each_key_the_record_and_reach_generate():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "xla", "mamba_ssm", "--param-dtypes", "float32",
                                 "--cache-dtypes", "default", "bfloat16"])
    assert [(j["impl"], j.get("cache_dtype")) for j, _ in lm_decode.jobs(args)] == [
        ("xla", None), ("xla", "bfloat16"), ("mamba_ssm", None)]
    plain = {"config": "d64-l1", "impl": "xla", "param_dtype": "float32", "command_buffers": "default"}
    assert lm_decode.record_key({**plain, "cache_dtype": "bfloat16"}) != lm_decode.record_key(plain)
    assert lm_decode.label({**plain, "cache_dtype": "bfloat16"}).endswith(", bfloat16 decode state")
    assert lm_decode._controls({"cache_dtype": "bfloat16"}) == {"cache_dtype": "bfloat16"}
    assert lm_decode._controls({}) == {}


def test_mixer_heads_kernels_take_that_config_from_64_rows(monkeypatch):
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import decode_ops
    from tests.kernels.test_decode_compile import _mixer

    made = {}
    monkeypatch.setattr(decode_ops, "make_kernels", lambda run_plan, **configs: made.update(configs) or "kernels")
    assert lm_decode.mixer_heads_kernels(4) == "kernels"
    assert made["mixer_config"](_mixer(64, "bfloat16")).HEADS == 4
    assert made["mixer_config"](_mixer(8, "bfloat16")).HEADS == 1


@pytest.mark.slow
def test_unroll_layers_reaches_ours_and_keys_the_record():
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "cutile", "mamba_ssm", "--unroll-layers",
                                 "--param-dtypes", "bfloat16"])
    (ours, _), (peer, _) = lm_decode.jobs(args)
    assert ours["scan_layers"] is False and "scan_layers" not in peer
    plain = {"config": "d64-l1", "impl": "cutile", "param_dtype": "bfloat16", "command_buffers": "default"}
    assert lm_decode.record_key(plain) != lm_decode.record_key({**plain, "scan_layers": False})
    assert lm_decode.label({**plain, "scan_layers": False}).endswith(", layers unrolled")
    # A run under other XLA flags is its own record; the command-buffer flag the benchmark sets is not one.
    off = {**plain, "command_buffers": "off"}
    flagged = {**off, "xla_flags": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer="}
    assert lm_decode.record_key(flagged) != lm_decode.record_key(off)
    assert lm_decode.record_key({**off, "xla_flags": "--xla_gpu_enable_command_buffer="}) == lm_decode.record_key(off)
    assert lm_decode.label(flagged).endswith(", XLA_FLAGS=--xla_gpu_enable_triton_gemm=false")
    assert not lm_decode.ours_model({**plain, "impl": "xla", "scan_layers": False}).scan_layers


def test_the_jax_worker_writes_step_times_prefill_and_floors(tmp_path):
    argv = ["--configs", "d64-l1", "--impls", "xla", "--param-dtypes", "bfloat16", "--batches", "1", "2",
            "--prompt-lengths", "32", "--decode-steps", "64", "--repeats", "2", "--warmup-seconds", "0",
            "--command-buffers", "off", "--profile", "--sampling", "greedy", "top-p", "--out", str(tmp_path)]
    assert lm_decode.main(argv) == 0
    record, sampled = json.loads((tmp_path / f"lm_decode_{local_gpu_slug()}.json").read_text())["records"]
    assert sampled["error"] is None and sampled["sampling"] == "top-p", sampled.get("log_tail")
    assert sampled["batches"]["2"]["ms_per_token"] is not None
    assert record["error"] is None, record.get("log_tail")
    assert record["xla_flags"].endswith("--xla_gpu_enable_command_buffer=")
    assert set(record["batches"]) == {"1", "2"} and set(record["prefill_ms"]) == {"32"}
    row = record["batches"]["2"]
    assert row["generate_long_ms"] > row["generate_1_ms"] > 0
    assert row["tokens_per_s"] == pytest.approx(2 / row["ms_per_token"] * 1e3)
    assert row["floor"]["weights_ms"] > 0 and row["x_weights_floor"] > 0
    # The profile ran (on the CPU its trace holds no GPU kernels, so it has nothing to fold).
    assert row["profile"]["decode_steps"] == 64 and isinstance(row["profile"]["categories"], dict)
    # bf16 parameters: 2 bytes per parameter (embedding 50280 x 64 dominates)
    assert 2 * 50280 * 64 < record["weight_bytes"] < 2 * 50280 * 64 * 1.5
    # (the test process's own XLA flags, which the worker inherits, follow in the label)
    assert record["label"].startswith("jax-mamba2 generate, XLA, bfloat16 params, command buffers off")
    assert (tmp_path / f"lm_decode_{local_gpu_slug()}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_token_step_profile_is_the_two_calls_difference_over_the_steps():
    def fold(busy, idle, launches, categories):
        return {"source": "trace", "busy_us": busy, "idle_us": idle, "kernel_launches": launches,
                "top_kernels": [{"kernel": "k"}], "top_gaps": [{"previous": "k", "next": "k", "us": idle}],
                "categories": {c: {"us": us, "launches": n} for c, (us, n) in categories.items()}}
    short = fold(50.0, 3.0, 20, {"matrix products": (30.0, 10), "SSD": (20.0, 10)})
    long = fold(50.0 + 4 * 12.5, 3.0 + 4 * 1.5, 20 + 4 * 6, {"matrix products": (30.0 + 4 * 8.0, 10 + 4 * 3),
                                                            "SSD": (20.0 + 4 * 4.0, 10 + 4 * 2),
                                                            "copies": (4 * 0.5, 4)})
    step = lm_decode.per_token_profile(short, long, decode_steps=4)
    assert step["busy_us"] == pytest.approx(12.5) and step["kernel_launches"] == pytest.approx(6)
    assert step["idle_us"] == pytest.approx(1.5) and step["top_gaps_long_call"][0]["us"] == pytest.approx(9.0)
    assert step["categories"] == {"matrix products": {"us": 8.0, "launches": 3.0}, "SSD": {"us": 4.0, "launches": 2.0},
                                  "copies": {"us": 0.5, "launches": 1.0}}
    assert step["decode_steps"] == 4 and step["top_kernels_long_call"] == [{"kernel": "k"}]
    table = lm_decode.format_table([{"config": "d64-l1", "label": "ours", "prefill_ms": {}, "batches": {
        "1": {"ms_per_token": 0.5, "tokens_per_s": 2000.0, "profile": step}}}])
    assert ("batch 1: GPU us per token step by category (launches): 12.5 busy, 1.5 idle, 6 launches; "
            "matrix products 8.0 (3)") in table


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_the_torch_decode_runs_the_peer_lm_with_a_stand_in_mixer(param_dtype):
    torch = pytest.importorskip("torch")
    from benchmarks import torch_lm
    from tests.benchmarks._torch_stand_in import stand_in_parts

    model = torch_lm.TorchLM(d_model=32, n_layer=2, vocab_size=64, **stand_in_parts(32))
    job = {"config": "d32-l2", "impl": "mamba_ssm", "param_dtype": param_dtype, "command_buffers": None,
           "batches": [1, 3], "prompt_lengths": [8], "decode_steps": 3, "repeats": 2, "warmup_seconds": 0.0}
    # The worker measures the device's rates after the work (`lm_bench.worker_main`); derive takes the floors from them.
    record = lm_decode.derive({**job, **lm_decode.decode_torch_model(job, model, torch.device("cpu")),
                               "device_rates": lm_bench.torch_device_rates(torch.device("cpu")),
                               "causal_conv1d": None, "error": None})
    assert record["weight_bytes"] == sum(p.numel() for p in model.parameters()) * (4 if param_dtype == "float32"
                                                                                     else 2)
    assert set(record["batches"]) == {"1", "3"} and record["prefill_ms"]["8"] > 0
    assert record["batches"]["3"]["ms_per_token"] > 0 and record["batches"]["3"]["floor"]["weights_ms"] > 0
    assert record["label"] == f"mamba_ssm Mamba2.step, CUDA graph (PyTorch), {param_dtype} params, no causal_conv1d"


def test_a_batch_that_fails_keeps_the_other_batches_rows(monkeypatch):
    """One batch's failure (say out of memory at the largest) is that batch's row, with its error; the others are
    timed and the table shows both."""
    timed = lm_decode._decode_batch

    def decode_batch(model, prompt, job, controls):
        if prompt.shape[0] == 2:
            raise ValueError("no room for batch 2")
        return timed(model, prompt, job, controls)
    monkeypatch.setattr(lm_decode, "_decode_batch", decode_batch)
    args = lm_decode.parse_args(["--configs", "d64-l1", "--impls", "xla", "--param-dtypes", "bfloat16", "--batches",
                                 "1", "2", "--prompt-lengths", "--decode-steps", "64", "--repeats", "2",
                                 "--warmup-seconds", "0"])
    (job, _), = lm_decode.jobs(args)
    record = lm_decode.derive({**job, **lm_decode.work(job), "error": None})
    assert record["batches"]["1"]["ms_per_token"] is not None and "error" not in record["batches"]["1"]
    assert record["batches"]["2"]["ms_per_token"] is None
    assert record["batches"]["2"]["error"] == "ValueError: no room for batch 2"
    assert "ValueError: no room for batch 2" in lm_decode.format_table([record])


def test_a_run_at_other_batches_adds_to_the_record_of_its_commit():
    def record(sha, gpu, batches, error=None, prefill=None):
        return {"config": "d1024-l24", "impl": "cutile", "param_dtype": "bfloat16", "command_buffers": "default",
                "environment": {"git_sha": sha, "gpu": gpu}, "batches": {str(b): {"ms_per_token": b} for b in batches},
                "prefill_ms": {str(n): 1.0 for n in prefill or ()}, "prompt_lengths": list(prefill or ()),
                "error": error}

    earlier = record("abc", "NVIDIA H200", (1, 64), prefill=(512,))
    combined = lm_decode.combine_batches(earlier, record("abc", "NVIDIA H200", (8, 64)))
    assert sorted(combined["batches"], key=int) == ["1", "8", "64"] and combined["prompt_lengths"] == [512]
    assert combined["batches"]["64"] == {"ms_per_token": 64}  # the new run's measurement of a batch wins
    for other in (record("def", "NVIDIA H200", (8,)), record("abc", "NVIDIA H100 80GB HBM3", (8,)),
                  record("abc", "NVIDIA H200", (), error="worker timed out")):
        assert lm_decode.combine_batches(earlier, other) is other  # another commit, GPU or a failed run replaces


def test_a_results_file_of_failed_runs_only_has_no_plot(tmp_path):
    failed = {"config": "d1024-l24", "impl": "cutile", "param_dtype": "float32", "batches": {},
              "error": "worker timed out after 110 s"}
    assert lm_decode.plot([failed], tmp_path / "lm_decode.png") is None
    assert not (tmp_path / "lm_decode.png").exists()
