"""The examples run end to end with tiny settings (exit status 0, outputs written and sensible).

Each example runs as `python examples/NAME.py` in a subprocess, as a user would start it.
"""
import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

REPO = pathlib.Path(__file__).resolve().parents[1]
ON_CPU = jax.default_backend() == "cpu"
TINY_LM = ["--d-model", "32", "--layers", "1", "--seq-len", "64", "--batch", "2", "--d-state", "16",
           "--headdim", "16", "--chunk-size", "64"]
MAX_STEPS, MAX_SEED = 2**31 - 1, 2**63 - 1  # train_lm.py's bounds: optax's int32 step count, JAX's int64 seeds


EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_"))


def start_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """Runs examples/<name>.py with `args` as a user would (from the repository, 120 columns)."""
    env = dict(os.environ, COLUMNS="120",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def run_example(name: str, *args: str) -> str:
    """Runs examples/<name>.py with `args`; returns its stdout, failing the test on a non-zero exit."""
    result = start_example(name, *args)
    assert result.returncode == 0, f"{name}.py exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory):
    """examples/train_lm.py run for 2 steps, then resumed to 3 with the blocks unrolled (the checkpoint holds the
    same stacked parameters either way): (out folder, stdout of the resumed run). The largest --seed: every model
    and key the runs make from it (the restore check's model from another seed) takes it."""
    out = tmp_path_factory.mktemp("examples")
    flags = [*TINY_LM, "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "8", "--data-mb", "0.3",
             "--seed", str(MAX_SEED), "--out", str(out)]
    run_example("train_lm", "--steps", "2", *flags)
    return out, run_example("train_lm", "--steps", "3", "--resume", "--unroll-layers", *flags)


def test_train_lm_trains_checkpoints_restores_and_samples(trained_lm):
    out, stdout = trained_lm
    if ON_CPU:
        assert "SSD backend: xla (auto: " in stdout
    assert "resumed from step 2" in stdout
    # The earlier run's schedule ended at step 2, the resumed one's at 3: said, with the rate that step 2 takes now.
    assert ("--resume: --steps 3 (the earlier run's 2) changes the learning-rate schedule: the rate at step 2 is"
            in stdout)
    assert "FAILED" not in stdout
    lm = out / "train_lm"
    metrics = json.loads((lm / "metrics.json").read_text())
    assert [step for step, _ in metrics["history"]["train"]] == [1, 2, 3]
    assert [step for step, _ in metrics["history"]["eval"]] == [2, 3]
    assert metrics["args"]["steps"] == 3 and metrics["args"]["resume"] is True  # the settings as JSON values
    assert sorted(p.name for p in (lm / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    assert (lm / "loss_curve.png").stat().st_size > 0
    assert "--- greedy ---\ndef " in (lm / "sample.txt").read_text()
    assert {p.name for p in (lm / "model").iterdir()} >= {"config.json", "model.safetensors"}


def test_train_lm_refuses_an_earlier_runs_checkpoints_without_resume(trained_lm):
    out, _ = trained_lm
    checkpoints = out / "train_lm" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    result = start_example("train_lm", "--steps", "1", *TINY_LM, "--data-mb", "0.3", "--out", str(out))
    assert result.returncode != 0
    assert "holds the checkpoints of an earlier run (steps [2, 3]); pass --resume" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == before
    # Resumed with fewer steps than its last checkpoint's: refused, nothing written over the later step's outputs.
    metrics = (out / "train_lm" / "metrics.json").read_bytes()
    result = start_example("train_lm", "--steps", "2", "--resume", *TINY_LM, "--data-mb", "0.3",
                           "--seed", str(MAX_SEED), "--out", str(out))
    assert result.returncode != 0
    assert "is at step 3, past --steps=2; resume with --steps 3 or more" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "train_lm" / "metrics.json").read_bytes() == metrics


def test_generate_loads_trained_model_and_matches_full_forward(trained_lm):
    out, _ = trained_lm
    stdout = run_example("generate", "--model-dir", str(out / "train_lm" / "model"), "--max-new-tokens", "8",
                         "--batch", "2", "--out", str(out))
    assert "tokens/s" in stdout
    record = json.loads((out / "generate" / "generate.json").read_text())
    assert record["tokens_per_s"] > 0
    # Float32 on CPU: cached and uncached paths agree on every token; kernels may flip a near-tie.
    assert record["cache_agreement"] == 1.0 if ON_CPU else record["cache_agreement"] >= 0.9
    assert record["texts"][0].startswith("def fibonacci(n):\n")
    # The unrolled model (one cache per layer in the decode loop) decodes the same tokens.
    run_example("generate", "--model-dir", str(out / "train_lm" / "model"), "--max-new-tokens", "8",
                "--batch", "2", "--unroll-layers", "--out", str(out / "unrolled"))
    unrolled = json.loads((out / "unrolled" / "generate" / "generate.json").read_text())
    assert unrolled["texts"] == record["texts"] if ON_CPU else unrolled["cache_agreement"] >= 0.9
    # The random model's shape flags would be ignored with a checkpoint: refused, naming them.
    result = start_example("generate", "--model-dir", str(out / "train_lm" / "model"), "--d-model", "64",
                           "--chunk-size", "32", "--out", str(out))
    assert result.returncode != 0
    assert ("--d-model, --chunk-size shape a random model; with --model-dir the checkpoint's config.json does"
            in result.stderr)


def test_generate_streams_the_tokens_generate_returns(tmp_path):
    stdout = run_example("generate", "--max-new-tokens", "6", "--layers", "1", "--d-model", "64", "--stream",
                         "--out", str(tmp_path))
    record = json.loads((tmp_path / "generate" / "generate.json").read_text())
    assert "--- streamed ---" in stdout and record["streamed_text"] == record["texts"][0]


def test_generate_ends_each_sample_at_an_eos_token_id(tmp_path):
    # Every byte an end of text: each continuation ends before its first token, printed and streamed alike.
    stdout = run_example("generate", "--max-new-tokens", "4", "--layers", "1", "--d-model", "64", "--stream",
                         "--prompt", "ab", "--prompt", "xyz", "--eos-token-id", *map(str, range(256)),
                         "--out", str(tmp_path))
    record = json.loads((tmp_path / "generate" / "generate.json").read_text())
    assert record["texts"] == ["ab", "xyz"] and record["streamed_text"] == "ab"
    assert record["eos_token_id"] == list(range(256)) and "--- streamed ---" in stdout


def test_generate_decodes_in_the_cache_dtype_asked(tmp_path):
    run_example("generate", "--max-new-tokens", "4", "--layers", "1", "--d-model", "64", "--param-dtype", "float32",
                "--cache-dtype", "bfloat16", "--out", str(tmp_path))
    record = json.loads((tmp_path / "generate" / "generate.json").read_text())
    assert record["param_dtype"] == "float32" and record["cache_dtype"] == "bfloat16"
    assert record["tokens_per_s"] > 0 and len(record["texts"]) == 1


def test_generate_samples_with_the_hf_controls(tmp_path):
    run_example("generate", "--max-new-tokens", "4", "--layers", "1", "--d-model", "64", "--temperature", "0.8",
                "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.2", "--out", str(tmp_path))
    record = json.loads((tmp_path / "generate" / "generate.json").read_text())
    assert record["sampling"] == dict(temperature=0.8, top_k=None, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    assert record["tokens_per_s"] > 0 and "cache_agreement" not in record


def test_generate_decodes_prompts_of_different_lengths_together_as_each_alone(tmp_path):
    run_example("generate", "--max-new-tokens", "5", "--layers", "2", "--d-model", "64", "--prompt", "x",
                "--prompt", "def main():\n    return", "--batch", "2", "--out", str(tmp_path))
    record = json.loads((tmp_path / "generate" / "generate.json").read_text())
    assert record["prompt_tokens"] == [1, 22] and record["batch"] == 4
    prompts = ["x", "def main():\n    return"]
    assert record["streamed_text"] is None
    assert [text[:len(prompt)] for text, prompt in zip(record["texts"], prompts)] == prompts
    assert record["cache_agreement"] == 1.0 if ON_CPU else record["cache_agreement"] >= 0.9


def test_compare_reference_reports_every_backend(tmp_path):
    run_example("compare_reference", "--batch", "1", "--seqlen", "100", "--nheads", "2", "--headdim", "16",
                "--dstate", "16", "--chunk-size", "64", "--repeats", "1", "--out", str(tmp_path))
    record = json.loads((tmp_path / "compare_reference.json").read_text())
    rows = {row["backend"]: row for row in record["rows"]}
    assert list(rows) == ["scan", "xla", "cutile", "cutile_callback"]
    for name in ("scan", "xla"):
        assert set(rows[name]["errors"]) == {"y", "final_states", "dx", "ddt", "dA", "dB", "dC", "dD", "dz",
                                             "ddt_bias", "dinitial_states"}
        assert max(rows[name]["errors"].values()) < 1e-4
    if ON_CPU:
        assert "no CUDA device" in rows["cutile"]["unavailable"]
    assert (tmp_path / "compare_reference.png").stat().st_size > 0


def test_jit_model_compiles_times_and_learns(tmp_path):
    stdout = run_example("jit_model", "--batch", "2", "--seqlen", "64", "--d-model", "32", "--layers", "1",
                         "--d-state", "16", "--headdim", "16", "--chunk-size", "64", "--repeats", "1",
                         "--out", str(tmp_path))
    assert "compiled HLO:" in stdout
    record = json.loads((tmp_path / "jit_model" / "timings.json").read_text())
    assert record["args"]["batch"] == 2 and record["args"]["out"] == str(tmp_path)  # the flags as JSON values
    for result in record["results"]:
        assert result["step_ms"]["median_ms"] > 0
        assert result["losses"][-1] < result["losses"][0]
        if result["backend"] == "cutile":
            assert result["cutile_launches"] > 0
    assert (tmp_path / "jit_model" / "xla.hlo.txt").stat().st_size > 0


def help_entries(help_text: str) -> list[str]:
    """The options of an argparse --help, one string each: an "  -x, --flag ..." line and the more deeply
    indented lines of its help text, whitespace collapsed; argument groups' headers end an entry."""
    entries = []
    for line in help_text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("   ") and entries:
            entries[-1] += line
    return [" ".join(e.split()) for e in entries]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help_shows_every_flag_with_its_default_and_keeps_the_command_lines(name):
    result = start_example(name, "--help")
    assert result.returncode == 0, result.stderr
    doc = ast.get_docstring(ast.parse((REPO / "examples" / f"{name}.py").read_text()))
    commands = [line for line in doc.splitlines() if line.startswith("    ")]
    assert any(line.endswith("\\") for line in commands), "a GPU command line continued on the next one"
    for line in commands:
        assert line in result.stdout.splitlines(), f"--help lost the docstring line {line!r}"
    entries = [e for e in help_entries(result.stdout) if not e.startswith("-h, --help")]
    assert len(entries) >= 8
    for entry in entries:
        assert "(default: " in entry, f"{name}.py --help: no help text or default in {entry!r}"


def load_example(name: str):
    """examples/<name>.py as a module (its sibling _common importable), for calling its functions."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"{name}_example", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "examples"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "examples"))
    return module


def test_train_lm_remat_flag_sets_the_model_option():
    """--remat (all of each block), --remat matmuls (all but in_proj's output), or neither."""
    train_lm = load_example("train_lm")
    for flags, remat in (([], False), (["--remat"], True), (["--remat", "matmuls"], "matmuls")):
        model = train_lm.build_model(train_lm.parse_args([*TINY_LM, *flags]), "xla", seed=0)
        assert model.remat == remat and type(model.remat) is type(remat), flags


@pytest.mark.parametrize("name, flags, message", [
    ("train_lm", ["--batch", "0"], "argument --batch: 0 must be a positive int"),
    ("train_lm", ["--lr", "-1"], r"argument --lr: -1.0 must be a finite number in \(0.0, inf\)"),
    ("generate", ["--top-p", "1.5"], r"argument --top-p: 1.5 must be a finite number in \(0.0, 1.0\]"),
    ("generate", ["--temperature", "-1"], r"argument --temperature: -1.0 must be a finite number in \[0.0, inf\)"),
    ("generate", ["--top-k", "0"], "argument --top-k: 0 must be a positive int"),
    ("jit_model", ["--delay", "-3"], r"--delay=-3 must be in \[0, --seqlen=512\)"),
    ("compare_reference", ["--repeats", "0"], "argument --repeats: 0 must be a positive int"),
    ("compare_reference", ["--nheads", "4", "--ngroups", "3"], "--nheads=4 must be a multiple of --ngroups=3"),
    ("train_lm", ["--chunk-size", "24"], "argument --chunk-size: 24 must be a power of two"),
    ("train_lm", ["--lr", "inf"], r"argument --lr: inf must be a finite number in \(0.0, inf\)"),
    ("train_lm", ["--seed", "-1"], r"argument --seed: -1 must be an int in \[0, 2\*\*63 - 1\]"),
    ("train_lm", ["--data-mb", "nan"], r"argument --data-mb: nan must be a finite number in \(0.0, inf\)"),
    ("train_lm", ["--data-mb", "inf"], r"argument --data-mb: inf must be a finite number in \(0.0, inf\)"),
    ("generate", ["--top-p", "abc"], "argument --top-p: invalid float value: 'abc'"),
    ("generate", ["--eos-token-id", "-1"], "argument --eos-token-id: -1 must be a token id, an int >= 0"),
    ("train_lm", ["--steps", str(MAX_STEPS + 1)], r"--steps=2147483648 must be at most 2\*\*31 - 1"),
    ("generate", ["--seed", str(MAX_SEED + 1)], r"argument --seed: 9223372036854775808 must be an int in \[0, 2"),
    ("train_lm", ["--prompt", "def \ud800"], r"--prompt='def \\ud800' holds '\\ud800', a lone surrogate"),
    ("train_lm", ["--batch", str(2**31)], r"argument --batch: 2147483648 must be a positive int of at most 2\*\*31 - 1 "
                                          r"\(an array axis\)"),
    ("train_lm", ["--seq-len", str(2**31 - 1)], r"argument --seq-len: 2147483647 must be a positive int of at most "
                                                r"2\*\*31 - 2 \(with one token more, an array axis\)"),
    ("train_lm", ["--sample-tokens", str(2**40)], r"argument --sample-tokens: 1099511627776 must be a positive int of "
                                                  r"at most 2\*\*31 - 2"),
    ("train_lm", ["--prompt", "ab", "--sample-tokens", str(2**31 - 2)],
     r"--sample-tokens=2147483646 after the 2 bytes of --prompt must make at most 2\*\*31 - 1 bytes \(an array "
     r"axis\)"),
    ("generate", ["--max-new-tokens", str(2**31 - 1)], r"argument --max-new-tokens: 2147483647 must be a positive int "
                                                       r"of at most 2\*\*31 - 2"),
    ("generate", ["--batch", str(2**31)], r"argument --batch: 2147483648 must be a positive int of at most "
                                          r"2\*\*31 - 1"),
    ("generate", ["--batch", str(2**30), "--prompt", "a", "--prompt", "b"],
     r"--batch=1073741824 copies of 2 --prompt must make at most 2\*\*31 - 1 rows \(an array axis\)"),
    ("train_lm", ["--batch", str(2**31 - 1), "--seq-len", str(2**29)],
     r"train_lm.py: a step's windows of shape \(--batch, --seq-len \+ 1\)=\(2147483647, 536870913\) would hold "),
    ("jit_model", ["--seqlen", str(2**31)], r"argument --seqlen: 2147483648 must be a positive int of at most "
                                            r"2\*\*31 - 1"),
    ("compare_reference", ["--batch", str(2**31)], r"argument --batch: 2147483648 must be a positive int of at "
                                                   r"most 2\*\*31 - 1"),
])
def test_examples_refuse_bad_flags_naming_them(capsys, name, flags, message):
    with pytest.raises(SystemExit):
        load_example(name).parse_args(flags)
    assert re.search(message, capsys.readouterr().err)


def test_generate_refuses_an_eos_token_id_past_the_vocabulary(tmp_path):
    with pytest.raises(SystemExit, match=r"^generate.py: --eos-token-id 256 must be below the model's vocabulary "
                                         r"\(256 tokens\)"):
        load_example("generate").main(["--eos-token-id", "3", "256", "--max-new-tokens", "2", "--layers", "1",
                                       "--d-model", "64", "--out", str(tmp_path)])


def test_generate_ends_in_one_line_for_an_option_generate_refuses(tmp_path):
    """A value argparse lets through but `generate` refuses (float32 cannot hold the temperature): one line
    naming it, no traceback."""
    with pytest.raises(SystemExit, match=r"^generate.py: generate: temperature=1e-45 must be 0 \(greedy\) or at "
                                         r"least 1.18e-38"):
        load_example("generate").main(["--temperature", "1e-45", "--max-new-tokens", "2", "--layers", "1",
                                       "--d-model", "64", "--out", str(tmp_path)])


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "ab", "--max-new-tokens", str(2**31 - 2)],
     r"^generate.py: the longest --prompt's tokens \+ --max-new-tokens=2147483648 must be at most 2\*\*31 - 1 "
     r"\(an array axis\)$"),
    (["--prompt", "ab", "--prompt", "cd", "--batch", str(2**30 - 1), "--max-new-tokens", str(2**31 - 3)],
     r"^generate.py: the output of shape \(rows, tokens\)=\(2147483646, 2147483647\) would hold "),
])
def test_generate_ends_in_one_line_for_an_output_no_array_holds(tmp_path, flags, message):
    """Flags argparse takes one by one whose output ids, (rows, prompt + new tokens), are longer than an axis or
    more than an array holds: generate's own checks, made once the prompts are tokens, end in one line before
    anything is generated."""
    generate = load_example("generate")

    def no_generation(*args, **kwargs):
        raise AssertionError("generate ran")

    generate.timed_generate = no_generation
    with pytest.raises(SystemExit, match=message):
        generate.main([*flags, "--layers", "1", "--d-model", "64", "--out", str(tmp_path)])


