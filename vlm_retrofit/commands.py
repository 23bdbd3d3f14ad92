"""`python -m vlm_retrofit calibrate` and `generate`: skip thresholds for a trained adapter, and one answer with a report."""

from __future__ import annotations

import argparse
import os
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from .backbones.loading import require_chat_template
from .files import check_replaceable, write_adapter_folder
from .batch import on_device
from .hardware import device_problem
from .release import (HelpFormatter, Loaded, add_device_flag, add_dtype_flag, add_trust_remote_code_flag,
                      is_pruned_release, load_base_model, load_trained, refresh_model_card, summarize_pruning,
                      warn_about_slow_dtype)
from .skipping import ALLOCATIONS, POLICIES, UNITS, SkipController, allocation_problem, calibrate


def _processor_name(loaded: Loaded, source: Path) -> str:
    return str(source / "processor") if loaded.kind == "release" else loaded.base_model["name"]


def _adapter_output(loaded: Loaded, source: Path, output: str | None) -> tuple[Path, bool]:
    """Where calibration is stored, and whether that is in place (only the router files are rewritten): an
    adapter folder itself, a release's `router/`; else a new, complete adapter folder (`write_adapter_folder`)."""
    own = source / "router" if loaded.kind == "release" else source if loaded.kind == "adapter" else None
    target = Path(output) if output else own if own is not None else source.parent / f"{source.stem}-adapter"
    in_place = own is not None and target.resolve() == own.resolve()
    if loaded.kind == "release" and not in_place:
        raise ValueError(f"{source} is a release: its calibration is stored in {own}. An adapter folder elsewhere "
                         "would lose the weights the release merged; drop --output, or calibrate the adapter or "
                         "checkpoint it was merged from")
    if not in_place:
        check_replaceable(target, "adapter")  # e.g. the run folder holding the checkpoint: refused before any work
    return target, in_place


def _replacement_problem(loaded: Loaded, source: Path) -> str | None:
    """Why `source` cannot run as loaded: a replacement of removed layers stands in for layers that only a pruned
    release deletes, so routing or generating with them kept would count the removed span twice."""
    if loaded.replacement is None:
        return None
    return (f"{source} carries a replacement of removed layers {sorted(loaded.replacement[1])}, which only a "
            "pruned release runs: merge it with `python -m vlm_retrofit merge --prune-target ...` (or --prune-blocks "
            "for those layers) and use the release")


