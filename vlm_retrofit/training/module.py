"""RetrofitModule: distil a frozen backbone into itself through depth routers, under simulated block skipping."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from ..batch import META_KEYS
from ..files import write_adapter_folder
from ..skipping import SkipSimulation
from ..skipping.calibrate import scored_positions
from ..skipping.runtime import resolve_budget
from ..routing import RouterConfig, attach_routers
from ..routing.stand_in import fit_stand_ins as least_squares_stand_ins
from ..backbones.loading import load_backbone, recorded_name
from ..backbones.registry import lora_layers
from ..errors import InputError
from ..pruning import layers_removed
from ..layer_replacement import fit_layer_replacements, forwards_substituted, substitutes
from ..replacement import fit_replacements, is_layer_replacement, output_projection, replacements_applied
from .checkpoint import (CHECKPOINT_KEY, check_checkpoint, check_optimizer_settings, checkpoint_metadata,
                         resumed_removal_range)
from .losses import (PENALTIES, compute_penalty, distillation_kl, drop_rate_at, hidden_state_distillation,
                     routing_entropies)
from .optim import SCHEDULES, base_lr, build_optimizer, lr_lambda
from .peft_layers import (adapter_switches, adapters_disabled, autocast_lora_inputs, copies_trained_in_fp32,
                          lora_addmm, unmatched_lora_targets)
from .prefix import first_adapted_layer, head_rows_selected, layer_input_captured, layer_input_replaced

log = logging.getLogger("vlm_retrofit.training")

def _router_config(router: RouterConfig | Mapping[str, Any] | None) -> RouterConfig:
    if router is None:
        return RouterConfig()
    if isinstance(router, RouterConfig):
        return dataclasses.replace(router)  # a copy: the default instance is shared between calls
    if isinstance(router, Mapping):
        return RouterConfig.from_dict(dict(router))
    # jsonargparse may hand over a Namespace for a dataclass-typed argument
    if hasattr(router, "as_dict"):
        return RouterConfig.from_dict(router.as_dict())
    raise TypeError(f"router must be a RouterConfig or a dict of its fields, got {type(router).__name__}")


@dataclass
class StepOutput:
    """Everything one distillation forward produced (loss and what is logged)."""

    loss: Tensor
    kl: Tensor
    penalty: Tensor
    expected_compute: Tensor
    realised_compute: float
    expected_keep: dict[int, float] = field(default_factory=dict)
    realised_keep: dict[int, float] = field(default_factory=dict)
    entropy: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    batch_size: int = 0
    hidden: Tensor | None = None
    """The hidden-state error (unweighted) when `hidden_weight` is on, else None."""
    keeps_sampled: bool = True
    """Whether the keep ratios come from simulated skipping; else they are the removal schedule's blocks (0 / 1),
    which the mean keep ratio already tells."""


class RetrofitModule(pl.LightningModule):
    """Depth routers retrofitted into a frozen VLM language backbone, trained by self-distillation.

    The student is the backbone with routers (and optionally LoRA) under simulated per-token block skipping;
    the teacher is the same weights with routers, LoRA and skipping disabled, run under `torch.no_grad()`
    (one copy of the weights). Loss = T^2 * KL(teacher || student) on the datamodule's `loss_mask` positions
    + a penalty pulling the expected executed fraction of decoder-block compute toward `compute_target`.
    Only trainable parameters (routers, gates, LoRA) are optimised and checkpointed.
    """

    def __init__(
        self,
        backbone: str = "tiny:qwen2_vl",
        router: RouterConfig = RouterConfig(),  # noqa: B008 - read-only default, shown in --help
        lora: dict[str, Any] | None = None,
        train_routers: bool = True,
        trust_remote_code: bool = False,
        torch_dtype: str | None = None,
        attn_implementation: str | None = None,
        model_class: str | None = None,
        backbone_kwargs: dict[str, Any] | None = None,
        temperature: float = 1.0,
        hidden_weight: float = 0.0,
        replace_removed: bool = False,
        replacement_batches: int = 16,
        replacement_ridge: float = 0.1,
        replacement: Literal["linear", "layer"] = "linear",
        replacement_epochs: int = 4,
        replacement_lr: float = 2e-3,
        replacement_inputs: Literal["replaced", "full"] = "replaced",
        distill_positions: Literal["response", "text"] = "response",
        max_drop_rate: float = 0.25,
        drop_warmup_steps: int = 20,
        use_gates: bool = True,
        skip_budget: float | None = None,
        skip_candidates: int | list[int] | None = None,
        skip_image_positions: bool = True,
        removal_order: list[int] | Literal["impact", "joint", "span"] | None = None,
        max_removed_blocks: int = 0,
        min_removed_blocks: int = 0,
        removal_count_weights: list[float] | None = None,
        compute_target: float | None = None,
        compute_weight: float = 10.0,
        compute_penalty: Literal["hinge", "squared"] = "squared",
        compute_counted_on: Literal["text", "response"] = "response",
        dense_step_fraction: float = 0.0,
        stand_in_batches: int = 16,
        stand_in_ridge: float = 1e-2,
        stand_in_lr_scale: float = 0.1,
        optimizer: str = "AdamW",
        lr: float = 1e-2,
        query_lr_scale: float = 1.0,
        lora_b_lr_scale: float = 1.0,
        weight_decay: float = 0.0,
        optimizer_kwargs: dict[str, Any] | None = None,
        scheduler: Literal["cosine", "linear", "constant"] = "cosine",
        warmup_steps: int = 5,
        min_lr_ratio: float = 0.1,
        total_steps: int | None = None,
        max_nonfinite_steps: int = 5,
        seed: int = 0,
        select_logits: bool = True,
        log_per_block: bool = True,
        share_teacher_prefix: bool = True,
    ) -> None:
        """
        Args:
            backbone: HF hub id or local folder of the VLM (loaded with `from_pretrained`), or `tiny:<family>`
                for an offline tiny model (`vlm_retrofit.testing.FAMILIES`). Real ids need the weights on disk
                or a hub download. A pruned release folder (`merge --prune-target`) is a backbone too: routers
                are trained on top of the pruned model.
            router: depth-router settings (`vlm_retrofit.RouterConfig`: block_size, skippable / never-skip
                blocks, skip_gate, ...). Default: per-layer routing, first and last block never skipped.
            lora: optional `peft.LoraConfig` fields (e.g. `{r: 8, lora_alpha: 16, target_modules: [q_proj,
                v_proj]}`) for LoRA "healing" trained alongside the routers; null = routers only.
            train_routers: false = the routers (and gates) stay at identity, frozen, and the student is the backbone
                with the removal schedule's blocks deleted: plain layer removal healed by the LoRA alone, which is
                what `merge --prune-target` ships. The student does no routing; needs `lora`, a removal
                schedule and `max_drop_rate: 0` (per-token skipping needs routers).
            trust_remote_code: allow the backbone's own modelling code from the hub (off unless set explicitly).
            torch_dtype: dtype of the frozen weights: float32, bfloat16, float16, auto (checkpoint's) or null
                (library default). Routers always keep fp32 parameters.
            attn_implementation: attention kernel passed to `from_pretrained` (eager, sdpa, flash_attention_2).
            model_class: transformers class name or dotted path to load the backbone with (default:
                AutoModelForImageTextToText, then AutoModelForCausalLM).
            backbone_kwargs: extra `from_pretrained` keywords (e.g. revision); for `tiny:` backbones text-config
                overrides such as `num_hidden_layers`.
            temperature: distillation temperature T (the KL is scaled by T^2).
            hidden_weight: weight of a second distillation term on the residual stream (removal healing only,
                `train_routers: false`): the per-token relative squared error between the student's and the
                teacher's hidden state after every kept layer from the first removed one on, at the KL's positions
                (`hidden_state_distillation`): a dense target for every layer that the logits reach only through
                the layers above it. 0 = logits only.
            replace_removed: before training, fit a replacement of the removed layers (`replacement`) on the
                first `replacement_batches` training batches, toward the full model's stream after each removed
                span, and keep it in the student while the LoRA heals: a better starting point at no inference
                cost, since a pruned release folds it into the weights of the layer in front of the span. Needs
                `train_routers: false` and one removal set (`min_removed_blocks == max_removed_blocks`); saved
                with the adapter (`replacement.safetensors`) and in checkpoints.
            replacement_batches: training batches the replacement is fitted on (their KL positions; a `layer`
                replacement fits on every real token).
            replacement_ridge: ridge term of the linear fit, pulling it toward plain removal (relative to the mean
                diagonal of the normal equations; `fit_replacements`).
            replacement: what `replace_removed` fits. `linear`: the least-squares map above, training-free.
                `layer`: the layer in front of each removed span retrained to write what the span wrote as well
                (`vlm_retrofit.layer_replacement`: the full model's stream after the span as its target, one
                layer's forward and backward per step on states captured once), then frozen while the LoRA heals
                the rest. The release ships that layer's new weights: an ordinary model of the family, with the
                compute of removing the span (its LoRA on that layer is not used).
            replacement_epochs: passes of a `layer` replacement's fit over its captured batches.
            replacement_lr: peak AdamW rate of that fit (cosine to zero).
            replacement_inputs: what a `layer` replacement of a later removed span is fitted from. `replaced`: the
                stream of the model with the earlier spans already removed and replaced, as the student runs it
                (one more forward over the batches per span). `full`: the full model's stream, captured in the
                same forward as every target (one forward for any number of spans: minutes less on a CPU; the
                LoRA then heals what the earlier replacements leave). The same for a removal of one span.
            distill_positions: where the KL is taken: `response` = the datamodule's `loss_mask` (the answer
                tokens); `text` = every real, non-image position (prompts too: many more positions per batch
                for short answers such as captions).
            max_drop_rate: per-token probability of skipping each skippable block, reached after the ramp.
            drop_warmup_steps: optimizer steps of the linear drop-rate ramp from 0 to `max_drop_rate`.
            use_gates: sample run/skip from the learned gates (straight-through) when the router config has
                `skip_gate: true`.
            skip_budget: per-token cap on skipped blocks in simulation (an int count or a fraction of the
                skippable blocks); the removal schedule's blocks count against it, as a static policy's do at
                inference; null = no cap.
            skip_candidates: the only blocks simulated per-token skipping (drop rate, gates) samples: a count = the
                first blocks of `removal_order` when there is one, else the cheapest by single-block removal
                impact on the first training batch; or a list of blocks; null = every skippable block.
                Saved with the adapter, and `calibrate` restricts per-token policies to them by default: spread
                over every layer, per-token skipping also hits layers whose removal alone is catastrophic.
            skip_image_positions: false = visual placeholders run every block in simulated per-token skipping, as
                under a policy calibrated with `skip_image_positions=False` (saved with the adapter, and `calibrate`
                then keeps them by default). A batch-1 prefill saves a block only where every prompt token skips
                it, so skipping image positions saves almost nothing while every answer token reads them.
            removal_order: skippable blocks in the order a static policy will remove them (cheapest first), for
                the removal schedule; `impact` ranks them by single-block removal KL on the first training
                batch; `joint` takes the first `max_removed_blocks` by greedy joint removal on that batch (each
                pick the cheapest given the earlier ones: ~max_removed_blocks x blocks forwards, once), then the
                rest by impact; `span` takes the run of `max_removed_blocks` adjacent blocks whose removal together
                costs the least on that batch (one forward per run; it reaches blocks that are costly alone but
                cheap together, which `joint` never picks), then the rest by impact. Saved with the adapter:
                `calibrate(..., "static")` then removes a prefix of it.
            max_removed_blocks: removal schedule: each step, every token skips the first k blocks of
                `removal_order`, k drawn uniformly from 0..max_removed_blocks (validation uses the maximum),
                so the routers learn to re-weight around blocks that a static policy removes for good.
                0 = off.
            min_removed_blocks: smallest k the removal schedule draws (k uniform in min..max). Equal to
                `max_removed_blocks` trains one operating point only (e.g. the 6 blocks a 20 % static target
                removes), which heals that point better than spreading the budget over every prefix.
            removal_count_weights: relative weights (> 0) of the counts min_removed_blocks..max_removed_blocks
                (one per count, in that order) the removal schedule draws k from; null = uniform. E.g. `[1, 1, 1,
                6, 1, 1, 1]` over 3..9 draws 6 removed blocks on half the steps and shares the rest among the
                other counts: one adapter for every count, with more of the steps on one operating point.
            compute_target: target expected executed fraction of decoder-block compute (e.g. 0.8; a token
                skipping a layer still writes its K/V at decode and runs its stand-in, if any: those count as
                their share of the layer's FLOPs, ~6 % for SmolLM2's K/V); null = no compute penalty.
            compute_weight: weight of the compute penalty.
            compute_penalty: `squared` = weight * (expected - target)^2 (holds compute at the target);
                `hinge` = weight * relu(expected - target) (only penalises running more than the target).
            compute_counted_on: the positions whose compute `compute_target` counts: `text` = every real,
                non-image position, prompts too; `response` = the datamodule's `loss_mask` (the answer tokens,
                what a decode step runs). Counted on text, a caption batch's chat template and prompt hold most of
                the positions, and gates meet the target by skipping there: on the benchmark's VLM, gates
                calibrated to 20 % of the text positions skipped 4 % of the answer positions' layer executions.
                Saved with the adapter; `calibrate` counts there too by default. A batch marking no answer
                tokens counts every position. (Runs before 2026-12-06 counted on text.)
            dense_step_fraction: fraction of training steps (drawn per step from `seed`) whose student runs every
                block: no simulated skipping, no removal, no compute penalty; its KL pulls the routers and the
                LoRA toward the base with skipping off, which training under skips alone lets drift (logged as
                `train/kl_dense`, not `train/kl`). Needs `train_routers`. 0 = every step skips.
            stand_in_batches: training batches the stand-ins of skipped layers (`RouterConfig.skip_stand_in`) are
                fitted on by least squares when training starts, on the full model's stream (not refitted where they
                hold a fit already: a resumed run, an adapter to start from).
            stand_in_ridge: ridge of that fit, as a fraction of the mean diagonal of its normal equations.
            stand_in_lr_scale: learning-rate multiplier of the stand-ins after their fit (never weight-decayed);
                0 keeps them at the fit.
            optimizer: `torch.optim` class name (or dotted path) used on the trainable parameters only.
            lr: peak learning rate.
            query_lr_scale: learning-rate multiplier of the router and gate pseudo-queries. An Adam step moves
                every coordinate of a d-dimensional query by ~lr, so a routing logit moves by up to ~lr * d per
                step against lr for a bias; 1/sqrt(d) or less keeps large backbones' routers from swinging away
                from identity in the first steps.
            lora_b_lr_scale: learning-rate multiplier of the LoRA B matrices (the up-projections, zero at init)
                against the A matrices, as LoRA+ proposes: with one rate for both, the update of a wide layer is led
                by A and learns slowly. 4 healed SmolLM2's 20 % removal best (8 was worse; bench/HISTORY.md).
            weight_decay: decoupled weight decay on router queries / gate queries / LoRA matrices (norm gains
                and biases are never decayed).
            optimizer_kwargs: further optimizer keywords (e.g. `{betas: [0.9, 0.95]}`).
            scheduler: learning-rate shape after warmup: cosine, linear (both decay to `min_lr_ratio` * lr at
                `total_steps`) or constant.
            warmup_steps: linear learning-rate warmup in optimizer steps.
            min_lr_ratio: final learning rate as a fraction of `lr`.
            total_steps: length of the decay; null = the trainer's estimate (`max_steps`), constant if unknown.
            max_nonfinite_steps: a step with a non-finite loss is skipped (warned and counted); after this many
                in a row training stops with an error message.
            seed: seed of the skip sampling; the masks of a step depend only on (seed, step, rank), so a resumed
                run draws exactly what an uninterrupted one would.
            select_logits: run the LM head only at the positions the KL reads (saves time and memory with large
                vocabularies: no logits for padding, image placeholders or prompts); off = full logits.
            log_per_block: also log keep ratios per block (where skipping is simulated; under a removal schedule
                alone they are its blocks, which the mean keep ratio tells) and routing entropy per router.
            share_teacher_prefix: in LoRA healing (`train_routers: false`), the student does not rerun the layers
                below both the first removed layer and the first layer holding a LoRA (or any trainable
                parameter): it takes their output from the teacher's forward, which ran the same weights on the
                same inputs (the same loss and gradients; with the LoRA on the layers above a removal only, the
                student runs those alone). Checked on the first step it applies to against the student run whole,
                and turned off with a warning where the two disagree (a family whose decoder acts by layer
                position). Not with `hidden_weight` (it compares every kept layer's output).
        """
        super().__init__()
        router_cfg = _router_config(router)
        if compute_penalty not in PENALTIES:
            raise InputError(f"compute_penalty must be one of {PENALTIES}, got {compute_penalty!r}")
        if scheduler not in SCHEDULES:
            raise InputError(f"scheduler must be one of {SCHEDULES}, got {scheduler!r}")
        if not 0.0 <= max_drop_rate < 1.0:
            raise InputError(f"max_drop_rate must be in [0, 1), got {max_drop_rate}")
        if distill_positions not in ("response", "text"):
            raise InputError(f"distill_positions must be 'response' or 'text', got {distill_positions!r}")
        if max_removed_blocks < 0:
            raise InputError(f"max_removed_blocks must be >= 0, got {max_removed_blocks}")
        if not 0 <= min_removed_blocks <= max_removed_blocks:
            raise InputError(f"min_removed_blocks must be in 0..max_removed_blocks={max_removed_blocks}, "
                             f"got {min_removed_blocks}")
        if removal_count_weights is not None:
            counts = max_removed_blocks - min_removed_blocks + 1
            weights = [float(w) for w in removal_count_weights]
            # > 0: every count in min..max is recorded as trained (a release of it is accepted), so each is drawn.
            if len(weights) != counts or any(not math.isfinite(w) or w <= 0 for w in weights):
                raise InputError(f"removal_count_weights must give {counts} finite weights > 0, one per count "
                                 f"{min_removed_blocks}..{max_removed_blocks} (narrow the range to leave a count "
                                 f"out); got {removal_count_weights!r}")
        if max_removed_blocks and removal_order is None:
            raise InputError("max_removed_blocks needs a removal_order (a list of blocks, or 'impact')")
        if isinstance(removal_order, str) and removal_order not in ("impact", "joint", "span"):
            raise InputError("removal_order must be a list of block indices, 'impact', 'joint' or 'span', got "
                             f"{removal_order!r}")
        if removal_order in ("joint", "span") and not max_removed_blocks:
            raise InputError(f"removal_order: {removal_order} picks max_removed_blocks blocks; set max_removed_blocks >= 1")
        if not train_routers and not (lora and max_removed_blocks >= 1 and max_drop_rate == 0):
            raise InputError("train_routers: false trains a LoRA to heal removed blocks: it needs lora, "
                             f"max_removed_blocks >= 1 and max_drop_rate: 0 (got lora={'set' if lora else None}, "
                             f"max_removed_blocks={max_removed_blocks}, max_drop_rate={max_drop_rate})")
        if not temperature > 0:
            raise InputError(f"temperature must be > 0, got {temperature}")
        if hidden_weight < 0:
            raise InputError(f"hidden_weight must be >= 0, got {hidden_weight}")
        if not 0.0 <= dense_step_fraction < 1.0:
            raise InputError(f"dense_step_fraction must be in [0, 1), got {dense_step_fraction}")
        if stand_in_batches < 1 or not stand_in_ridge > 0 or stand_in_lr_scale < 0:
            raise InputError(f"stand-ins need stand_in_batches >= 1, stand_in_ridge > 0 and stand_in_lr_scale >= 0 "
                             f"(got {stand_in_batches}, {stand_in_ridge}, {stand_in_lr_scale})")
        if dense_step_fraction and not train_routers:
            raise InputError("dense_step_fraction trains the routed model with skipping off; with train_routers: "
                             "false the student run whole is the teacher (set dense_step_fraction: 0)")
        if hidden_weight and train_routers:
            raise InputError("hidden_weight matches the hidden states of a student with layers removed to the "
                             "teacher's: it needs train_routers: false (LoRA healing of removed blocks)")
        if replace_removed and (train_routers or min_removed_blocks != max_removed_blocks):
            raise InputError("replace_removed fits a replacement for one set of removed layers: it needs "
                             "train_routers: false and min_removed_blocks == max_removed_blocks (got train_routers="
                             f"{train_routers}, min_removed_blocks={min_removed_blocks}, max_removed_blocks="
                             f"{max_removed_blocks})")
        if replace_removed and replacement_batches < 1:
            raise InputError(f"replacement_batches must be >= 1, got {replacement_batches}")
        if replace_removed and replacement == "layer" and hidden_weight:
            raise InputError("hidden_weight compares hidden states layer by layer, which a layer replacement's "
                             "substitute does not report: use one or the other")
        if replacement not in ("linear", "layer"):
            raise InputError(f"replacement must be 'linear' or 'layer', got {replacement!r}")
        if replacement_inputs not in ("replaced", "full"):
            raise InputError(f"replacement_inputs must be 'replaced' or 'full', got {replacement_inputs!r}")
        if replacement == "layer" and (replacement_epochs < 1 or not replacement_lr > 0):
            raise InputError(f"a layer replacement needs replacement_epochs >= 1 and replacement_lr > 0, got "
                             f"{replacement_epochs} and {replacement_lr}")
        if isinstance(skip_candidates, bool) or (isinstance(skip_candidates, int) and skip_candidates < 1):
            raise InputError(f"skip_candidates must be a count >= 1 or a list of blocks, got {skip_candidates!r}")
        if max_nonfinite_steps < 1:
            raise InputError(f"max_nonfinite_steps must be >= 1, got {max_nonfinite_steps}")
        if compute_counted_on not in ("text", "response"):
            raise InputError(f"compute_counted_on must be 'text' or 'response', got {compute_counted_on!r}")
        if compute_target is not None and not 0 < compute_target <= 1:
            raise InputError(f"compute_target is the fraction of decoder-block compute to execute, in (0, 1]; got "
                             f"{compute_target}")
        gated = bool(use_gates and router_cfg.skip_gate)
        if compute_target is not None and not (train_routers and gated):
            raise InputError("compute_target pulls the learned skip gates toward that compute: it needs "
                             "router.skip_gate: true, use_gates: true and trained routers (got skip_gate="
                             f"{router_cfg.skip_gate}, use_gates={use_gates}, train_routers={train_routers}); set "
                             "compute_target: null otherwise (the penalty would be a constant)")
        if train_routers and router_cfg.skip_gate and not use_gates:
            rank_zero_warn("router.skip_gate: true with use_gates: false: the skip gates are attached but never "
                           "sampled, so they stay untrained and the gate policy will not skip on this adapter; set "
                           "skip_gate: false, or use_gates: true to train them")
        if train_routers and not (gated or max_drop_rate > 0 or max_removed_blocks):
            raise InputError("nothing makes the routers learn: at identity the student is the teacher, so the KL and "
                             "its gradient are zero (what training then moves is rounding noise). Give skip pressure: "
                             "max_drop_rate > 0, learned skip gates (router.skip_gate and use_gates) with a "
                             "compute_target, or a removal schedule (max_removed_blocks)")
        self.save_hyperparameters(ignore=["router"])
        self.hparams["router"] = router_cfg.to_dict()  # plain data: YAML- and pickle-friendly

        model, processor = load_backbone(backbone, trust_remote_code=trust_remote_code, torch_dtype=torch_dtype,
                                         attn_implementation=attn_implementation, model_class=model_class,
                                         kwargs=backbone_kwargs)
        model.requires_grad_(False)
        if lora:
            from peft import LoraConfig, get_peft_model

            missing = unmatched_lora_targets(model, dict(lora).get("target_modules"))
            if missing:
                raise InputError(f"lora.target_modules names {missing}, which no module of this backbone "
                                 f"({model.config.model_type}) is called: the LoRA would leave them out silently. "
                                 "Correct or drop them (a mixture of experts keeps its experts' projections as "
                                 "parameters, not modules: PEFT's target_parameters reaches those)")
            model = get_peft_model(model, LoraConfig(**dict(lora)))
            model.eval()  # new LoRA layers start in train mode; the whole backbone runs in eval mode
        self.model = model
        self._lora_layers = lora_layers(model)
        self._adapter_switches = adapter_switches(model)
        copies_trained_in_fp32(self._adapter_switches)  # `modules_to_save` copies of a bf16 backbone train in fp32
        self.processor = processor
        self.adapter = attach_routers(model, router_cfg)
        layout = self.adapter.layout
        if not layout.skippable_blocks:
            raise InputError(f"no block may skip: router.block_size {router_cfg.block_size} on {layout.num_layers} "
                             f"layers makes blocks {list(layout.block_starts)}, all never-skip "
                             f"({list(layout.never_skip_blocks)}: the first, the last and any feature-injecting block). "
                             "Use a smaller block_size")
        if compute_target is not None:
            # Blocks that never skip (and, for a candidate list, the blocks outside it) always run: below their
            # share the penalty can never be met, and it drives every gate shut.
            always = set(layout.never_skip_blocks)
            if isinstance(skip_candidates, (list, tuple)):
                always |= set(layout.skippable_blocks) - {int(b) for b in skip_candidates}
            floor = len(layout.layers_of_blocks(sorted(always))) / layout.num_layers
            if compute_target < floor - 1e-9:
                raise InputError(f"compute_target {compute_target} is below what always runs: {floor:.3f} of the "
                                 f"decoder layers (blocks {sorted(always)} never skip). Set compute_target >= "
                                 f"{floor:.3f}, or allow more blocks to skip (block_size, never_skip_blocks, "
                                 "skip_candidates)")
        if not train_routers:
            self.adapter.requires_grad_(False)  # identity routing, neither trained nor checkpointed
        self.replacements: dict[int, Any] | None = None
        """Replacement of the removed layers (`replace_removed`), keyed by the layer that carries it: a linear map
        [d, d] each, or a layer replacement's state dict each."""
        self.replacement_fit_seconds: float | None = None
        """Wall clock of this run's replacement fit (None: none fitted in this process)."""
        self._substitutes: tuple[dict[int, Any], dict[int, nn.Module]] | None = None
        """Modules running the layer replacements in the student, with the replacements they were made from."""
        if replace_removed and replacement == "linear":  # a family that cannot fold one is refused before any work
            output_projection(self.adapter.spec, self.adapter.spec.get_layers(model)[0])
        self.adapter.base_model = {"name": recorded_name(backbone), "kwargs": dict(backbone_kwargs or {}), "torch_dtype": torch_dtype,
                                   "attn_implementation": attn_implementation, "model_class": model_class,
                                   "trust_remote_code": trust_remote_code}
        if removal_order is not None and not isinstance(removal_order, str):
            self._set_removal_order(list(removal_order))
        if skip_candidates is not None and not isinstance(skip_candidates, int):
            self._set_skip_candidates(skip_candidates)  # a list is checked now, before any work
        self.adapter.skip_image_positions = bool(skip_image_positions)
        # Recorded where there was a compute target to count: calibration then counts its target there by default.
        self.adapter.compute_counted_on = compute_counted_on if compute_target is not None else "text"
        if max_removed_blocks > len(layout.skippable_blocks):  # a ranked order is only known at the first batch
            raise InputError(f"max_removed_blocks={max_removed_blocks}: only {len(layout.skippable_blocks)} blocks may "
                             f"be removed ({list(layout.skippable_blocks)}; the others never skip)")
        if max_removed_blocks:  # what the schedule removes, so a release of another removal can be refused
            self.adapter.removal_range = (int(min_removed_blocks), int(max_removed_blocks))
            budget = resolve_budget(skip_budget, len(self.adapter.layout.skippable_blocks))
            if budget is not None and budget < max_removed_blocks:  # the removed blocks count against it
                raise InputError(f"skip_budget={skip_budget} lets a token skip {budget} blocks, fewer than the "
                                 f"max_removed_blocks={max_removed_blocks} every token skips: raise skip_budget or "
                                 "lower max_removed_blocks")
        self.strict_loading = False  # checkpoints hold trainable state only; on_load_checkpoint checks it all
        self.nonfinite_steps = 0
        self.nonfinite_streak = 0
        self.stop_reason: str | None = None
        self._first_adapted_layer: int | None = None
        self._prefix_verified: bool | None = None  # share_teacher_prefix: None until checked on a step

    # ------------------------------------------------------------------ structure
    @property
    def router_config(self) -> RouterConfig:
        return self.adapter.config

    def train(self, mode: bool = True) -> "RetrofitModule":
        """Switch the routers' mode; the frozen backbone always stays in eval mode (no dropout), because the
        student and the teacher must compute the same function apart from routing and skipping."""
        super().train(mode)
        self.model.eval()
        return self

    def trainable_keys(self) -> set[str]:
        """State-dict keys of the parameters that are trained and checkpointed."""
        return {name for name, param in self.named_parameters() if param.requires_grad}

    def trainable_state_dict(self) -> dict[str, Tensor]:
        keys = self.trainable_keys()
        return {k: v for k, v in self.state_dict().items() if k in keys}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load a (trainable-only) state dict: frozen backbone keys may be absent, since the backbone comes
        from `backbone`. With `strict`, every trainable key must be present and no unknown key may appear."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trainable = self.trainable_keys()
        missing = [k for k in result.missing_keys if k in trainable]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"state dict does not match the trainable parameters: missing {missing}, "
                               f"unexpected {list(result.unexpected_keys)}")
        return type(result)(missing, list(result.unexpected_keys))

    @contextlib.contextmanager
    def teacher(self) -> Iterator[None]:
        """The distillation teacher: routers, LoRA and skipping off, no autograd graph (not inference mode)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.adapter.disabled())
            if self.hparams.lora:
                stack.enter_context(adapters_disabled(self.model, self._adapter_switches))
            yield

    def save_adapter(self, directory: str | Path) -> Path:
        """Write the routers as `adapter_config.json` + `adapter_model.safetensors` (LoRA under `lora/`, a
        replacement of the removed layers as `replacement.safetensors`). The folder is replaced whole: a
        LoRA or replacement an earlier run left there does not survive to be merged with these routers."""
        replacement = (self.replacements, self.replacement_layers()) if self.replacements is not None else None
        return write_adapter_folder(Path(directory), self.adapter, self.model if self.hparams.lora else None,
                                    replacement)

    def replacement_layers(self) -> list[int]:
        """The decoder layers the removal schedule removes at its largest k (what a replacement is fitted for)."""
        return self.adapter.layout.layers_of_blocks(self.removed_blocks(0, largest=True))

    def on_fit_start(self) -> None:
        if self.hparams.replace_removed and self.replacements is None:  # a resumed run keeps its checkpoint's
            self.fit_replacement()
        stand_ins = self.adapter.stand_ins.values()
        if stand_ins and not any(stand_in.fitted for stand_in in stand_ins):
            self.fit_stand_ins()  # a resumed run's checkpoint or a given adapter holds its fit already

    def _first_training_batches(self, count: int, purpose: str) -> list[Mapping[str, Any]]:
        """The first `count` batches of the datamodule's training data, on this module's device."""
        datamodule = self.trainer.datamodule
        if datamodule is None:
            raise RuntimeError(f"{purpose} fits on the training data: fit with a datamodule")
        loader = datamodule.train_dataloader()
        batches = [self.transfer_batch_to_device(batch, self.device, 0) for batch in itertools.islice(loader, count)]
        if not batches:
            raise ValueError(f"{purpose}: the training data gave no batch to fit on")
        return batches

    def fit_stand_ins(self, batches: list[Mapping[str, Any]] | None = None) -> dict[int, float]:
        """Fit the stand-ins of skipped layers to the frozen base on `batches` (default: the first
        `stand_in_batches` of the training data); every rank keeps rank 0's. Returns each layer's R^2 (rank 0)."""
        if batches is None:
            batches = self._first_training_batches(int(self.hparams.stand_in_batches), "skip_stand_in")
        trainer = self._trainer
        explained: dict[int, float] = {}
        started = time.perf_counter()
        if trainer is None or trainer.is_global_zero:
            precision = trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()
            with self.teacher(), precision:
                explained = least_squares_stand_ins(self.adapter, [self.model_inputs(batch)[0] for batch in batches],
                                                    ridge=float(self.hparams.stand_in_ridge))
        if trainer is not None:
            fitted = {k: v.cpu() for k, v in self.adapter.stand_ins.state_dict().items()}
            self.adapter.stand_ins.load_state_dict(trainer.strategy.broadcast(fitted, src=0))
        log.info("stand-ins of layers %s fitted on %d batches in %.0f s; R^2 %s", sorted(map(int, self.adapter.stand_ins)),
                 len(batches), time.perf_counter() - started, ", ".join(f"{i}:{r:.2f}" for i, r in explained.items()))
        return explained

    def fit_replacement(self, batches: list[Mapping[str, Any]] | None = None) -> dict[int, Any]:
        """Fit the `replace_removed` replacement against the frozen base on `batches` (default: the first
        `replacement_batches` of the datamodule's training data); every rank keeps rank 0's."""
        if batches is None:
            batches = self._first_training_batches(int(self.hparams.replacement_batches), "replace_removed")
        if not batches:
            raise ValueError("replace_removed: no batch to fit the replacement on")
        self._ensure_removal_order(batches[0])
        precision = self.trainer.precision_plugin.forward_context() if self._trainer is not None else contextlib.nullcontext()
        hp = self.hparams
        started = time.perf_counter()
        trainer = self._trainer
        # Rank 0 fits (a layer replacement takes minutes) and every rank keeps its fit.
        fits_here = trainer is None or trainer.is_global_zero
        with self.teacher(), precision:
            if not fits_here:
                transforms = None
            elif hp.replacement == "layer":  # fitted on every real token: later tokens attend to image positions too
                pairs = [(inputs, inputs["attention_mask"].bool() if "attention_mask" in inputs else
                          torch.ones(inputs["input_ids"].shape, dtype=torch.bool, device=self.device))
                         for inputs, _ in map(self.model_inputs, batches)]
                transforms = fit_layer_replacements(self.model, self.adapter.spec, self.replacement_layers(), pairs,
                                                    epochs=int(hp.replacement_epochs), lr=float(hp.replacement_lr),
                                                    seed=int(hp.seed),
                                                    span_inputs=hp.replacement_inputs)
            else:
                transforms = fit_replacements(self.model, self.adapter.spec, self.replacement_layers(),
                                              [self.model_inputs(batch) for batch in batches],
                                              ridge=float(hp.replacement_ridge))
        if trainer is not None:
            transforms = trainer.strategy.broadcast(transforms, src=0)
        self.replacements = {int(k): v if is_layer_replacement(v) else v.to(self.device) for k, v in transforms.items()}
        self.replacement_fit_seconds = time.perf_counter() - started
        log.info("%s replacement of layers %s fitted on %d batches in %.0f s (carried by layers %s)", hp.replacement,
                 self.replacement_layers(), len(batches), self.replacement_fit_seconds, sorted(self.replacements))
        return self.replacements

    # ------------------------------------------------------------------ the loss
    def model_inputs(self, batch: Mapping[str, Any]) -> tuple[dict[str, Any], Tensor]:
        """Split a datamodule batch into forward keywords and the loss mask [B, T] (aligned with the logits)."""
        if "loss_mask" not in batch:
            raise KeyError("batch has no 'loss_mask': the datamodule must mark the positions to distil on")
        inputs = {k: v for k, v in batch.items() if k not in META_KEYS}
        if self.hparams.distill_positions == "response":
            return inputs, batch["loss_mask"].bool()
        return inputs, scored_positions(self.adapter, inputs, inputs["input_ids"].shape)

    def _set_removal_order(self, order: list[int]) -> None:
        layout = self.adapter.layout
        order = [int(b) for b in order]
        bad = sorted(set(b for b in order if b not in layout.skippable_blocks))
        if bad or len(set(order)) != len(order):
            raise InputError(f"removal_order {order} must list distinct skippable blocks; {bad} cannot be skipped "
                             f"(skippable: {list(layout.skippable_blocks)})")
        if self.hparams.max_removed_blocks > len(order):
            raise InputError(f"max_removed_blocks={self.hparams.max_removed_blocks} exceeds the {len(order)} blocks "
                             "of removal_order")
        self.adapter.removal_order = order

    def _ensure_removal_order(self, batch: Mapping[str, Any]) -> None:
        """`removal_order: impact | joint | span`: rank the skippable blocks on the first batch seen (rank 0's,
        broadcast)."""
        mode = self.hparams.removal_order
        if self.adapter.removal_order is not None or mode not in ("impact", "joint", "span"):
            return
        from ..skipping import best_removal_span, greedy_removal_order, removal_impact

        batches = [self.model_inputs(batch)[0]]
        impact = removal_impact(self.adapter, batches)
        order = sorted(impact, key=impact.__getitem__)
        if mode == "joint":
            picks, _ = greedy_removal_order(self.adapter, batches, int(self.hparams.max_removed_blocks))
            order = picks + [b for b in order if b not in picks]
        elif mode == "span":
            span, _ = best_removal_span(self.adapter, batches, int(self.hparams.max_removed_blocks))
            order = [b for b in order if b in span] + [b for b in order if b not in span]
        if self._trainer is not None:
            order = self.trainer.strategy.broadcast(order, src=0)  # every rank trains the same schedule
        self._set_removal_order(order)
        log.info("removal order (%s; single-block impact, KL per token): %s", mode,
                 ", ".join(f"{b}:{impact[b]:.3g}" for b in order))

    def _set_skip_candidates(self, candidates: int | list[int], batches: list[dict[str, Any]] | None = None) -> None:
        from ..skipping import candidate_blocks

        order = self.adapter.removal_order
        if order is not None and self.hparams.max_removed_blocks:
            # The schedule removes up to max_removed_blocks blocks of the order for every token: per-token skipping
            # among those would change nothing, so a count takes the cheapest blocks after them.
            order = list(order)[int(self.hparams.max_removed_blocks):]
        self.adapter.skip_candidates = list(candidate_blocks(self.adapter, batches or [], candidates, order))

    def _ensure_skip_candidates(self, batch: Mapping[str, Any]) -> None:
        """`skip_candidates: <count>`: the cheapest blocks by removal impact on the first batch seen (rank 0's)."""
        count = self.hparams.skip_candidates
        if self.adapter.skip_candidates is not None or not isinstance(count, int):
            return
        self._set_skip_candidates(count, [self.model_inputs(batch)[0]])
        if self._trainer is not None:  # every rank samples the same blocks
            self.adapter.skip_candidates = self.trainer.strategy.broadcast(self.adapter.skip_candidates, src=0)
        log.info("per-token skipping trained on blocks %s", self.adapter.skip_candidates)

    def removed_blocks(self, seed: int, *, largest: bool = False) -> list[int]:
        """Blocks every token skips in one student forward under the removal schedule ([] when it is off)."""
        k_max, order = int(self.hparams.max_removed_blocks), self.adapter.removal_order
        if not k_max or not order:
            return []
        if largest:
            return list(order[:k_max])
        k_min, weights = int(self.hparams.min_removed_blocks), self.hparams.removal_count_weights
        generator = torch.Generator().manual_seed(seed + 1)
        if weights is None:
            k = int(torch.randint(k_min, k_max + 1, (), generator=generator))
        else:
            k = k_min + int(torch.multinomial(torch.tensor(weights, dtype=torch.float64), 1, generator=generator))
        return list(order[:k])

    def is_dense_step(self, seed: int) -> bool:
        """Whether the training step drawing masks from `seed` runs the student whole (`dense_step_fraction`)."""
        fraction = float(self.hparams.dense_step_fraction)
        if not fraction:
            return False
        # seed: the skip masks; seed + 1: the removal count (`removed_blocks`)
        return float(torch.rand((), generator=torch.Generator().manual_seed(seed + 2))) < fraction

    def current_drop_rate(self) -> float:
        return drop_rate_at(self.global_step, self.hparams.max_drop_rate, self.hparams.drop_warmup_steps)

    def _micro_batch(self, batch_idx: int) -> int:
        """This training batch's index among all the run's (= global_step without gradient accumulation): the
        micro-batches of one optimizer step draw their own removals and masks, and a resumed run the same ones."""
        accumulate = int(self.trainer.accumulate_grad_batches) if self._trainer is not None else 1
        return self.global_step * accumulate + batch_idx % accumulate

    def _step_seed(self, step: int, stage: int) -> int:
        rank = self.global_rank if self._trainer is not None else 0
        return (int(self.hparams.seed) * 1_000_003 + step * 7_919 + rank * 104_729 + stage * 15_485_863) % (2 ** 62)

    def simulation(self, drop_rate: float, seed: int, removed: list[int] | None = None,
                   counted_positions: Tensor | None = None):
        """A `vlm_retrofit.skipping.SkipSimulation` for one student forward (None when nothing can skip); its
        compute counts `counted_positions` (default: every position)."""
        gates = bool(self.hparams.use_gates and self.adapter.config.skip_gate)
        if not self.adapter.layout.skippable_blocks:
            return None
        generator = torch.Generator().manual_seed(seed)  # CPU: the same masks on any device
        return SkipSimulation(self.adapter, drop_rate=drop_rate, use_gates=gates, budget=self.hparams.skip_budget,
                              generator=generator, removed_blocks=removed or (), counted_positions=counted_positions,
                              candidate_blocks=self.adapter.skip_candidates,
                              skip_image_positions=self.adapter.skip_image_positions)

    def _forward(self, inputs: dict[str, Any], rows: Tensor | None):
        """The model's forward; with `rows` (bool [B, T]) its logits are [N, V], at those positions only."""
        if self.hparams.hidden_weight:
            inputs = {**inputs, "output_hidden_states": True}
        with contextlib.ExitStack() as stack:
            if rows is not None:
                stack.enter_context(head_rows_selected(self.adapter.spec.get_lm_head(self.model), rows))
            stack.enter_context(autocast_lora_inputs(self._lora_layers, self.device.type))
            stack.enter_context(lora_addmm(self._lora_layers))
            return self.model(**inputs)

    def shared_prefix_layers(self, removed_layers: list[int]) -> int:
        """How many leading decoder layers the healing student with `removed_layers` deleted takes from the
        teacher's forward (`share_teacher_prefix`): those below the first removed layer, the first one holding a
        LoRA or a trainable parameter and the layer carrying a linear replacement; 0 = none."""
        if (not removed_layers or not self.hparams.share_teacher_prefix or self._prefix_verified is False
                or self.hparams.hidden_weight or self.hparams.train_routers):
            return 0
        if self._first_adapted_layer is None:  # LoRA and trainable parameters are set at construction
            self._first_adapted_layer = first_adapted_layer(self.adapter.spec.get_layers(self.model), self.model,
                                                            self._lora_layers)
        return min(min(removed_layers), self._first_adapted_layer, *(self.replacements or {}))

    def _removal_forward(self, inputs: dict[str, Any], rows: Tensor | None, removed_layers: list[int],
                         shared: int = 0, prefix_output: Tensor | None = None):
        """The healing student: the backbone without `removed_layers` (identity routing, any linear replacement
        in place); with `shared`, its first `shared` layers do not run and the next kept one receives
        `prefix_output` (what the teacher's layer `shared` received) instead."""
        spec = self.adapter.spec
        skipped = sorted({*range(shared), *removed_layers})
        substitutes = self.replacement_substitutes()
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.adapter.disabled())
            stack.enter_context(replacements_applied(self.model, spec, self._linear_replacements()))
            if shared:
                layers = spec.get_layers(self.model)
                first_kept = next(i for i in range(len(layers)) if i not in skipped)
                stack.enter_context(layer_input_replaced(substitutes.get(first_kept, layers[first_kept]), prefix_output))
            stack.enter_context(layers_removed(self.model, spec, skipped, substitutes))
            return self._forward(inputs, rows)

    @contextlib.contextmanager
    def replacement_applied(self, removed_layers: Iterable[int]) -> Iterator[None]:
        """Within the context the model, run whole, has its replacement in the layers that carry it (a linear map
        on their MLP output, a layer replacement's weights in place of theirs), so that a static skip policy
        removing `removed_layers` through the routers computes what the healing student computes (e.g. for
        `SkipAwareGenerationCallback`). Nothing changes where there is no replacement or it was fitted for other
        layers: its layers would then stand in front of a span that still runs."""
        if not self.replacement_fits(removed_layers):
            yield
            return
        with replacements_applied(self.model, self.adapter.spec, self._linear_replacements()), \
                forwards_substituted(self.adapter.spec.get_layers(self.model), self.replacement_substitutes()):
            yield

    def replacement_fits(self, removed_layers: Iterable[int]) -> bool:
        """Whether there is a replacement and it was fitted for removing exactly `removed_layers`."""
        return bool(self.replacements) and sorted({int(i) for i in removed_layers}) == sorted(self.replacement_layers())

    def _linear_replacements(self) -> dict[int, Tensor]:
        """The linear maps among the replacements (applied by hooks; a layer replacement runs as a substitute)."""
        return {k: v for k, v in (self.replacements or {}).items() if not is_layer_replacement(v)}

    def replacement_substitutes(self) -> dict[int, nn.Module]:
        """The modules the student runs in place of the layers carrying a layer replacement (made once per
        replacement and device, on the model's; none for a linear one)."""
        replacements = self.replacements or {}
        if not any(is_layer_replacement(v) for v in replacements.values()):
            return {}
        made = self._substitutes
        if (made is None or made[0] is not replacements
                or any(next(m.parameters()).device != self.device for m in made[1].values())):
            self._substitutes = (replacements, substitutes(self.model, self.adapter.spec, replacements))
        return self._substitutes[1]

    def _verify_shared_prefix(self, logits: Tensor, inputs: dict[str, Any], rows: Tensor | None,
                              removed_layers: list[int]) -> None:
        """Compare the student's `logits` from the shared prefix with the student run whole (once)."""
        with torch.no_grad():
            whole = self._removal_forward(inputs, rows, removed_layers).logits.float()
        error = float((logits.detach().float() - whole).abs().max())
        self._prefix_verified = error <= 1e-3 * max(1.0, float(whole.abs().max()))
        if not self._prefix_verified:
            rank_zero_warn(f"share_teacher_prefix: the student's logits from the teacher's first layers differ from "
                           f"its own forward by up to {error:.3g} on {self.hparams.backbone}; the student runs "
                           "whole from now on (set share_teacher_prefix: false to skip this check)")

    def hidden_state_pairs(self, removed: list[int]) -> list[tuple[int, int]]:
        """(student, teacher) indices into `hidden_states` of the layer outputs the hidden-state term compares
        when `removed` blocks are deleted: every kept layer from the first removed one on (the last one is the
        final norm's output in both). Entry 0 is the embeddings, entry j the output of the j-th layer that ran."""
        removed_layers = set(self.adapter.layout.layers_of_blocks(removed))
        if not removed_layers:
            return []
        kept = [i for i in range(self.adapter.layout.num_layers) if i not in removed_layers]
        first = min(removed_layers)
        return [(j + 1, layer + 1) for j, layer in enumerate(kept) if layer > first]

    def compute_loss(self, batch: Mapping[str, Any], *, drop_rate: float, seed: int,
                     largest_removal: bool = False, dense: bool = False) -> StepOutput:
        """Teacher and student forwards on `batch`; the student under simulated skipping at `drop_rate` (and
        the removal schedule's blocks: a random prefix, or with `largest_removal` the longest); with `dense`
        it runs every block, and there is no compute penalty."""
        self._ensure_removal_order(batch)
        self._ensure_skip_candidates(batch)
        inputs, mask = self.model_inputs(batch)
        rows = mask if self.hparams.select_logits else None  # logits [N, V] at the positions the KL reads
        removed = [] if dense else self.removed_blocks(seed, largest=largest_removal)
        layout = self.adapter.layout
        removed_layers = [] if self.hparams.train_routers else layout.layers_of_blocks(removed)
        shared = self.shared_prefix_layers(removed_layers)
        prefix: dict[str, Tensor] = {}
        with self.teacher(), (layer_input_captured(self.adapter.spec.get_layers(self.model)[shared], prefix)
                              if shared else contextlib.nullcontext()):
            teacher = self._forward(inputs, rows)
        sim = None
        if not self.hparams.train_routers:  # identity routing is the plain residual stream: the layers just go
            student = self._removal_forward(inputs, rows, removed_layers, shared, prefix.get("hidden"))
            if shared and self._prefix_verified is None:
                self._verify_shared_prefix(student.logits, inputs, rows, removed_layers)
                if not self._prefix_verified:
                    student = self._removal_forward(inputs, rows, removed_layers)
        else:
            # The compute a decode saves is on text tokens (with `compute_counted_on: response`, the answer tokens
            # only): padding and image placeholders do not count.
            counted = (batch["loss_mask"].bool() if self.hparams.compute_counted_on == "response"
                       else scored_positions(self.adapter, inputs, inputs["input_ids"].shape))
            sim = None if dense else self.simulation(drop_rate, seed, removed, counted)
            with sim if sim is not None else contextlib.nullcontext():
                student = self._forward(inputs, rows)
        kl = distillation_kl(student.logits, teacher.logits, None if rows is not None else mask,
                             self.hparams.temperature)
        hidden = None
        if self.hparams.hidden_weight:
            hidden = hidden_state_distillation(student.hidden_states, teacher.hidden_states,
                                               self.hidden_state_pairs(removed), mask)

        skippable = layout.skippable_blocks
        if sim is not None:
            expected_compute = torch.as_tensor(sim.expected_compute(), device=kl.device, dtype=torch.float32)
            expected_keep = {int(b): float(torch.as_tensor(v).detach()) for b, v in sim.expected_keep.items()}
            realised_keep = {int(b): float(v) for b, v in sim.realised_keep.items()}
            realised_compute = sim.realised_compute()
        else:  # nothing sampled: what is removed is exactly what does not run
            expected_keep = {b: 0.0 if b in removed else 1.0 for b in skippable}
            realised_keep = dict(expected_keep)
            not_run = len(layout.layers_of_blocks([b for b in removed if b in skippable]))
            realised_compute = 1.0 - not_run / layout.num_layers
            expected_compute = kl.new_tensor(realised_compute)
        penalty = compute_penalty(expected_compute, None if dense else self.hparams.compute_target,
                                  self.hparams.compute_weight, self.hparams.compute_penalty).to(kl.device)
        entropy = {k: float(v) for k, v in routing_entropies(
            self.adapter.last_routing_weights if self.hparams.train_routers else {}, inputs.get("attention_mask")).items()}
        loss = kl + penalty if hidden is None else kl + penalty + float(self.hparams.hidden_weight) * hidden
        return StepOutput(loss=loss, kl=kl, penalty=penalty, expected_compute=expected_compute, hidden=hidden,
                          realised_compute=realised_compute, expected_keep=expected_keep,
                          realised_keep=realised_keep, entropy=entropy, tokens=int(mask.sum()),
                          batch_size=int(mask.shape[0]), keeps_sampled=sim is not None)

    # ------------------------------------------------------------------ logging
    def _log_step(self, prefix: str, out: StepOutput, on_step: bool, extra: dict[str, Any] | None = None,
                  extra_only: bool = False) -> None:
        """Log `out`'s loss, KL, compute and routing metrics and `extra` under `prefix/`; `extra_only`: `extra`
        alone (a dense step, whose metrics would overwrite those of the steps that skip)."""
        sync = not on_step
        kw = dict(on_step=on_step, on_epoch=not on_step, batch_size=max(1, out.batch_size), sync_dist=sync)
        for key, value in (extra or {}).items():
            self.log(f"{prefix}/{key}", value, **kw)
        if extra_only:
            return
        self.log(f"{prefix}/loss", out.loss.detach(), prog_bar=True, **kw)
        self.log(f"{prefix}/kl", out.kl.detach(), prog_bar=prefix != "train", **kw)
        self.log(f"{prefix}/penalty", out.penalty.detach(), **kw)
        if out.hidden is not None:
            self.log(f"{prefix}/hidden", out.hidden.detach(), **kw)
        self.log(f"{prefix}/compute_expected", out.expected_compute.detach().float(), **kw)
        self.log(f"{prefix}/compute_realised", float(out.realised_compute), **kw)
        keeps_e, keeps_r = list(out.expected_keep.values()), list(out.realised_keep.values())
        if keeps_e:
            self.log(f"{prefix}/keep_expected", sum(keeps_e) / len(keeps_e), **kw)
            self.log(f"{prefix}/keep_realised", sum(keeps_r) / max(1, len(keeps_r)), prog_bar=True, **kw)
        if out.entropy:
            self.log(f"{prefix}/router_entropy", sum(out.entropy.values()) / len(out.entropy), **kw)
        if self.hparams.log_per_block:
            # Each `log` costs ~1 ms of host time: 56 constant keep ratios per step of LoRA healing were an eighth
            # of a host-bound step.
            for block, value in out.expected_keep.items() if out.keeps_sampled else ():
                self.log(f"{prefix}/keep_expected/b{block}", value, **kw)
            for block, value in out.realised_keep.items() if out.keeps_sampled else ():
                self.log(f"{prefix}/keep_realised/b{block}", value, **kw)
            for key, value in out.entropy.items():
                self.log(f"{prefix}/router_entropy/{key}", value, **kw)

    def _current_lr(self) -> float:
        try:
            optimizer = self.optimizers(use_pl_optimizer=False)
        except (RuntimeError, AttributeError):
            return float("nan")
        if isinstance(optimizer, list):
            optimizer = optimizer[0] if optimizer else None
        return base_lr(optimizer) if optimizer is not None else float("nan")

    # ------------------------------------------------------------------ Lightning hooks
    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor | None:
        drop_rate = self.current_drop_rate()
        seed = self._step_seed(self._micro_batch(batch_idx), 0)
        dense = self.is_dense_step(seed)
        out = self.compute_loss(batch, drop_rate=drop_rate, seed=seed, dense=dense)
        finite = bool(torch.isfinite(out.loss.detach()).item())
        if self._trainer is not None:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)  # every rank skips together
        if not finite:
            return self._skip_nonfinite(out)
        self.nonfinite_streak = 0
        lr = self._current_lr()
        extra = {"drop_rate": drop_rate, "lr": lr, "nonfinite_steps": float(self.nonfinite_steps)}
        if self.hparams.dense_step_fraction:
            extra["dense_step"] = float(dense)
        if dense:  # train/kl and the compute metrics stay those of the steps that skip
            extra["kl_dense"] = out.kl.detach()
        self._log_step("train", out, on_step=True, extra=extra, extra_only=dense)
        if self._trainer is not None and self.trainer.world_size > 1:
            return out.loss + self._zero_for_unused_parameters(out.loss)
        return out.loss

    def _zero_for_unused_parameters(self, like: Tensor) -> Tensor:
        """0 times every trainable parameter: puts them all in the graph.

        DDP without find_unused_parameters (Lightning's `ddp`) needs a gradient for every trainable parameter on
        every step, and a step leaves some without one: the LoRA of removed layers, the routers of bypassed
        blocks, the gates of blocks not sampled. Here they get a zero gradient on every rank instead."""
        return sum((p.sum() for p in self.parameters() if p.requires_grad), like.new_zeros(())) * 0.0

    def _skip_nonfinite(self, out: StepOutput) -> None:
        self.nonfinite_steps += 1
        self.nonfinite_streak += 1
        limit = int(self.hparams.max_nonfinite_steps)
        rank_zero_warn(f"step {self.global_step}: non-finite loss ({float(out.loss.detach()):.4g}, KL "
                       f"{float(out.kl.detach()):.4g}); the update is skipped ({self.nonfinite_streak} in a row, "
                       f"{self.nonfinite_steps} in total, limit {limit} in a row)", category=RuntimeWarning)
        self.log("train/nonfinite_steps", float(self.nonfinite_steps), on_step=True, on_epoch=False, batch_size=1)
        if self.nonfinite_streak >= limit:
            self.stop_reason = (
                f"training stopped: the loss was non-finite {self.nonfinite_streak} steps in a row (limit "
                f"max_nonfinite_steps={limit}) at step {self.global_step}. Lower the learning rate or the drop "
                "rate, check the data, or resume from an earlier checkpoint.")
            log.error(self.stop_reason)
            if self._trainer is not None:
                self.trainer.should_stop = True
        return None

    def _ranks_on_first_batch(self) -> bool:
        """Whether a block ranking made on the first batch seen (`removal_order` impact / joint / span, a
        `skip_candidates` count) is still to be made."""
        return ((self.adapter.removal_order is None and self.hparams.removal_order in ("impact", "joint", "span"))
                or (self.adapter.skip_candidates is None and isinstance(self.hparams.skip_candidates, int)))

    def _eval_step(self, prefix: str, batch: Mapping[str, Any], batch_idx: int,
                   dataloader_idx: int = 0) -> Tensor | None:
        if self._trainer is not None and self.trainer.sanity_checking and self._ranks_on_first_batch():
            # The batch before fit's first step only shows that the val shards yield one (its loader refuses them
            # otherwise); the rankings are made on the first training batch, not on validation data.
            return None
        # Evaluation always at the full drop rate, with masks fixed per batch: comparable across the run.
        out = self.compute_loss(batch, drop_rate=self.hparams.max_drop_rate,
                                seed=self._step_seed(batch_idx, 1 + dataloader_idx), largest_removal=True)
        self._log_step(prefix, out, on_step=False)
        return out.loss

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor | None:
        return self._eval_step("val", batch, batch_idx, dataloader_idx)

    def test_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Tensor | None:
        return self._eval_step("test", batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        out = self.compute_loss(batch, drop_rate=self.hparams.max_drop_rate, seed=self._step_seed(batch_idx, 9),
                                largest_removal=True)
        return {"kl": float(out.kl), "compute_realised": out.realised_compute, "keep_realised": out.realised_keep,
                "tokens": out.tokens}

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_optimizer(self.named_parameters(), hp.optimizer, hp.lr, hp.weight_decay, hp.optimizer_kwargs,
                                    query_lr_scale=hp.query_lr_scale, lora_b_lr_scale=hp.lora_b_lr_scale,
                                    stand_in_lr_scale=hp.stand_in_lr_scale)
        total = hp.total_steps
        if total is None and self._trainer is not None:
            estimate = self.trainer.estimated_stepping_batches
            total = int(estimate) if estimate is not None and math.isfinite(estimate) else None
            if total is None and hp.scheduler != "constant":
                rank_zero_warn("the number of training steps is unknown (set trainer.max_steps or "
                               "model.total_steps): the learning rate stays constant after warmup")
        if total is not None and hp.warmup_steps >= total:
            rank_zero_warn(f"warmup_steps {hp.warmup_steps} >= the run's {total} steps: the learning rate never "
                           f"reaches lr {hp.lr} and the {hp.scheduler} schedule never starts")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(hp.scheduler, hp.warmup_steps, total,
                                                                           hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_metadata(self) -> dict[str, Any]:
        """The vlm_retrofit section of a checkpoint: what it was trained on, to refuse a mismatched resume."""
        return checkpoint_metadata(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        keys = self.trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keys}
        checkpoint[CHECKPOINT_KEY] = self.checkpoint_metadata()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = check_checkpoint(self, checkpoint)  # refuses a mismatched checkpoint before anything is loaded
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == "fit":
            check_optimizer_settings(checkpoint.get("hyper_parameters") or {}, self.hparams)
        if meta.get("removal_order") is not None:
            self._set_removal_order(meta["removal_order"])  # a resumed run keeps the schedule it started with
        if meta.get("removal_range") is not None:  # what it trained so far counts, with what this run trains
            self.adapter.removal_range = resumed_removal_range(tuple(meta["removal_range"]), self.adapter.removal_range)
        if meta.get("skip_candidates") is not None:
            self.adapter.skip_candidates = list(meta["skip_candidates"])  # and the blocks it samples
        if meta.get("skip_image_positions") is not None:  # and whether image positions may skip
            self.adapter.skip_image_positions = bool(meta["skip_image_positions"])
        if meta.get("replacements") is not None:
            self.replacements = {int(k): v for k, v in meta["replacements"].items()}
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self.nonfinite_streak = int(meta.get("nonfinite_streak", 0))