@pytest.mark.parametrize("name, flags", [
    ("train_lm", ["--lr", "3e-4", "--chunk-size", "16", "--seed", "0"]),
    ("train_lm", ["--steps", str(MAX_STEPS), "--seed", str(MAX_SEED), "--prompt", "\udcff"]),
    ("generate", ["--temperature", "0", "--top-p", "1", "--min-p", "0", "--repetition-penalty", "1.5", "--top-k", "1"]),
    ("train_lm", ["--batch", str(2**31 - 1), "--seq-len", str(2**29 - 2), "--prompt", "ab",
                  "--sample-tokens", str(2**31 - 3)]),
    ("generate", ["--max-new-tokens", str(2**31 - 2), "--batch", str(2**30 - 1), "--prompt", "a", "--prompt", "b"]),
    ("jit_model", ["--delay", "0"]),
    ("compare_reference", ["--nheads", "6", "--ngroups", "3"]),
])
def test_examples_accept_the_bounds_of_their_flags(name, flags):
    load_example(name).parse_args(flags)


def test_examples_refuse_paths_and_backends_they_cannot_use(tmp_path, capsys):
    generate = load_example("generate")
    with pytest.raises(SystemExit):
        generate.parse_args(["--model-dir", str(tmp_path)])  # no config.json
    assert "must be a checkpoint folder with a config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.parse_args(["--tokenizer", str(tmp_path / "missing.json")])
    assert "missing.json is not a file" in capsys.readouterr().err
    common = load_example("_common")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match="--out: cannot make the folder .*a_file"):
        common.output_dir(tmp_path / "a_file" / "out")
    compare_reference = load_example("compare_reference")
    compare_reference.oracle = None  # called by a run that does its work before checking --out: fails differently
    with pytest.raises(SystemExit, match="--out: cannot make the folder .*a_file"):
        compare_reference.main(["--out", str(tmp_path / "a_file")])
    assert [common.resolve_backend(name) for name in ("xla", "scan")] == ["xla", "scan"]
    if ON_CPU:
        with pytest.raises(SystemExit, match="--backend cutile cannot run here: "):
            common.resolve_backend("cutile")


