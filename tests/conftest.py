"""Shared test set-up: offline hub, deterministic torch, and per-family tiny models built once per module."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _ctrl_c_handler_given_back():
    """Every run gives Ctrl-C back as it found it (`RetrofitCheckpoint` handles it during training)."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    assert signal.getsignal(signal.SIGINT) is before, "a run left its Ctrl-C handler installed"


def fit_config(run_dir, config: str, *overrides: str, status: int = 0) -> None:
    """A short `python -m vlm_retrofit fit --config configs/<config>` in `run_dir` (its runs/ land there)."""
    from pathlib import Path

    from vlm_retrofit.cli import main

    cwd = os.getcwd()
    os.chdir(run_dir)
    try:
        assert main(["fit", "--config", str(Path(__file__).parents[1] / "configs" / config),
                     "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
                     "--data.num_workers", "0", *overrides]) == status
    finally:
        os.chdir(cwd)
