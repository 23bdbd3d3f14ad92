"""`python -m bench.measure ADAPTER`: one trained adapter on the benchmark's test workloads, beside the base, in one run."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .run import RUNS, add_eval_arguments, load_for_measuring, machine, recorded_settings, repository_path
from .measuring import CANDIDATE_RULES


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m bench.measure`; the evaluation settings default to `make bench`'s, so its
    records compare with bench/results.json's rows (same test images, text chunks and calibration batches)."""
    parser = argparse.ArgumentParser(prog="python -m bench.measure", description=__doc__)
    parser.add_argument("adapter", help="an adapter folder (`fit` exports one to <default_root_dir>/adapter; a "
                                        "LoRA in its lora/ is merged into a copy of the base, as the benchmark does)")
    parser.add_argument("--name", default=None, help="the record's method name (default: the adapter's parent folder)")
    parser.add_argument("--policy", default="static", choices=["static", "gate", "recent_weight"],
                        help="the skip policy it is measured with (static: a prefix of its trained removal order, "
                             "and the pruned release for a LoRA-healed adapter)")
    add_eval_arguments(parser, targets=[0.2])
    parser.add_argument("--eval-split", default="test", choices=["test", "val"],
                        help="where the captions and the perplexity text come from: test for reported numbers, "
                             "val for choosing a recipe (its text chunks follow the ones per-token policies calibrate "
                             "on; the caption calibration batches are val images too, so per-token policies read "
                             "in-sample there)")
    parser.add_argument("--unit", default="layers", choices=["layers", "flops"],
                        help="what the targets count: layer executions skipped (the table's rows), or decoder-layer "
                             "FLOPs saved at decode (a per-token skip still writes its K/V and runs its stand-in), "
                             "both counted on the teacher-forced calibration batches; the records report what each "
                             "decode saved")
    parser.add_argument("--allocation", default="equal", choices=["equal", "shared"],
                        help="per-token policies: each candidate block skips the same share of tokens (equal), or "
                             "every candidate block has one threshold and skips what its scores put below it "
                             "(shared; calibrate's allocation)")
    parser.add_argument("--candidates", default="scaled", choices=list(CANDIDATE_RULES),
                        help="per-token policies: the blocks they may skip at each target, 1.5x as many of the "
                             "cheapest as a static removal there takes, the trained ones first (scaled, the table's "
                             "rule), or every block the adapter's skipping was trained on (trained: its "
                             "skip_candidates)")
    parser.add_argument("--runs", default=str(RUNS),
                        help="where the benchmark caches its removal searches (per-token policies rank blocks there)")
    parser.add_argument("--out", default=None, help="JSON file for the records (default: ADAPTER/../measure.json)")
    return parser


def prepare(args: argparse.Namespace, tool: str) -> tuple[Callable[[str], None], Any, Callable[[], Any]]:
    """Refuse a folder without an adapter, then build (or reuse) the real VLM and the shards and load the model and
    the eval set as `args` set them. Returns a timestamped logger, the `Bench` and a function loading another copy of
    the model (a LoRA is merged into one)."""
    adapter_dir = Path(args.adapter)
    if not (adapter_dir / "adapter_config.json").is_file():  # refused before the minutes of loading and base outputs
        raise SystemExit(f"{tool}: {adapter_dir} holds no adapter_config.json; pass the folder `fit` exported "
                         "(<default_root_dir>/adapter) or one written by `RouterAdapter.save_pretrained`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(0)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {message}", flush=True)

    from . import efficientnet_tower  # noqa: F401  registers the vision tower's config before any loading
    from .data import write_bench_shards
    from .real_vlm import build_real_vlm
    from .measuring import Bench

    manifest = write_bench_shards()
    args.backbone, args.replacement_batches = str(build_real_vlm()), 0  # the linear replacement is not measured here
    model, processor, data, load_model = load_for_measuring(args, manifest)
    bench = Bench(model, processor, data, args.new_tokens)
    bench.counted_on = args.counted_on
    bench.unit = getattr(args, "unit", "layers")
    bench.allocation = getattr(args, "allocation", "equal")
    bench.candidate_rule = getattr(args, "candidates", "scaled")
    return log, bench, load_model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    log, bench, load_model = prepare(args, "bench.measure")
    adapter_dir = Path(args.adapter)
    name = args.name or adapter_dir.resolve().parent.name
    out = Path(args.out) if args.out else adapter_dir.resolve().parent / "measure.json"

    from .real_vlm import weights_digest
    from .orders import rank_blocks
    from .sweep import measure_adapter

    model, data = bench.model, bench.data
    base = bench.measure_base()
    log(f"base: {base}")
    order = rank_blocks(model, data.calibration, Path(args.runs), log) if args.policy != "static" else []
    records = measure_adapter(bench, name, args.policy, adapter_dir, args.targets, args.speed_target, order,
                              load_model, log)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(args),
        "adapter": repository_path(args.adapter), "adapter_config": config,
        "backbone_weights": weights_digest(args.backbone),
        "base": base,
        "settings": recorded_settings(args, leave_out=("adapter", "out")),
        "records": records, "seconds": round(time.time() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    for record in records:
        log(" ".join(f"{k}={record[k]:.3f}" if isinstance(record.get(k), float) else f"{k}={record.get(k)}"
                     for k in ("method", "target", "ppl_ratio", "agreement", "kl", "rouge_l_ratio",
                               "decode_speedup_b1", "decode_speedup_b8") if k in record))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
