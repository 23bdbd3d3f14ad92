"""Healing step time on the real VLM: this code's training step vs an earlier path (autograd KL, PEFT casts).

    python -m bench.step_speed                 # the shipped recipe (configs/smollm2-tuxpaint-long.yaml), 12 batches
    python -m bench.step_speed --batches 20 --config configs/smollm2-tuxpaint.yaml
    python -m bench.step_speed --against kl-chunks-8m     # the chunked KL with its former 8 M-element chunks
    python -m bench.step_speed --against peft-disable-adapter   # the teacher's LoRA off by PEFT's own context
    python -m bench.step_speed --against full-logits   # the LM head at every position (select_logits off)
    python -m bench.step_speed --against peft-lora-forward   # PEFT's LoRA forward, not one addmm per projection
    python -m bench.step_speed --against whole-student \
        --lora-target '.*language_model.*layers\.(19|2[0-9])\..*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)'

The same training batches run through `RetrofitModule.compute_loss` + backward under bf16 autocast, alternating
batch by batch between the two paths (the machine's drift hits both), and the loss of each pair is compared: the
paths compute the same thing. `--against` picks the earlier path: `reference` (autograd through log_softmax +
kl_div, PEFT's LoRA forward with its fp32 casts of LoRA inputs), `kl-chunks-8m` (the chunked KL in chunks of 8 M
positions x vocabulary), `whole-student` (no layer taken from the teacher's forward: `share_teacher_prefix` off;
only differs with a LoRA above the removal, `--lora-target`), `peft-disable-adapter` (PEFT's `disable_adapter()` for
the teacher, which walks every module: host time, whatever the width), `full-logits` (`select_logits` off: the LM
head at every position, the KL's positions indexed out of its logits) or `peft-lora-forward` (PEFT's own LoRA
forward: the update formed, scaled and added as three ops after its matmul). Prints the seconds per step of each and
their ratio. Needs the bench build.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import statistics
import time
from typing import Iterator

import torch
import yaml

import vlm_retrofit.training.losses as losses
import vlm_retrofit.training.module as module_code
from datamodules import WebDatasetDataModule
from vlm_retrofit.training import RetrofitModule

from .kl_speed import reference_kl


@contextlib.contextmanager
def _replaced(owner: object, **values: object) -> Iterator[None]:
    """`owner`'s attributes set to `values` within the context, then their own values back."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def reference_path(module: RetrofitModule) -> Iterator[None]:
    """The step as it ran before the chunked KL and this code's LoRA layers (PEFT's forward, with its casts)."""
    with _replaced(module_code, distillation_kl=reference_kl), _replaced(module, _lora_layers=[]):
        yield


def kl_chunks_8m(module: RetrofitModule) -> contextlib.AbstractContextManager:
    """The chunked KL in the 8 M-element chunks it had before."""
    return _replaced(losses, KL_CHUNK_ELEMENTS=1 << 23)


def whole_student(module: RetrofitModule) -> contextlib.AbstractContextManager:
    """The student running every layer it keeps (`share_teacher_prefix` off)."""
    return _replaced(module.hparams, share_teacher_prefix=False)


def peft_disable_adapter(module: RetrofitModule) -> contextlib.AbstractContextManager:
    """The teacher's LoRA turned off by PEFT's own `disable_adapter()`, which walks every module of the backbone."""
    return _replaced(module_code, adapters_disabled=lambda model, switches: model.disable_adapter())


def full_logits(module: RetrofitModule) -> contextlib.AbstractContextManager:
    """The LM head at every position, the KL's positions indexed out of its logits (`select_logits` off)."""
    return _replaced(module.hparams, select_logits=False)


def peft_lora_forward(module: RetrofitModule) -> contextlib.AbstractContextManager:
    """PEFT's own LoRA forward (no `lora_addmm`)."""
    return _replaced(module_code, lora_addmm=lambda layers: contextlib.nullcontext())


EARLIER_PATHS = {"reference": reference_path, "kl-chunks-8m": kl_chunks_8m, "whole-student": whole_student,
                 "peft-disable-adapter": peft_disable_adapter, "full-logits": full_logits,
                 "peft-lora-forward": peft_lora_forward}


def timed_step(module: RetrofitModule, batch, seed: int) -> tuple[float, float]:
    """Seconds of one loss + backward under bf16 autocast, and the loss."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module.compute_loss(batch, drop_rate=0.0, seed=seed)
    out.loss.backward()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(out.loss.detach())


def main(argv: list[str] | None = None) -> int:
    """Time both paths on the same batches; refuse if their losses disagree."""
    parser = argparse.ArgumentParser(prog="python -m bench.step_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-tuxpaint-long.yaml")
    parser.add_argument("--batches", type=int, default=12, help="timed batches, each run by both paths")
    parser.add_argument("--against", default="reference", choices=sorted(EARLIER_PATHS),
                        help="the earlier path this code's step is timed against")
    parser.add_argument("--lora-target", default=None, help="replace the config's LoRA target_modules (a regex)")
    args = parser.parse_args(argv)
    config = yaml.safe_load(open(args.config))
    if args.lora_target:
        config["model"]["lora"] = {**config["model"]["lora"], "target_modules": args.lora_target}
    earlier_path = EARLIER_PATHS[args.against]
    model_class = config["model"].get("model_class") or ""
    if "." in model_class:  # a registered custom class: importing its module registers it
        importlib.import_module(model_class.rsplit(".", 1)[0])
    module = RetrofitModule(**config["model"])
    data = dict(config["data"]["init_args"], num_workers=0)
    datamodule = WebDatasetDataModule(processor=config["model"]["backbone"], **data)
    datamodule.setup("fit")
    batches = list(itertools.islice(datamodule.train_dataloader(), args.batches + 1))
    timed_step(module, batches[0], 0)  # warm-up
    with earlier_path(module):
        timed_step(module, batches[0], 0)
    seconds: dict[str, list[float]] = {args.against: [], "this code": []}
    for index, batch in enumerate(batches[1:], start=1):
        with earlier_path(module):
            reference, reference_loss = timed_step(module, batch, index)
        current, loss = timed_step(module, batch, index)
        if abs(loss - reference_loss) > 1e-3 * max(1.0, abs(reference_loss)):
            raise SystemExit(f"bench.step_speed: the two paths disagree on batch {index}: {loss} vs {reference_loss}")
        seconds[args.against].append(reference)
        seconds["this code"].append(current)
    total = {k: sum(v) for k, v in seconds.items()}
    shared = module.shared_prefix_layers(module.adapter.layout.layers_of_blocks(module.removed_blocks(0, largest=True)))
    print(f"{args.config}: {args.batches} batches of {data['batch_size']}, bf16 autocast, {torch.get_num_threads()} "
          f"threads, {shared} layers taken from the teacher")
    for name, values in seconds.items():
        print(f"  {name:>13}: {total[name] / len(values):.3f} s/step (median {statistics.median(values):.3f})")
    print(f"  ratio this code / {args.against}: {total['this code'] / total[args.against]:.3f} (total time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
