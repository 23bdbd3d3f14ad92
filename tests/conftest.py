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
