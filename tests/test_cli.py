"""`python -m vlm_retrofit`: usage, every shipped config parses, tiny configs run, and the built-in default fit."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from vlm_retrofit import RouterAdapter
from vlm_retrofit.cli import main
from vlm_retrofit.testing import tiny_vlm
from vlm_retrofit.training import inspect_checkpoint

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
TINY = [c for c in CONFIGS if yaml.safe_load(c.read_text())["model"]["backbone"].startswith("tiny:")]


def _printed_config(capsys, *args):
    capsys.readouterr()
    assert main(["fit", *args, "--print_config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_usage_without_arguments(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: python -m vlm_retrofit {fit,validate,test,predict,shards" in out
    assert main(["--help"]) == 0
    assert main(["no-such-command"]) == 2
    assert main(["shards", "--help"]) == 0  # non-Lightning subcommands keep their own parsers


def test_fit_help_documents_the_module_arguments(capsys):
    assert main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--model.backbone", "tiny:<family>", "--model.compute_target", "--model.router.skip_gate",
                 "--model.max_nonfinite_steps", "--ckpt_path", "--data CONFIG | CLASS_PATH_OR_NAME"):
        assert text in out
    # RouterConfig's attribute docstrings (before: no help text under any --model.router.* option).
    assert re.search(r"--model\.router\.block_size BLOCK_SIZE\s+Decoder layers per routed block", out)


def test_shipped_configs_include_tiny_and_real_backbone_templates():
    names = {c.name for c in CONFIGS}
    assert {"tiny.yaml", "smolvlm-256m.yaml", "qwen2-vl-2b.yaml", "llava-1.5-7b.yaml"} <= names
    for config in set(CONFIGS) - set(TINY):
        text = config.read_text()
        backbone = yaml.safe_load(text)["model"]["backbone"]
        if backbone.startswith("bench/"):  # the benchmark's real VLM: fast_dev_run in tests/test_real.py
            assert "NEEDS THE BENCH BUILD" in text
        else:
            assert "NEEDS A DOWNLOAD" in text and "/" in backbone


def _flattened(node, prefix=""):
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flattened(value, f"{prefix}{key}.").items()}
    if isinstance(node, list) and any(isinstance(item, dict) for item in node):
        return {k: v for i, item in enumerate(node) for k, v in _flattened(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: node}


def test_the_long_recipe_is_the_demo_recipe_over_a_longer_schedule():
    # jsonargparse cannot reach into the callbacks list from the command line, so the long recipe is a file of its
    # own: this keeps a change to the demo's recipe from missing it.
    demo, long = (_flattened(yaml.safe_load((CONFIGS[0].parent / name).read_text()))
                  for name in ("smollm2-tuxpaint.yaml", "smollm2-tuxpaint-long.yaml"))
    differing = {key for key in demo.keys() | long.keys() if demo.get(key) != long.get(key)}
    schedule = {"model.torch_dtype", "data.init_args.train_samples_per_epoch", "trainer.max_steps",
                "trainer.callbacks.1.init_args.every_n_train_steps"}
    paths = {"trainer.default_root_dir"}
    assert differing == schedule | paths
    for key in paths:
        assert long[key] == demo[key].replace("runs/smollm2-tuxpaint", "runs/smollm2-tuxpaint-long")

@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_every_shipped_config_parses(config, capsys):
    printed = _printed_config(capsys, "--config", str(config))
    written = yaml.safe_load(config.read_text())
    assert printed["model"]["backbone"] == written["model"]["backbone"]
    assert "processor" not in written["data"]["init_args"]  # linked to model.backbone, not set separately
    for key, value in written["model"].get("router", {}).items():
        assert printed["model"]["router"][key] == value
    assert printed["trainer"]["max_steps"] == written["trainer"]["max_steps"]


def test_tiny_yaml_is_the_builtin_default(capsys):
    assert _printed_config(capsys) == _printed_config(capsys, "--config", str(Path(CONFIGS[0]).parent / "tiny.yaml"))


def test_one_seed_drives_the_skip_sampling_and_the_data_stream(tmp_path, monkeypatch):
    # Lightning refuses a model and a datamodule logging different `seed`s: the model's seed is the data's.
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--model.seed", "3", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
                 "--trainer.enable_progress_bar", "false", "--data.num_workers", "0"]) == 0
    checkpoint = torch.load(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt", map_location="cpu",
                            weights_only=True)
    assert checkpoint["hyper_parameters"]["seed"] == checkpoint["datamodule_hyper_parameters"]["seed"] == 3


@pytest.mark.parametrize("config", TINY, ids=lambda c: c.name)
def test_tiny_configs_run_fast_dev_run(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(config), "--trainer.fast_dev_run", "1",
                 "--trainer.enable_progress_bar", "false", "--data.num_workers", "0"]) == 0


def test_builtin_default_fit_saves_and_reports(tmp_path, monkeypatch, capsys):
    """`python -m vlm_retrofit fit` (shortened): checkpoints under runs/tiny, the adapter, and a summary."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false"]) == 0
    out = capsys.readouterr().out
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert f"checkpoint {last}" in out and "KiB" in out and "keep ratio" in out
    info = inspect_checkpoint(last)
    assert info["global_step"] == 6 and info["file_bytes"] < 64 * 1024
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["datamodule_hyper_parameters"]["processor"] == "tiny:qwen2_vl"  # the backbone's processor
    metrics = tmp_path / "runs" / "tiny" / "logs" / "version_0" / "metrics.csv"
    # The skip-aware generation callback ran at validation and logged its metrics and plot.
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"skip/compute_saved", "skip/token_match", "skip/rouge_l", "skip/tokens_per_s"} <= set(header)
    assert (metrics.parent / "skip_rates_epoch0.png").is_file()
    assert "skip-aware generation" in out
    model, _ = tiny_vlm("qwen2_vl")
    adapter = RouterAdapter.from_pretrained(model, tmp_path / "runs" / "tiny" / "adapter")
    saved = checkpoint["state_dict"]
    assert {f"adapter.{k}" for k in adapter.state_dict()} == set(saved)
    for key, value in adapter.state_dict().items():  # the exported adapter is the checkpoint's final state
        assert torch.equal(value, saved[f"adapter.{key}"])


