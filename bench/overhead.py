"""Decode wall clock on the real VLM vs the base: routers with skipping off, static removal, layers deleted.

    python -m bench.overhead                     # routers at init, batch 1 and 8, 6 paired rounds
    python -m bench.overhead --adapter bench/.cache/runs/routed_static/adapter --target 0.2
    python -m bench.overhead --block-size 3      # routers at init in front of every third layer
    python -m bench.overhead --random-rates 0.2 0.3 --gate-share 0.2   # per-token skipping at decode as well

Every ratio is (tokens/s of the variant) / (tokens/s of the base), the median of `--rounds` paired rounds in
ABBA order in the same process (`bench.evaluate.paired_speed_ratios`); the base is the same model with the adapter's
hooks off (`RouterAdapter.unhooked`). The hooks' dispatch alone is the adapter attached but disabled. The last ratio deletes the
same layers from the plain model with the routers detached: static removal as a pruned release ships it.
On a busy CPU those ratios move by several per cent between calls, so each batch also reports routing's share of
one routed generate call, timed inside it (`bench.evaluate.routing_share`): a finer, lower-bound reading.

Per-token skipping (`--random-rates`, `--gate-share`) keeps image positions running, as the benchmark's per-token
rows do. Its decisions do not depend on speed, so the ratios compare across versions of the code. Without a
trained adapter the gate policy runs gates with random queries (seed 0), thresholded on the batch-1 prompt to skip
the given share of the text's layer executions.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def measure(model, adapter, inputs: dict[str, Any], pad: int, method, rounds: int, new_tokens: int) -> float:
    """Tokens/s under `method` ÷ the base's (the plain model: the adapter's hooks off, or `adapter=None`)."""
    from .evaluate import nullmethod, speed_ratio

    base_method = adapter.unhooked if adapter is not None else nullmethod
    return speed_ratio(model, inputs, method, base_method, pad, rounds=rounds, new_tokens=new_tokens)


def gate_threshold_for(model, adapter, inputs: dict[str, Any], pad: int, share: float, new_tokens: int) -> float:
    """One gate threshold for every block at which a generate call on `inputs` skips `share` of the text's layer
    executions (bisection; the decisions are deterministic)."""
    from .evaluate import timed_generate

    low, high = 0.0, 1.0
    for _ in range(12):
        middle = (low + high) / 2
        with adapter.skipping("gate", threshold=middle, skip_image_positions=False) as report:
            timed_generate(model, inputs, pad, new_tokens)
        low, high = (middle, high) if report.skipped_text_layer_fraction < share else (low, middle)
    return (low + high) / 2


def random_gates(adapter, seed: int = 0, scale: float = 0.3) -> None:
    """Give untrained gates random queries, so that their run probabilities differ from token to token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in adapter.gates.values():
            gate.query.copy_(torch.randn(gate.query.shape, generator=generator) * scale)


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
    parser.add_argument("--random-rates", type=float, nargs="*", default=[],
                        help="also measure random per-token skipping at these rates (image positions running)")
    parser.add_argument("--gate-share", type=float, default=None,
                        help="also measure the gate policy skipping this share of the text's layer executions")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers
    from vlm_retrofit.batch import on_device
    from vlm_retrofit.callbacks import generation_pad_id
    from vlm_retrofit.skipping import static_prefix

    from .data import tuxpaint_split
    from .evaluate import routing_share, timed_generate
    from .real_vlm import load_image, load_real_vlm
    from vlm_retrofit.pruning import layers_removed
    from .eval_set import prompt_inputs

    model, processor = load_real_vlm(dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    gates = args.gate_share is not None
    adapter = (RouterAdapter.from_pretrained(model, args.adapter) if args.adapter
               else attach_routers(model, RouterConfig(block_size=args.block_size, skip_gate=gates)))
    if gates and not args.adapter:
        random_gates(adapter)
    order = adapter.removal_order or sorted(adapter.layout.skippable_blocks)
    blocks = static_prefix(order, adapter.layout, args.target)  # what calibrate(..., 'static') removes
    layers = adapter.layout.layers_of_blocks(blocks)
    pad = generation_pad_id(getattr(processor, "tokenizer", processor))
    images = [load_image(path) for path, _ in tuxpaint_split("val")[:8]]
    print(f"threads {torch.get_num_threads()}, device {args.device} ({args.dtype}), adapter {args.adapter or 'routers at init'}, "
          f"{adapter.layout.num_blocks} blocks of {adapter.config.block_size} layer(s), "
          f"static blocks {sorted(blocks)}")
    results = []
    threshold = None
    for batch in (1, 8):
        inputs = on_device(prompt_inputs(processor, images[:batch]), args.device)
        with torch.no_grad():
            if gates and threshold is None:
                threshold = gate_threshold_for(model, adapter, inputs, pad, args.gate_share, args.new_tokens)
            routers = measure(model, adapter, inputs, pad, torch.no_grad, args.rounds, args.new_tokens)
            dispatch = measure(model, adapter, inputs, pad, adapter.disabled, args.rounds, args.new_tokens)
            static = measure(model, adapter, inputs, pad, lambda: adapter.skipping("static", blocks=blocks),
                             args.rounds, args.new_tokens)
            share = routing_share(model, adapter, inputs, pad, rounds=args.rounds, new_tokens=args.new_tokens)
        print(f"batch {batch}: routers, skipping off {routers:.3f}x base; static removal of {len(layers)} layers "
              f"{static:.3f}x base (tokens/s ratios; overhead = 1 / ratio = {1 / routers:.3f}); routing took "
              f"{share:.1%} of a routed generate call (overhead {1 / (1 - share):.3f} before dispatch and cache effects); "
              f"hooks attached, routers disabled {dispatch:.3f}x base")
        per_token = [(f"random skipping at rate {rate}", "random", {"rate": rate}) for rate in args.random_rates]
        if gates:
            per_token.append((f"gate policy at threshold {threshold:.4f}", "gate", {"threshold": threshold}))
        for name, policy, settings in per_token:
            def skipping(policy=policy, settings=settings):
                return adapter.skipping(policy, skip_image_positions=False, **settings)

            with torch.no_grad():
                with skipping() as report:  # what it skips on this batch (the same at every round)
                    timed_generate(model, inputs, pad, args.new_tokens)
                ratio = measure(model, adapter, inputs, pad, skipping, args.rounds, args.new_tokens)
            print(f"batch {batch}: {name}, {report.skipped_text_layer_fraction:.1%} of the text's layer executions "
                  f"skipped: {ratio:.3f}x base")
        results.append((batch, inputs))
    adapter.detach()  # the plain model from here on: no hooks on either side
    for batch, inputs in results:
        with torch.no_grad():
            deleted = measure(model, None, inputs, pad, lambda: layers_removed(model, adapter.spec, layers),
                              args.rounds, args.new_tokens)
        print(f"batch {batch}: the same {len(layers)} layers deleted, no routers: {deleted:.3f}x base")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
