"""Two-process DDP on CPU (gloo) with the WebDataset stream, through the real command line."""

import os
import subprocess
import sys

import pytest
import torch

from vlm_retrofit.training import RetrofitModule, inspect_checkpoint


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PL_DISABLE_FORK": "1"}
    command = [
        sys.executable, "-m", "vlm_retrofit", "fit",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false",
        "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "2",
        "--trainer.log_every_n_steps", "1",
        "--data.num_workers", "0", "--data.batch_size", "2", "--data.train_samples_per_epoch", "8",
        "--data.data_dir", str(tmp_path / "shards"),
        "--model.max_drop_rate", "0.3", "--model.drop_warmup_steps", "0",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Starting with 2 processes" in output and "gloo" in output
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    info = inspect_checkpoint(last)
    assert info["global_step"] == 4  # 4 steps of batches from each rank's own shard stream
    state = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    init = RetrofitModule(router={"skip_gate": True}).trainable_state_dict()
    assert set(state) == set(init)  # trainable state only, also under DDP
    assert any((state[k] - init[k]).abs().max() > 1e-4 for k in init)
    metrics = (tmp_path / "runs" / "tiny" / "logs" / "version_0" / "metrics.csv").read_text()
    assert "val/kl" in metrics and "train/keep_realised" in metrics, output[-3000:]  # validation ran on both ranks
