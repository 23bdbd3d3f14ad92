"""Decode wall clock on the real VLM vs the base: routers with skipping off, static removal, layers deleted.

    python -m bench.overhead                     # routers at init, batch 1 and 8, 6 paired rounds
    python -m bench.overhead --adapter bench/.cache/runs/routed_static/adapter --target 0.2
    python -m bench.overhead --block-size 3      # routers at init in front of every third layer

Every ratio is (tokens/s of the variant) / (tokens/s of the base), the median of `--rounds` paired rounds in
ABBA order in the same process (`bench.evaluate.paired_speed_ratios`); the base is the same model with the adapter disabled. The last ratio deletes the
same layers from the plain model with the routers detached: static removal as a pruned release ships it.
On a busy CPU those ratios move by several per cent between calls, so each batch also reports routing's share of
one routed generate call, timed inside it (`bench.evaluate.routing_share`): a finer, lower-bound reading.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def measure(model, adapter, inputs: dict[str, Any], pad: int, method, rounds: int, new_tokens: int) -> float:
    """Tokens/s under `method` ÷ the base's (the adapter disabled; with `adapter=None` the plain model)."""
    from .evaluate import nullmethod, speed_ratio

    base_method = adapter.disabled if adapter is not None else nullmethod
    return speed_ratio(model, inputs, method, base_method, pad, rounds=rounds, new_tokens=new_tokens)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m bench.overhead`."""
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=None, help="trained adapter folder (default: routers at init)")
    parser.add_argument("--block-size", type=int, default=1,
                        help="layers per routed block for routers at init (a trained adapter keeps its own)")
    parser.add_argument("--target", type=float, default=0.2, help="static removal target (fraction of layers)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="paired rounds per ratio (ABBA order; the median is printed)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers
    from vlm_retrofit.callbacks import generation_pad_id
    from vlm_retrofit.skipping import static_prefix

    from .data import tuxpaint_split
    from .evaluate import routing_share
    from .real_vlm import load_image, load_real_vlm
    from vlm_retrofit.pruning import layers_removed
    from .sweep import prompt_inputs

    model, processor = load_real_vlm(dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    adapter = (RouterAdapter.from_pretrained(model, args.adapter) if args.adapter
               else attach_routers(model, RouterConfig(block_size=args.block_size)))
    order = adapter.removal_order or sorted(adapter.layout.skippable_blocks)
    blocks = static_prefix(order, adapter.layout, args.target)  # what calibrate(..., 'static') removes
    pad = generation_pad_id(getattr(processor, "tokenizer", processor))
    images = [load_image(path) for path, _ in tuxpaint_split("val")[:8]]
    print(f"threads {torch.get_num_threads()}, device {args.device} ({args.dtype}), adapter {args.adapter or 'routers at init'}, "
          f"{adapter.layout.num_blocks} blocks of {adapter.config.block_size} layer(s), "
          f"static blocks {sorted(blocks)}")
    results = []
    for batch in (1, 8):
        inputs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v
                  for k, v in prompt_inputs(processor, images[:batch]).items()}
        with torch.no_grad():
            routers = measure(model, adapter, inputs, pad, torch.no_grad, args.rounds, args.new_tokens)
            static = measure(model, adapter, inputs, pad, lambda: adapter.skipping("static", blocks=blocks),
                             args.rounds, args.new_tokens)
            share = routing_share(model, adapter, inputs, pad, rounds=args.rounds, new_tokens=args.new_tokens)
        print(f"batch {batch}: routers, skipping off {routers:.3f}x base; static removal of {len(blocks)} layers "
              f"{static:.3f}x base (tokens/s ratios; overhead = 1 / ratio = {1 / routers:.3f}); routing took "
              f"{share:.1%} of a routed generate call (overhead {1 / (1 - share):.3f} before dispatch and cache effects)")
        results.append((batch, inputs))
    adapter.detach()  # the plain model from here on: no hooks on either side
    layers = adapter.layout.layers_of_blocks(blocks)
    for batch, inputs in results:
        with torch.no_grad():
            deleted = measure(model, None, inputs, pad, lambda: layers_removed(model, adapter.spec, layers),
                              args.rounds, args.new_tokens)
        print(f"batch {batch}: the same {len(layers)} layers deleted, no routers: {deleted:.3f}x base")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