def calibrate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_retrofit calibrate", formatter_class=HelpFormatter,
        description="Set per-block skip thresholds that skip a target share of the decoder-layer executions (or "
                    "FLOPs) on calibration shards, measure what generating with them saves and how its answers agree with "
                    "unskipped generation, and store both with the adapter.")
    parser.add_argument("--model", required=True, help="checkpoint (.ckpt), router adapter folder or release folder")
    parser.add_argument("--base", default=None, help="base model, if not the one the adapter names")
    parser.add_argument("--shards", default=None, help="calibration WebDataset shards (default: built-in synthetic val split)")
    parser.add_argument("--target-saving", type=float, nargs="+", default=[0.25],
                        help="fractions of decoder-layer executions to skip (one calibration each), or of their "
                             "FLOPs to save with --unit flops")
    parser.add_argument("--unit", default="layers", choices=list(UNITS),
                        help="what --target-saving counts: layers = layer executions skipped; flops = decoder-layer "
                             "FLOPs saved at decode (a skipped layer's K/V write and stand-in still cost: ~6 %% and "
                             "~9 %% of a SmolLM2 layer), for comparing methods at matched compute")
    parser.add_argument("--policy", default="recent_weight", choices=sorted(POLICIES),
                        help="skip policy to calibrate: gate needs an adapter trained with skip gates; static removes "
                             "whole blocks; random is the baseline")
    parser.add_argument("--candidates", type=int, default=None,
                        help="per-token policies: skip only the N blocks cheapest to remove (the adapter's removal "
                             "order, else single-block removal impact on the calibration batches), the blocks its "
                             "skipping was trained on first; default: the blocks it was trained on, if training "
                             "restricted them, else every skippable block (spread over them as --allocation says)")
    parser.add_argument("--allocation", default="equal", choices=list(ALLOCATIONS),
                        help="per-token policies: how the skipping is spread over the blocks they may skip: equal = "
                             "each block skips the same share of tokens; shared = one threshold for every block, so "
                             "each skips the tokens its gate (or routing weight) puts below it, as training learned")
    parser.add_argument("--skip-image-positions", action=argparse.BooleanOptionalAction, default=None,
                        help="per-token policies: whether visual-placeholder positions may skip blocks; with "
                             "--no-skip-image-positions they run every block and the target counts text positions "
                             "only (what decoding skips); default: as the adapter was trained")
    parser.add_argument("--counted-on", default=None, choices=["real", "text", "response"],
                        help="per-token policies: the positions the target counts: response = the answer tokens "
                             "(what decode steps run; a prompt's positions may otherwise take most of the skipping); "
                             "real / text = every real / text position (as --skip-image-positions says); default: "
                             "response for an adapter whose compute target was counted there in training, else "
                             "real or text")
    parser.add_argument("--batches", type=int, default=4, help="calibration batches")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per calibration batch")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated to measure agreement")
    parser.add_argument("--output", default=None, help="adapter folder to write (default: the adapter itself; "
                                                       "for a checkpoint, <name>-adapter beside it)")
    add_trust_remote_code_flag(parser)
    add_dtype_flag(parser)
    add_device_flag(parser)
    ns = parser.parse_args(argv)
    bad_targets = [t for t in ns.target_saving if not 0 < t < 1]
    problems = [f"--target-saving takes fractions between 0 and 1 (got {bad_targets})"] if bad_targets else []
    problems += [problem] if (problem := device_problem(ns.device)) else []
    problems += [f"{option} must be at least 1, got {value}" for option, value in
                 (("--batches", ns.batches), ("--batch-size", ns.batch_size), ("--max-new-tokens", ns.max_new_tokens),
                  ("--candidates", ns.candidates)) if value is not None and value < 1]
    problems += [problem] if (problem := allocation_problem(ns.policy, ns.allocation)) else []
    if problems:  # before anything loads
        print(f"calibrate refused: {'; '.join(problems)}", file=sys.stderr)
        return 1
    from .callbacks import compare_generation, generation_pad_id, prompts_from_batch
    from .datamodules import DataQualityError, ShardError, WebDatasetDataModule

    source = Path(ns.model)
    if is_pruned_release(source):
        print(f"calibrate refused: {source} is a pruned release: its layers are deleted and it has no routers to "
              "calibrate; calibrate the adapter or checkpoint it was merged from", file=sys.stderr)
        return 1
    loaded = load_trained(source, ns.base, trust_remote_code=ns.trust_remote_code, torch_dtype=ns.dtype)
    if problem := _replacement_problem(loaded, source):
        print(f"calibrate refused: {problem}", file=sys.stderr)
        return 1
    if ns.dtype is None:
        warn_about_slow_dtype("calibrate", loaded.model, ns.device)
    try:
        output, in_place = _adapter_output(loaded, source, ns.output)  # before any work
    except ValueError as error:
        print(f"calibrate refused: {error}", file=sys.stderr)
        return 1
    loaded.model.to(ns.device)  # the routers follow it at its first forward
    data = WebDatasetDataModule(processor=_processor_name(loaded, source), train_shards=ns.shards,
                                val_shards=ns.shards, batch_size=ns.batch_size, num_workers=0,
                                add_quality_callback=False)
    try:
        data.setup("validate")
    except ShardError as error:  # the datamodule reads --shards as its train and val shards
        print(f"calibrate refused: --shards {ns.shards}: {error}", file=sys.stderr)
        return 1
    try:
        batches = list(islice(iter(data.val_dataloader()), ns.batches))
    except DataQualityError as error:  # the datamodule reads --shards as its val shards
        print(f"calibrate refused: --shards {ns.shards or '(the synthetic val split)'}: {error}", file=sys.stderr)
        return 1
    if not batches:
        print(f"calibrate refused: no calibration samples in {ns.shards or 'the synthetic val split'}",
              file=sys.stderr)
        return 1
    batches = [on_device(batch, ns.device) for batch in batches]
    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    prompts = [prompts_from_batch(batch, generation_pad_id(tokenizer)) for batch in batches]
    adapter = loaded.adapter
    for target in ns.target_saving:
        result = calibrate(adapter, batches, target, ns.policy, candidates=ns.candidates,
                           skip_image_positions=ns.skip_image_positions, counted_on=ns.counted_on, unit=ns.unit,
                           allocation=ns.allocation)
        metrics, report = compare_generation(loaded.model, adapter, prompts, ns.policy, result.settings, tokenizer,
                                             max_new_tokens=ns.max_new_tokens)
        adapter.calibration_metrics.setdefault(ns.policy, {})[f"{target:.4f}"] = {
            "achieved_saving": result.achieved_saving,
            "unit": result.unit,
            "allocation": result.allocation,
            "generation_compute_saved": metrics["skip/compute_saved"],
            "token_match": metrics["skip/token_match"],
            "rouge_l": metrics["skip/rouge_l"],
        }
        print(f"{result.summary()}; generating: compute saved {100 * metrics['skip/compute_saved']:.1f} %, "
              f"token match {100 * metrics['skip/token_match']:.1f} %, ROUGE-L {metrics['skip/rouge_l']:.3f}")
    loaded.model.to("cpu")  # written from the CPU, as every other adapter folder
    adapter.to("cpu")
    if in_place:
        adapter.save_pretrained(output)
        if loaded.kind == "release":  # its model card quotes the calibration
            refresh_model_card(source, loaded)
    else:
        write_adapter_folder(output, adapter, loaded.model if loaded.lora else None, loaded.replacement)
    print(f"calibration stored with the adapter in {output}")
    return 0