def test_validate_test_and_predict_from_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = ["--data", "vlm_retrofit.training.FixedBatchDataModule", "--data.num_batches", "2",
            "--data.batch_size", "2", "--trainer.enable_progress_bar", "false"]
    assert main(["fit", *data, "--trainer.max_steps", "2"]) == 0
    last = str(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt")
    for command in ("validate", "test", "predict"):
        assert main([command, *data, "--ckpt_path", last]) == 0, command
    # Before: `last` of a run folder without one evaluated (and predicted with) the untrained routers, exit 0.
    for command in ("validate", "predict"):
        assert main([command, *data, "--trainer.default_root_dir", "elsewhere", "--ckpt_path", "last"]) == 1
        assert re.search(rf"{command} refused: .*no last\.ckpt in .*elsewhere.*nothing trained to evaluate",
                         capsys.readouterr().err)
    assert not (tmp_path / "elsewhere" / "predictions.jsonl").exists()
    # A checkpoint file fills in the model settings left at their defaults only (Lightning's CLI took all of them,
    # dropping the backbone given): another backbone is refused, given a file or `last`.
    for path in (last, "last"):
        assert main(["validate", *data, "--model.backbone", "tiny:gemma3", "--ckpt_path", path]) == 1
        assert re.search(r"validate refused: .*different base model \(qwen2_vl.*\(gemma3", capsys.readouterr().err)


def test_test_and_predict_run_on_the_default_datamodule(tmp_path, monkeypatch, capsys):
    # Before: only validate did; test and predict stopped on Lightning's "test_dataloader must be implemented" with
    # every shipped config (the test above swaps in a fixed-batch datamodule).
    monkeypatch.chdir(tmp_path)
    fast = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
            "--trainer.limit_test_batches", "1", "--trainer.limit_predict_batches", "1", "--data.init_args.num_workers", "0"]
    assert main(["fit", *fast, "--trainer.max_steps", "1", "--trainer.callbacks.every_n_train_steps", "1"]) == 0
    last = str(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    assert main(["test", *fast, "--ckpt_path", last]) == 0
    assert "test/kl" in capsys.readouterr().out
    assert main(["predict", *fast, "--ckpt_path", last]) == 0
    # Before: predict computed these and dropped them (nothing printed, nothing written).
    out = capsys.readouterr().out
    assert re.search(r"vlm_retrofit predict: 1 batches, \d+ scored tokens: KL to the frozen model", out)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["tokens"] > 0 and 0 < rows[0]["compute_realised"] <= 1
    with pytest.warns(UserWarning, match="validate without --ckpt_path evaluates the routers as initialised"):
        assert main(["validate", *fast]) == 0


@pytest.mark.parametrize("options, problem", [
    (["--target-saving", "0.2"], "--target-saving needs --skip-policy"),
    (["--threshold", "0.9", "--budget", "2"], "--threshold and --budget need --skip-policy"),
    (["--skip-policy", "recent_weight", "--target-saving", "0.2", "--threshold", "0.9"], "not both"),
    (["--skip-policy", "static", "--threshold", "0.9"], "--skip-policy static reads its settings from a calibration"),
    (["--skip-policy", "random"], "--skip-policy random needs --target-saving"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--skip-policy", "gate", "--threshold", "2"], "--threshold is a routing weight or gate probability in [0, 1]"),
    (["--skip-policy", "gate", "--target-saving", "-1"], "--target-saving is a fraction between 0 and 1, got -1.0"),
])
def test_generate_refuses_skip_options_it_would_ignore_or_override_before_loading_anything(options, problem, capsys):
    # Before: --target-saving or --threshold without a policy were dropped ("[no skipping]"), a threshold silently
    # overrode a stored calibration, and random / static failed on settings the command line cannot give.
    assert main(["generate", "--model", "/nonexistent/release", "--prompt", "Hi", *options]) == 1
    assert problem in capsys.readouterr().err


def test_bad_files_and_settings_are_refused_in_one_line_naming_them(tmp_path, capsys):
    # Before: KeyError / OSError / PIL tracebacks, or (calibrate --batches 0) "no calibration samples".
    (tmp_path / "garbage.ckpt").write_bytes(b"\x00not a checkpoint" * 10)
    (tmp_path / "notimg.png").write_bytes(b"not an image")
    cases = [
        (["merge", "--ckpt", str(tmp_path / "garbage.ckpt"), "--output", str(tmp_path / "out")],
         "garbage.ckpt is not a readable checkpoint"),
        (["generate", "--model", str(tmp_path / "garbage.ckpt"), "--prompt", "Hi", "--image",
          str(tmp_path / "notimg.png")], "notimg.png cannot be read"),
        (["calibrate", "--model", str(tmp_path / "garbage.ckpt"), "--batches", "0"], "--batches must be at least 1"),
        (["calibrate", "--model", str(tmp_path / "garbage.ckpt"), "--target-saving", "0.2", "1.5"],
         "fractions between 0 and 1 (got [1.5])"),
        (["calibrate", "--model", str(tmp_path / "garbage.ckpt")], "garbage.ckpt is not a readable checkpoint"),
        (["calibrate", "--model", str(tmp_path / "garbage.ckpt"), "--batch-size", "0", "--candidates", "0"],
         "--batch-size must be at least 1, got 0; --candidates must be at least 1, got 0"),
        (["calibrate", "--model", str(tmp_path / "garbage.ckpt"), "--policy", "static", "--allocation", "shared"],
         "allocation 'shared' spreads a thresholded policy's skipping"),
        (["merge", "--ckpt", str(tmp_path / "garbage.ckpt"), "--output", str(tmp_path / "out"), "--prune-target",
          "-0.2"], "--prune-target is a fraction of the decoder layers between 0 and 1, got -0.2"),
    ]
    for command, message in cases:
        assert main(command) == 1, command
        printed = capsys.readouterr()
        assert message in printed.out + printed.err, (command, printed)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, message", [
    (["--model.backbone", "/nonexistent/model"], "backbone '/nonexistent/model': no such folder"),
    (["--model.backbone", "tiny:foo"], "unknown tiny family 'foo'"),
    (["--ckpt_path", "/nonexistent.ckpt"], "--ckpt_path /nonexistent.ckpt: no such file"),
    (["--ckpt_path", "README.md"], "--ckpt_path README.md is not a Lightning checkpoint"),
    (["--ckpt_path", "configs"], "--ckpt_path configs is a folder"),
    (["--data.train_shards", "/nonexistent"], "train_shards: '/nonexistent' matched no files"),
    (["--data.batch_size", "0"], "WebDatasetDataModule: batch_size must be >= 1, got 0"),
    (["--data.init_args.num_workers", "-1"], "WebDatasetDataModule: num_workers must be >= 0, got -1"),
    (["--model.temperature", "0"], "temperature must be > 0"),
    (["--model.removal_order", "impact", "--model.max_removed_blocks", "99"], "max_removed_blocks=99: only 2 blocks"),
    (["--model.router.block_size", "0"], "RouterConfig.block_size must be >= 1"),
])
def test_fit_refuses_bad_settings_and_files_in_one_line_before_training(options, message, tmp_path, capsys,
                                                                         monkeypatch):
    # Before: tracebacks (OSError "Repo id must be in the form", UnpicklingError, ShardError, ZeroDivisionError),
    # some only after the backbone loaded or training started.
    monkeypatch.chdir(Path(__file__).parents[1])
    assert main(["fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), *options]) == 1
    err = capsys.readouterr().err
    assert f"fit refused: {message}" in err and "Traceback" not in err