def test_examples_end_in_one_line_for_model_flags_that_make_no_model():
    """A --headdim that does not divide the width passes argparse; building the model then refuses it, and the
    example exits with that message instead of a traceback."""
    train_lm = load_example("train_lm")
    with pytest.raises(SystemExit, match=r"--headdim / --chunk-size do not make a model: .*headdim'\]=48 must "
                                         r"divide d_inner"):
        train_lm.build_model(train_lm.parse_args([*TINY_LM, "--headdim", "48"]), "xla", seed=0)


def test_compare_reference_fails_on_a_nan_error():
    compare_reference = load_example("compare_reference")
    rows = [{"backend": "xla", "errors": {"y": float("nan")}}, {"backend": "scan", "errors": {"y": 1e-9}},
            {"backend": "cutile", "unavailable": "no GPU"}]
    assert compare_reference.failed_backends(rows, 1e-3) == ["xla"]


def test_train_lm_trains_from_its_first_step_and_refuses_to_resume_another_models_checkpoints(trained_lm):
    """The first step trains (a learning rate > 0; under 10 steps there is no warmup), also in a run of one
    step; the peak comes after a tenth of the steps. A --resume of checkpoints another model wrote names the
    model flags, and leaves the checkpoints as they were."""
    train_lm = load_example("train_lm")
    for steps in (1, 9):
        schedule = train_lm.learning_rate_schedule(train_lm.parse_args([*TINY_LM, "--steps", str(steps)]))
        assert float(schedule(0)) == pytest.approx(3e-3)
    schedule = train_lm.learning_rate_schedule(train_lm.parse_args([*TINY_LM, "--steps", "250"]))
    assert float(schedule(0)) == 0 and float(schedule(25)) == pytest.approx(3e-3)
    out, _ = trained_lm
    checkpoints = out / "train_lm" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    wider = [*TINY_LM[:1], "64", *TINY_LM[2:]]
    result = start_example("train_lm", "--steps", "4", "--resume", *wider, "--data-mb", "0.3", "--out", str(out))
    assert result.returncode != 0
    assert ("was written by a model of other shapes; resume with the model flags of the run that wrote it: "
            "--d-model 32 (not 64)") in result.stderr
    assert "Traceback" not in result.stderr  # the one line, no tracebacks of Orbax's threads after it
    assert sorted(p.name for p in checkpoints.iterdir()) == before


