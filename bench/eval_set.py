"""The benchmark's eval set on the real VLM: caption prompts and references, held-out text, calibration batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlm_retrofit.batch import on_device


@dataclass
class EvalSet:
    """What every method is measured on, built once per run (`build_eval_set`) and held by the `Bench`."""

    captions: list[dict[str, Any]]      # B=1 prompt inputs, one per test image (val: `bench.measure --eval-split`)
    references: list[str]
    batch8: dict[str, Any]              # a left-padded batch of 8 prompts for decode speed
    text_chunks: list[torch.Tensor]     # held-out (test, or val) Austen token chunks for perplexity
    calibration: list[dict[str, Any]]   # caption + text batches from the val splits (also rank blocks for removal)
    calibration_by_workload: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Val batches by workload: "captions" (the caption batches of `calibration`, with the datamodule's `loss_mask`
    marking the answer tokens) and "text" (raw val text chunked like `text_chunks`, every position an answer
    token). Per-token policies are calibrated on the workload each measurement runs (empty: on `calibration` for
    both)."""
    replacement_calibration: list[tuple[dict[str, Any], torch.Tensor]] = field(default_factory=list)
    """(inputs, real-token mask) batches from the *train* splits that the training-free linear replacement
    baseline is fitted on (empty: that baseline is not measured)."""

    def workloads(self) -> dict[str, list[dict[str, Any]]]:
        """The batches a per-token policy is calibrated on for each workload ("captions", "text"):
        `calibration_by_workload`, else the pooled `calibration` for both."""
        return self.calibration_by_workload or {"captions": self.calibration, "text": self.calibration}

    def per_workload(self, calibrated: Callable[[list[dict[str, Any]]], Any]) -> dict[str, Any]:
        """`calibrated(batches)` for each workload's batches (`workloads`), called once where workloads share them
        (the pooled fallback): the same calibration twice would only repeat its forwards."""
        results: dict[int, Any] = {}
        by_workload = {}
        for workload, batches in self.workloads().items():
            if id(batches) not in results:
                results[id(batches)] = calibrated(batches)
            by_workload[workload] = results[id(batches)]
        return by_workload


def prompt_inputs(processor, images: list) -> dict[str, Any]:
    """Left-padded caption prompts for `images` (one chat each), as model inputs."""
    from .real_vlm import caption_messages

    texts = [processor.apply_chat_template(caption_messages(image), add_generation_prompt=True, tokenize=False)
             for image in images]
    return dict(processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt"))


def _chunks(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:count]


def build_eval_set(processor, manifest: dict[str, Any], args) -> EvalSet:
    """The eval set of `args`' settings: test captions and text, or val with `args.eval_split == "val"`."""
    from vlm_retrofit.batch import model_inputs
    from vlm_retrofit.datamodules import WebDatasetDataModule

    from .data import austen_split, tuxpaint_split
    from .real_vlm import load_image

    tokenizer = getattr(processor, "tokenizer", processor)
    split = getattr(args, "eval_split", "test")
    pairs = tuxpaint_split(split)[: args.caption_samples]
    images = [load_image(path) for path, _ in pairs]
    captions = [prompt_inputs(processor, [image]) for image in images]
    calibration, caption_answers = [], []
    for name in ("captions-val", "austen-val"):
        data = WebDatasetDataModule(processor=args.backbone, val_shards=manifest["shards"][name]["dir"],
                                    train_shards=manifest["shards"][name]["dir"], batch_size=4, num_workers=0,
                                    max_length=384, add_quality_callback=False)
        data.setup("validate")
        batches = [batch for batch, _ in zip(data.val_dataloader(), range(args.calibration_batches))]
        calibration.append([model_inputs(batch) for batch in batches])
        if name == "captions-val":
            caption_answers = [batch["loss_mask"] for batch in batches]
    # Per-token policies are calibrated on each workload as it is measured: the caption val batches for the
    # captions, and for the perplexity raw val text in chunks like the test's. Calibrated on the Austen val
    # *conversations* (chat template, padding) instead, `gate_b3` skipped 4 % of the test text's layer
    # executions at the 10 % target.
    val_text = "\n\n".join(austen_split("val", words=manifest["params"]["words"])) + "\n"
    val_chunks = _chunks(tokenizer, val_text, args.chunk_tokens, 4 * args.calibration_batches)
    text_calibration = [torch.stack(val_chunks[i:i + 4]) for i in range(0, len(val_chunks), 4)]
    text_calibration = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
                        for ids in text_calibration]
    replacement_calibration = []
    for name in ("captions-train", "austen-train"):  # read in order, like the val splits above
        data = WebDatasetDataModule(processor=args.backbone, val_shards=manifest["shards"][name]["dir"],
                                    train_shards=manifest["shards"][name]["dir"], batch_size=4, num_workers=0,
                                    max_length=384, add_quality_callback=False)
        data.setup("validate")
        for batch, _ in zip(data.val_dataloader(), range(args.replacement_batches)):
            inputs = model_inputs(batch)
            replacement_calibration.append((inputs, inputs["attention_mask"].bool()))
    if split == "test":
        text_chunks = _chunks(tokenizer, Path(manifest["austen_test"]["path"]).read_text(), args.chunk_tokens,
                              args.text_chunks)
    else:  # the val text after the chunks the per-token policies calibrate on
        text_chunks = _chunks(tokenizer, val_text, args.chunk_tokens, len(val_chunks) + args.text_chunks)[len(val_chunks):]

    def to(inputs: dict[str, Any]) -> dict[str, Any]:
        return on_device(inputs, args.device)

    caption_batches = len(calibration[0])
    calibration = [to(b) for batches in calibration for b in batches]
    return EvalSet(captions=[to(c) for c in captions], references=[caption for _, caption in pairs],
                   batch8=to(prompt_inputs(processor, (images * 8)[:8])),
                   text_chunks=[c.to(args.device) for c in text_chunks],
                   calibration=calibration,
                   calibration_by_workload={"captions": [{**b, "loss_mask": m.to(args.device)} for b, m in
                                                         zip(calibration[:caption_batches], caption_answers)],
                                            "text": [to(b) for b in text_calibration]},
                   replacement_calibration=[(to(b), m.to(args.device)) for b, m in replacement_calibration])
