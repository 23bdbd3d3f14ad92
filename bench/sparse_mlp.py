"""`python -m bench.sparse_mlp ADAPTER`: a per-token policy with each MLP on the running tokens only vs over every token.

    python -m bench.sparse_mlp bench/.cache/runs/gate_lora_candidates/adapter --targets 0.2 0.3

For each target, the policy is calibrated on the caption val batches as the benchmark's rows are (the cheapest
blocks, image positions running every block unless `--skip-image-positions`), then one greedy generate call at
batch 1 and at batch 8 is run with a block's MLP on its running tokens only (`SkipController.sparse_mlp`, the
default) and over every token (the skipping tokens' outputs discarded). Both generate the same tokens; the record
gives the decoder-block FLOPs each saved (prefill and decode apart) and the decode wall-clock ratios, sparse ÷ whole
MLP and sparse ÷ the base (the adapter's hooks off), and the same two ratios for the prefill alone (one forward over
the prompt, vision tower included), each the median of `--rounds` paired rounds in ABBA order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .measure import build_parser as measure_parser, prepare


def prefill_ratio(model, inputs: dict[str, Any], method, base_method, rounds: int) -> float:
    """Seconds of one forward over `inputs` (a generate call's prefill) under `base_method` ÷ under `method`: the
    median of `rounds` paired rounds (`bench.evaluate.paired_ratios`)."""
    from .evaluate import paired_ratios, timed_forward

    return statistics.median(paired_ratios(lambda: timed_forward(model, inputs), method, base_method, rounds=rounds))


def build_parser() -> argparse.ArgumentParser:
    """`bench.measure`'s command line (adapter, evaluation settings, `--runs`, `--out`) with the policy, the rounds and
    the rule for image positions."""
    parser = measure_parser()
    parser.prog, parser.description = "python -m bench.sparse_mlp", __doc__
    parser.set_defaults(policy="gate", targets=[0.2, 0.3])
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds per wall-clock ratio")
    parser.add_argument("--skip-image-positions", action="store_true",
                        help="let image positions skip too (the benchmark's rows keep them running every block)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    log, bench, load_model = prepare(args, "bench.sparse_mlp")
    adapter_dir = Path(args.adapter)
    out = Path(args.out) if args.out else adapter_dir.resolve().parent / "sparse_mlp.json"

    from .evaluate import speed_ratio, timed_generate
    from .run import machine
    from .measuring import calibrated_per_workload, candidates_at
    from .orders import rank_blocks
    from .sweep import cheapest_blocks, load_as_shipped

    model, data = bench.model, bench.data
    order = rank_blocks(model, data.calibration, Path(args.runs), log)
    target_model, adapter = load_as_shipped(adapter_dir, model, load_model)  # as the benchmark measures it
    ranked = cheapest_blocks(adapter, data, order)
    records: list[dict[str, Any]] = []
    for target in args.targets:
        settings = calibrated_per_workload(adapter, data, target, args.policy, bench.tolerance,
                                           candidates=candidates_at(adapter, ranked, target),
                                           skip_image_positions=args.skip_image_positions)["captions"]

        def skipping(sparse: bool, settings: dict[str, Any] = settings):
            def method():
                controller = adapter.skipping(args.policy, **settings)
                controller.sparse_mlp = sparse
                return controller
            return method

        record: dict[str, Any] = {"target": target, "policy": args.policy,
                                  "skip_image_positions": args.skip_image_positions}
        with torch.no_grad():
            for key, inputs in (("b1", data.captions[0]), ("b8", data.batch8)):
                for sparse, side in ((True, "sparse"), (False, "whole")):
                    with skipping(sparse)() as report:
                        timed_generate(target_model, inputs, bench.pad, args.new_tokens)
                    record[f"{key}_{side}_mlp"] = {
                        "compute_saved": report.compute_saved, "compute_saved_prefill": report.prefill.compute_saved,
                        "compute_saved_decode": report.decode.compute_saved,
                        "skipped_text_layer_fraction": report.skipped_text_layer_fraction}
                record[f"{key}_sparse_over_whole_mlp"] = speed_ratio(
                    target_model, inputs, skipping(True), skipping(False), bench.pad, rounds=args.rounds,
                    new_tokens=args.new_tokens)
                record[f"{key}_sparse_over_base"] = speed_ratio(
                    target_model, inputs, skipping(True), adapter.unhooked, bench.pad, rounds=args.rounds,
                    new_tokens=args.new_tokens)
                record[f"{key}_prefill_sparse_over_whole_mlp"] = prefill_ratio(
                    target_model, inputs, skipping(True), skipping(False), args.rounds)
                record[f"{key}_prefill_sparse_over_base"] = prefill_ratio(
                    target_model, inputs, skipping(True), adapter.unhooked, args.rounds)
                saved = {side: record[f"{key}_{side}_mlp"]["compute_saved"] for side in ("sparse", "whole")}
                log(f"target {target:.2f} {key}: FLOPs saved {saved['sparse']:.1%} (whole MLP {saved['whole']:.1%}); "
                    f"decode {record[f'{key}_sparse_over_whole_mlp']:.3f}x the whole MLP's, "
                    f"{record[f'{key}_sparse_over_base']:.3f}x the base's; prefill "
                    f"{record[f'{key}_prefill_sparse_over_whole_mlp']:.3f}x / "
                    f"{record[f'{key}_prefill_sparse_over_base']:.3f}x")
        records.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(args),
                               "adapter": str(args.adapter), "rounds": args.rounds, "new_tokens": args.new_tokens,
                               "records": records, "seconds": round(time.time() - started, 1)}, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