def test_train_lm_says_what_a_resumed_run_with_another_schedule_does_to_the_learning_rate(tmp_path):
    train_lm = load_example("train_lm")
    written = train_lm.parse_args([*TINY_LM, "--steps", "100", "--lr", "1e-3"])
    train_lm.write_metrics(tmp_path / "metrics.json", "xla", written, 1000, {"train": [], "eval": []})
    assert train_lm.schedule_change(train_lm.read_metrics(tmp_path / "metrics.json"), written, 100) is None
    assert train_lm.schedule_change(train_lm.read_metrics(tmp_path / "nothing.json"), written, 100) is None
    longer = train_lm.parse_args([*TINY_LM, "--steps", "200", "--lr", "2e-3"])
    rate_now, rate_before = float(train_lm.learning_rate_schedule(longer)(100)), 1e-4  # the cosine's end: lr / 10
    assert train_lm.schedule_change(train_lm.read_metrics(tmp_path / "metrics.json"), longer, 100) == (
        f"--resume: --steps 200 (the earlier run's 100), --lr 0.002 (the earlier run's 0.001) changes the "
        f"learning-rate schedule: the rate at step 100 is {rate_now:.3g}, where the earlier run's would be "
        f"{rate_before:.3g}")


def test_train_lm_keeps_the_loss_history_at_each_checkpoint_for_a_resumed_run(tmp_path):
    """metrics.json is written with each checkpoint, so a run resumed after an interruption starts from the
    history up to its checkpoint (not from nothing)."""
    train_lm = load_example("train_lm")
    args = train_lm.parse_args(TINY_LM)
    history = {"train": [(1, 5.0), (2, 4.5), (3, 4.2)], "eval": [(2, 4.6)]}
    train_lm.write_metrics(tmp_path / "metrics.json", "xla", args, 1000, history)
    assert train_lm.resumed_history(train_lm.read_metrics(tmp_path / "metrics.json"), 2) == {
        "train": [(1, 5.0), (2, 4.5)], "eval": [(2, 4.6)]}


