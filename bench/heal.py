"""`python -m bench.heal VARIANT [--removal 13 14 15 16 17 18]`: train one variant, no searches.

`make bench` (`python -m bench.run`) ranks blocks and searches removal orders before it trains, then measures every
baseline after: minutes that a longer or larger healing run on a borrowed GPU cannot spare, and it trains seed 0
only. This trains one variant (`bench.variants.VARIANTS`) exactly as the bench does (`train_variant`: the wall-clock
budget, its decay, the mixed training stream) with any `--seed`: a static one on a removal order given by hand (e.g.
the span the bench's search picked), a per-token one (gates, recent weight) as it is. Measure the adapter after with
`python -m bench.measure RUNS/VARIANT/adapter` (the pruned release for a LoRA-healed static one; `--policy gate` or
`recent_weight` for a per-token one).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import time
from pathlib import Path

import torch

from .run import RUNS
from .variants import VARIANTS, selected_variants


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m bench.heal`; the training settings default to `make bench`'s."""
    parser = argparse.ArgumentParser(prog="python -m bench.heal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=sorted(VARIANTS), help="a variant of bench.run")
    parser.add_argument("--removal", type=int, nargs="+", default=None,
                        help="a static variant's decoder layers removed in training, in removal order (every step "
                             "removes all of them: the variant's fixed removal); required for a static variant, "
                             "refused for a per-token one")
    parser.add_argument("--train-minutes", type=float, default=20.0, help="wall-clock budget; the rate decays over it")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr-scale", type=float, default=1.0,
                        help="multiplies the variant's learning rate (1.41 with --batch-size 8: bench.run --help)")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--train-precision", default=None, choices=["32-true", "bf16-mixed"],
                        help="default: bf16-mixed where the device has fast bf16 kernels, else 32-true")
    parser.add_argument("--seed", type=int, default=0, help="seeds the training stream and the LoRA initialisation")
    parser.add_argument("--runs", default=str(RUNS), help="the adapter goes to RUNS/VARIANT/adapter")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="replaces one of the variant's RetrofitModule arguments (VALUE read as JSON, else as "
                             "text), e.g. --set replacement_epochs=8; repeatable. The train_info.json records them")
    return parser


def module_overrides(pairs: list[str]) -> dict[str, object]:
    """`--set KEY=VALUE` pairs as RetrofitModule arguments; a key it does not take is refused by name."""
    from vlm_retrofit.training import RetrofitModule

    accepted = set(inspect.signature(RetrofitModule.__init__).parameters) - {"self"}
    overrides: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in accepted:
            raise SystemExit(f"bench.heal: --set {pair!r} names no RetrofitModule argument; give KEY=VALUE with KEY "
                             f"one of {sorted(accepted)}")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variant = selected_variants([args.variant])[0]
    overrides = module_overrides(args.overrides)
    variant = dataclasses.replace(variant, module={**variant.module, **overrides})
    static = variant.policy == "static"
    if static:
        if not variant.fixed_removal:
            raise SystemExit(f"bench.heal: {args.variant} trains a removal schedule (prefixes of an order), not a "
                             "fixed removal; train it with `python -m bench.run --variants` instead")
        if args.removal is None:
            raise SystemExit(f"bench.heal: {args.variant} is a static variant: give the layers it removes (--removal)")
        if len(set(args.removal)) != len(args.removal):
            raise SystemExit(f"bench.heal: --removal names a layer twice ({args.removal}); give each removed layer "
                             "once")
    elif args.removal is not None:
        raise SystemExit(f"bench.heal: {args.variant} skips per token ({variant.policy}) and removes no fixed layers; "
                         "leave out --removal")
    out = Path(args.runs) / variant.name
    if (out / "train_info.json").is_file():  # train_variant would silently reuse it
        raise SystemExit(f"bench.heal: {out} already holds a trained adapter; delete the folder to retrain")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(args.seed)
    started = time.time()

    from . import efficientnet_tower  # noqa: F401  registers the vision tower's config before any loading
    from .data import write_bench_shards
    from .real_vlm import build_real_vlm
    from .training import train_variant, training_precision, training_shards

    manifest = write_bench_shards()
    backbone = str(build_real_vlm())
    shards = training_shards(manifest)
    removal = ({"removal_order": list(args.removal), "max_removed_blocks": len(args.removal),
                "min_removed_blocks": len(args.removal)} if static else {})
    precision, dtype = training_precision(args.device, args.train_precision)
    trains = f"removal {args.removal}" if static else f"{variant.policy} policy"
    print(f"[{time.time() - started:7.1f}s] training {variant.name} for {args.train_minutes} min, {trains}, seed "
          f"{args.seed}, batch {args.batch_size}, lr x{args.lr_scale}, {precision}", flush=True)
    info = train_variant(variant, backbone, shards, args.train_minutes, args.batch_size, removal=removal,
                         runs=Path(args.runs), device=args.device, dtype=dtype, precision=precision,
                         num_workers=args.num_workers, lr_scale=args.lr_scale, decay_over="budget", seed=args.seed,
                         recorded={"overrides": overrides} if overrides else None)
    print(f"[{time.time() - started:7.1f}s] trained: {json.dumps(info)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
