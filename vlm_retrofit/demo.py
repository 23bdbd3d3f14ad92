"""The built-in default run: attach routers to a tiny VLM and show that the retrofit is exact at init."""

from __future__ import annotations

import argparse
import os

from .routing import RouterConfig, check_identity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_retrofit fit",
                                     description="Attach depth routers to a tiny offline VLM and check identity at init.")
    parser.add_argument("--family", default="qwen2_vl", help="tiny backbone family (see vlm_retrofit.testing.FAMILIES)")
    parser.add_argument("--block-size", type=int, default=1, help="decoder layers per routed block")
    ns = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .testing import tiny_inputs, tiny_vlm

    model, processor = tiny_vlm(ns.family)
    config = RouterConfig(block_size=ns.block_size)
    diff = check_identity(model, tiny_inputs(processor), config)
    from .routing import attach_routers

    adapter = attach_routers(model, config)
    routers = sum(p.numel() for p in adapter.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"backbone tiny:{ns.family}: {adapter.layout.num_layers} layers in {adapter.layout.num_blocks} blocks, "
          f"skippable {list(adapter.layout.skippable_blocks)}")
    print(f"router parameters: {routers:,} ({100 * routers / total:.2f} % of {total:,})")
    print(f"identity at init: max |logits(routed) - logits(base)| = {diff:.2e} (tolerance 1e-4)")
    print("Training (distillation), skipping and the compute report are not implemented yet; nothing is saved.")
    return 0