def test_train_lm_schedule_runs_to_the_largest_steps():
    """The learning-rate schedule of the largest --steps reads optax's int32 count up to its last step (one more
    overflowed the schedule's int32 at its first step)."""
    train_lm = load_example("train_lm")
    args = train_lm.parse_args(["--steps", str(MAX_STEPS)])
    assert float(train_lm.learning_rate_schedule(args)(MAX_STEPS)) == pytest.approx(args.lr / 10)


def test_train_lm_windows_start_wherever_they_fit():
    """Every window start is drawn, the last one included (the window that ends at the split's last byte): a split
    of seq_len + 1 bytes gives that one window."""
    train_lm = load_example("train_lm")
    data = np.arange(5, dtype=np.uint8)
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(train_lm.sample_windows(data, rng, 3, seq_len=4), np.tile(data, (3, 1)))
    assert set(train_lm.sample_windows(data, rng, 64, seq_len=3)[:, 0]) == {0, 1}


def test_train_lm_samples_after_a_prompt_byte_that_is_not_utf8():
    """A byte of --prompt that is not UTF-8 (Python hands it over as a lone surrogate) is that byte of the model's
    input: the samples, drawn after the training, start from it."""
    train_lm = load_example("train_lm")
    args = train_lm.parse_args([*TINY_LM, "--prompt", "\udcffa"])
    assert load_example("_common").prompt_bytes(args.prompt) == b"\xffa"
    model = train_lm.build_model(args, "xla", seed=0)
    assert train_lm.sample_text(model, args.prompt, 2, temperature=0.0, seed=0).startswith("\ufffda")