def chat_inputs(processor: Any, prompt: str, image: Any | None, source: str = "the model") -> dict[str, Any]:
    """Model inputs for one user turn (an image, if given, then the prompt), ending in the assistant's turn.
    `source` names where the processor came from in a refusal."""
    require_chat_template(processor, source, "renders the prompt as a user turn")
    content: list[dict[str, Any]] = ([{"type": "image", "image": image}] if image is not None else [])
    content.append({"type": "text", "text": prompt})
    messages = [{"role": "user", "content": content}]
    if not hasattr(processor, "image_processor"):  # a text-only LM: its processor is the tokenizer
        if image is not None:
            raise ValueError("this backbone is a text-only language model: drop --image")
        messages = [{"role": "user", "content": prompt}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def _agreement(output: torch.Tensor, reference: torch.Tensor) -> str:
    """`same/width tokens`: position-wise equal tokens of two greedy answers, over the longer one."""
    same = sum(int(a == b) for a, b in zip(output.tolist(), reference.tolist()))
    return f"{same}/{max(len(output), len(reference))} tokens"


def _tokens_per_second(generate, repeats: int = 2) -> float:
    """Best of `repeats` timed runs of `generate()` (returns the new tokens), after a warm-up run."""
    generate()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        count = generate().cpu().numel()  # the copy waits for an accelerator to finish
        best = min(best, (time.perf_counter() - start) / max(1, count))
    return 1.0 / best


def _compare_with_base(loaded: Loaded, base: str | None, generate_model, inputs: dict[str, Any], output: torch.Tensor,
                       options: dict[str, Any], tokenizer) -> None:
    """Print the unmodified base's answer, the agreement with it and the decode speed against it (batch 1)."""
    device = inputs["input_ids"].device
    base_model = load_base_model(loaded, base).to(device)
    prompt_length = inputs["input_ids"].shape[1]

    def generate_base() -> torch.Tensor:
        with torch.no_grad():
            return base_model.generate(**inputs, **options)[0, prompt_length:]

    reference = generate_base()
    speedup = _tokens_per_second(generate_model) / _tokens_per_second(generate_base)
    print(f"base model: {tokenizer.decode(reference, skip_special_tokens=True)}")
    print(f"agreement with the base's answer: {_agreement(output, reference)}; "
          f"decode {speedup:.2f}x the base's tokens/s "
          "(batch 1, best of 2 runs each; one prompt, so a rough figure: bench/ measures it properly)")


THRESHOLD_POLICIES = ("recent_weight", "gate")
"""The policies `generate --threshold` sets directly; the others read their settings from a stored calibration."""


def _skip_options_problem(ns: argparse.Namespace) -> str | None:
    """What is wrong with `generate`'s skip options, before anything loads (None: nothing); an option that would be
    ignored or overridden is refused rather than dropped."""
    if ns.max_new_tokens < 1:
        return f"--max-new-tokens must be at least 1, got {ns.max_new_tokens}"
    given = [f"--{name.replace('_', '-')}" for name in ("target_saving", "threshold", "budget")
             if getattr(ns, name) is not None]
    if not ns.skip_policy:
        verb = "needs" if len(given) == 1 else "need"
        return f"{' and '.join(given)} {verb} --skip-policy (which policy skips)" if given else None
    if ns.threshold is not None and ns.target_saving is not None:
        return "give --threshold or --target-saving (a stored calibration's thresholds), not both"
    if ns.target_saving is not None and not 0 < ns.target_saving < 1:
        return f"--target-saving is a fraction between 0 and 1, got {ns.target_saving}"
    if ns.threshold is not None and not 0 <= ns.threshold <= 1:  # a routing weight or a gate's probability
        return f"--threshold is a routing weight or gate probability in [0, 1], got {ns.threshold}"
    if ns.threshold is not None and ns.skip_policy not in THRESHOLD_POLICIES:
        return (f"--threshold sets {' or '.join(THRESHOLD_POLICIES)} thresholds; --skip-policy {ns.skip_policy} reads "
                "its settings from a calibration: pass --target-saving")
    if ns.threshold is None and ns.target_saving is None:
        extra = " or --threshold" if ns.skip_policy in THRESHOLD_POLICIES else ""
        return (f"--skip-policy {ns.skip_policy} needs --target-saving (a calibration stored by `calibrate --policy "
                f"{ns.skip_policy}`){extra}")
    return None


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_retrofit generate",
                                     formatter_class=HelpFormatter,
                                     description="Answer one prompt (optionally about an image) with block skipping, "
                                                 "and print the compute report.")
    parser.add_argument("--model", required=True, help="checkpoint (.ckpt), router adapter folder or release folder")
    parser.add_argument("--base", default=None, help="base model, if not the one the adapter names")
    parser.add_argument("--image", default=None, help="image file")
    parser.add_argument("--prompt", required=True, help="the user's message (the model's chat template wraps it)")
    parser.add_argument("--skip-policy", default=None, choices=sorted(POLICIES),
                        help="skip policy (default: no skipping, still reporting compute)")
    parser.add_argument("--target-saving", type=float, default=None, help="use the calibration stored for this target")
    parser.add_argument("--threshold", type=float, default=None,
                        help="explicit threshold for recent_weight / gate (instead of --target-saving)")
    parser.add_argument("--budget", type=float, default=None, help="max blocks one token may skip (count or fraction)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (greedy)")
    parser.add_argument("--compare-base", action="store_true",
                        help="also load the unmodified base model: print its answer, the agreement with it and the "
                             "decode speed against it")
    add_trust_remote_code_flag(parser)
    add_dtype_flag(parser)
    add_device_flag(parser)
    ns = parser.parse_args(argv)
    problem = _skip_options_problem(ns) or device_problem(ns.device)
    if problem:
        print(f"generate refused: {problem}", file=sys.stderr)
        return 1
    if ns.image is not None and not os.path.isfile(ns.image):
        print(f"generate refused: image {ns.image} does not exist", file=sys.stderr)
        return 1
    from PIL import Image

    try:
        image = Image.open(ns.image).convert("RGB") if ns.image else None
    except (OSError, Image.DecompressionBombError) as error:  # before the model loads
        print(f"generate refused: image {ns.image} cannot be read ({type(error).__name__}: {error})",
              file=sys.stderr)
        return 1
    if ns.skip_policy and is_pruned_release(ns.model):
        print(f"generate refused: {ns.model} is a pruned release with no routers: drop --skip-policy (its removed "
              "layers are deleted from the weights, every token saves them)", file=sys.stderr)
        return 1
    loaded = load_trained(Path(ns.model), ns.base, trust_remote_code=ns.trust_remote_code, torch_dtype=ns.dtype)
    if problem := _replacement_problem(loaded, Path(ns.model)):
        print(f"generate refused: {problem}", file=sys.stderr)
        return 1
    if ns.dtype is None:
        warn_about_slow_dtype("generate", loaded.model, ns.device)
    try:
        inputs = chat_inputs(loaded.processor, ns.prompt, image, _processor_name(loaded, Path(ns.model)))
    except ValueError as error:
        print(f"generate refused: {error}", file=sys.stderr)
        return 1
    loaded.model.to(ns.device)  # the routers follow it at its first forward
    inputs = on_device(inputs, ns.device)
    settings: dict[str, Any] = {}
    if ns.threshold is not None:
        settings = {"thresholds" if ns.skip_policy == "recent_weight" else "threshold": ns.threshold}
    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    prompt_length = inputs["input_ids"].shape[1]
    options = dict(max_new_tokens=ns.max_new_tokens, do_sample=False)
    if loaded.adapter is None:  # a pruned release (refused above with a skip policy): its removed layers are gone

        def generate_pruned() -> torch.Tensor:
            with torch.no_grad():
                return loaded.model.generate(**inputs, **options)[0, prompt_length:]

        output = generate_pruned()
        print(tokenizer.decode(output, skip_special_tokens=True))
        print(f"[pruned release] {summarize_pruning(Path(ns.model))}")
        if ns.compare_base:
            _compare_with_base(loaded, ns.base, generate_pruned, inputs, output, options, tokenizer)
        return 0

    def controller() -> SkipController:
        return (loaded.adapter.skipping(ns.skip_policy, target_saving=ns.target_saving, budget=ns.budget, **settings)
                if ns.skip_policy else SkipController(loaded.adapter, None))

    def generate_routed() -> torch.Tensor:
        with torch.no_grad(), controller():
            return loaded.model.generate(**inputs, **options)[0, prompt_length:]

    try:
        skipping = controller()
    except ValueError as error:
        print(f"generate refused: {error}", file=sys.stderr)
        return 1
    with torch.no_grad(), skipping as report:
        output = loaded.model.generate(**inputs, **options)[0, prompt_length:]
    print(tokenizer.decode(output, skip_special_tokens=True))
    print(f"[{ns.skip_policy or 'no skipping'}] {report.summary()}")
    if ns.skip_policy:
        with torch.no_grad():
            reference = loaded.model.generate(**inputs, **options)[0, prompt_length:]
        print(f"without skipping: {tokenizer.decode(reference, skip_special_tokens=True)}")
        print(f"agreement with the unskipped answer: {_agreement(output, reference)}; "
              f"decoder-block compute saved {100 * report.compute_saved:.1f} %")
    if ns.compare_base:
        _compare_with_base(loaded, ns.base, generate_routed, inputs, output, options, tokenizer)
    return 0
