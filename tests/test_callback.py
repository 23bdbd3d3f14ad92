"""SkipAwareGenerationCallback in a real fit run: metrics reach CSV and TensorBoard, a plot is written, off is free."""

import csv

import lightning.pytorch as pl
import pytest
import torch

from vlm_retrofit import RouterConfig
from vlm_retrofit.callbacks import SkipAwareGenerationCallback, prompts_from_batch
from vlm_retrofit.datamodules import WebDatasetDataModule
from vlm_retrofit.training.module import RetrofitModule


def _fit(tmp_path, logger, callback, **module_args):
    module = RetrofitModule(backbone="tiny:qwen2_vl", **module_args)
    data = WebDatasetDataModule(processor="tiny:qwen2_vl", batch_size=4, num_workers=0, train_samples_per_epoch=8,
                                data_dir=str(tmp_path / "data"))
    trainer = pl.Trainer(max_epochs=1, limit_val_batches=1, callbacks=[callback], default_root_dir=tmp_path,
                         logger=logger, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(module, data)
    return trainer


def test_metrics_and_plot_reach_the_csv_logger(tmp_path, capsys):
    callback = SkipAwareGenerationCallback(max_samples=4, max_new_tokens=4, target_saving=0.25)
    trainer = _fit(tmp_path, pl.loggers.CSVLogger(tmp_path), callback)
    metrics = callback.last_metrics
    # Batched generation saves FLOPs only on steps every row skips; the token-level fraction is the target.
    assert 0 <= metrics["skip/compute_saved"] <= metrics["skip/skipped_layer_fraction"]
    assert metrics["skip/skipped_layer_fraction"] == pytest.approx(0.25, abs=0.1)
    assert 0 <= metrics["skip/token_match"] <= 1 and 0 <= metrics["skip/rouge_l"] <= 1
    assert metrics["skip/tokens_per_s"] > 0 and metrics["skip/base_tokens_per_s"] > 0
    assert max(metrics[f"skip/block_{b}"] for b in (1, 2)) > 0
    with open(f"{trainer.logger.log_dir}/metrics.csv") as handle:
        columns = next(csv.reader(handle))
    assert {"skip/compute_saved", "skip/token_match", "skip/rouge_l", "skip/block_1"} <= set(columns)
    assert list(tmp_path.rglob("skip_rates_epoch0.png"))
    assert "skip-aware generation" in capsys.readouterr().out


def test_figure_reaches_tensorboard(tmp_path):
    callback = SkipAwareGenerationCallback(max_samples=4, max_new_tokens=4)
    _fit(tmp_path, pl.loggers.TensorBoardLogger(tmp_path), callback)
    assert callback.last_metrics and list(tmp_path.rglob("events.out.tfevents.*"))


def test_gates_counted_on_the_answers_are_calibrated_on_them(tmp_path, monkeypatch):
    from vlm_retrofit.callbacks import skip_generation

    calibrated_on = []
    calibrate = skip_generation.calibrate
    monkeypatch.setattr(skip_generation, "calibrate",
                        lambda adapter, batches, *a, **k: calibrated_on.append(batches) or calibrate(adapter, batches, *a, **k))
    callback = SkipAwareGenerationCallback(max_samples=4, max_new_tokens=4, target_saving=0.25)
    _fit(tmp_path, pl.loggers.CSVLogger(tmp_path), callback, router={"skip_gate": True}, compute_target=0.8)
    assert callback.active_policy == "gate" and callback.last_metrics
    assert all("loss_mask" in batch for batch in calibrated_on[0])  # the whole batches: their answers are counted


def test_disabled_callback_does_nothing(tmp_path):
    callback = SkipAwareGenerationCallback(enabled=False)
    _fit(tmp_path, pl.loggers.CSVLogger(tmp_path), callback)
    assert callback.last_metrics == {} and callback._batches == []


def test_prompts_are_cut_before_the_response_and_left_padded():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
        "loss_mask": torch.tensor([[False, True, True, False, False, False], [False, False, True, True, True, False]]),
    }
    prompts = prompts_from_batch(batch, pad_token_id=0)
    assert prompts["input_ids"].tolist() == [[0, 1, 2], [5, 6, 7]]
    assert prompts["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert "loss_mask" not in prompts


def test_a_gate_policy_without_gates_is_refused_at_setup_not_after_the_first_validation():
    # Before: `validate --ckpt_path <a removal run>` with the default callbacks validated, then raised a traceback.
    from types import SimpleNamespace

    from vlm_retrofit.errors import InputError

    gateless = SimpleNamespace(adapter=SimpleNamespace(config=RouterConfig(skip_gate=False)))
    with pytest.raises(InputError, match="policy 'gate' needs routers with skip gates"):
        SkipAwareGenerationCallback(policy="gate").setup(None, gateless, "validate")
    SkipAwareGenerationCallback(policy="recent_weight").setup(None, gateless, "validate")
    SkipAwareGenerationCallback(policy="gate", enabled=False).setup(None, gateless, "validate")
    # The default follows the model (`validate --ckpt_path <a run without gates>` with the built-in callbacks).
    for gates, policy in ((False, "recent_weight"), (True, "gate")):
        callback = SkipAwareGenerationCallback()
        callback.setup(None, SimpleNamespace(adapter=SimpleNamespace(config=RouterConfig(skip_gate=gates))), "fit")
        assert callback.active_policy == policy and callback.policy is None