def _checkpoints_of_a_run(train_lm, out: pathlib.Path, flags: list[str], steps) -> pathlib.Path:
    """train_lm.py's checkpoints of an untrained tiny model at `steps` in `out` (as a run with `flags` saves them,
    without its steps); returns their folder."""
    args = train_lm.parse_args(flags)
    model = train_lm.build_model(args, "xla", seed=0)
    checkpoints = out / "train_lm" / "checkpoints"
    manager = train_lm.checkpoint_manager(checkpoints)
    for step in steps:
        train_lm.save_checkpoint(manager, step, model, train_lm.build_optimizer(model, args))
    manager.close()
    return checkpoints


def test_train_lm_names_a_damaged_checkpoint_and_the_one_to_resume_from(tmp_path):
    """--resume of a checkpoint folder that Orbax cannot read (an item missing, as a copy cut short leaves it): one
    line naming the folder, what Orbax found missing and the earlier checkpoint to resume from (or a new run where
    there is none), before any step."""
    train_lm = load_example("train_lm")
    flags = [*TINY_LM, "--steps", "4", "--resume", "--data-mb", "0.3", "--out", str(tmp_path)]
    checkpoints = _checkpoints_of_a_run(train_lm, tmp_path, flags, (2, 3))
    shutil.rmtree(checkpoints / "3" / "optimizer")
    with pytest.raises(SystemExit, match=rf"^--resume: the checkpoint at step 3 cannot be read; its folder "
                                         rf"{re.escape(str(checkpoints / '3'))} is incomplete or damaged \(KeyError: "
                                         rf".*optimizer.*\)\. Delete that folder to resume from step 2, the checkpoint "
                                         rf"before it$"):
        train_lm.main(flags)
    shutil.rmtree(checkpoints / "2")
    with pytest.raises(SystemExit, match=r"incomplete or damaged \(KeyError: .*\)\. Delete that folder to start a "
                                         r"new run$"):
        train_lm.main(flags)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["3"]  # left as it was


def test_train_lm_resume_does_not_blame_the_checkpoint_for_other_errors(tmp_path, monkeypatch):
    """--resume whose restore fails for a reason that is not the checkpoint's folder (the device out of memory, a
    bug) raises that error as it is: it does not tell the user to delete a checkpoint that may be whole."""
    train_lm = load_example("train_lm")
    flags = [*TINY_LM, "--steps", "4", "--resume", "--data-mb", "0.3", "--out", str(tmp_path)]
    checkpoints = _checkpoints_of_a_run(train_lm, tmp_path, flags, (2,))

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
    monkeypatch.setattr(train_lm, "restore_checkpoint", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        train_lm.main(flags)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2"]


@pytest.mark.parametrize("text, problem", [('{"args": {"d_model": 3', "not JSON: "), ("[]", "no args and history"),
                                           ("[" * 100_000 + "]" * 100_000, "not JSON: ")],
                         ids=["cut_short", "another_file", "nested_too_deep"])
def test_train_lm_names_a_metrics_file_it_did_not_write(tmp_path, text, problem):
    """--resume with a metrics.json that is not the one the run wrote (cut short, or another file): one line naming
    it, before the checkpoint is read."""
    train_lm = load_example("train_lm")
    flags = [*TINY_LM, "--steps", "4", "--resume", "--data-mb", "0.3", "--out", str(tmp_path)]
    _checkpoints_of_a_run(train_lm, tmp_path, flags, (2,))
    metrics = tmp_path / "train_lm" / "metrics.json"
    metrics.write_text(text)
    with pytest.raises(SystemExit, match=rf"^--resume: {re.escape(str(metrics))} is not the metrics.json this script "
                                         rf"writes \({problem}.*\); move it away to resume without"):
        train_lm.main(flags)


def test_train_lm_resumes_only_on_the_data_of_the_run_that_wrote_the_checkpoint(tmp_path, monkeypatch, capsys):
    """--resume with other flags that decide the batches (--seed, --batch, --seq-len, --data-mb) than those the
    earlier run's metrics.json records: one line naming each, the recorded value and the one given, before the
    checkpoint is read. A checkpoint without that file (its run cut short before writing it, or copied without
    it) still resumes, saying that those flags go unchecked."""
    train_lm = load_example("train_lm")
    flags = [*TINY_LM, "--steps", "4", "--resume", "--data-mb", "0.3", "--out", str(tmp_path)]
    checkpoints = _checkpoints_of_a_run(train_lm, tmp_path, flags, (2,))
    metrics = tmp_path / "train_lm" / "metrics.json"
    train_lm.write_metrics(metrics, "xla", train_lm.parse_args(flags), 1000, {"train": [], "eval": []})
    written = metrics.read_bytes()
    checkpoint = re.escape(f"the checkpoint at step 2 in {checkpoints}")
    with pytest.raises(SystemExit, match=rf"^--resume: {checkpoint} was trained on the batches of other data flags; "
                                         r"resume with those of the run that wrote it: --seed 0 \(not 7\), --batch 2 "
                                         r"\(not 3\), --data-mb 0.3 \(not 0.4\)$"):
        train_lm.main([*flags, "--seed", "7", "--batch", "3", "--data-mb", "0.4"])
    with pytest.raises(SystemExit, match=r"resume with those of the run that wrote it: --seq-len 64 \(not 32\)$"):
        train_lm.main([*flags, "--seq-len", "32"])
    assert metrics.read_bytes() == written and sorted(p.name for p in checkpoints.iterdir()) == ["2"]

    class Restored(Exception):
        """The restore reached: the run resumes."""

    def restore(manager, step, model, optimizer):
        raise Restored(step)
    monkeypatch.setattr(train_lm, "restore_checkpoint", restore)
    reads, read_metrics = [], train_lm.read_metrics
    monkeypatch.setattr(train_lm, "read_metrics", lambda path: reads.append(path) or read_metrics(path))
    with pytest.raises(Restored):  # the same flags
        train_lm.main(flags)
    assert "--resume: " not in capsys.readouterr().out
    assert reads == [metrics]  # once: every check compares with the same record
    metrics.unlink()
    with pytest.raises(Restored):
        train_lm.main([*flags, "--seed", "7"])
    assert (f"--resume: no {metrics} records the flags of the run that wrote the checkpoint at step 2 in "
            f"{checkpoints}; the resumed steps draw their batches from --seed, --batch, --seq-len, --data-mb as given "
            "now, unchecked") in capsys.readouterr().out.splitlines()
