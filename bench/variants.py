"""The bench's router variants: how each is trained (its recipe and removal) and which skip policy measures it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .measuring import SKIP_IMAGE_POSITIONS


@dataclass
class Variant:
    """One trained router adapter: how it is trained and which skip policy it is evaluated with."""

    name: str
    policy: str
    router: dict[str, Any]
    module: dict[str, Any] = field(default_factory=dict)
    fixed_removal: bool = False
    """Static variants: train only the speed target's prefix of the removal order (min = max removed blocks)
    instead of every prefix up to the largest target."""
    joint_order: bool = False
    """Static variants: remove blocks in greedy *joint* removal order (each pick the cheapest given the earlier
    ones) instead of by single-block impact."""
    elastic_removal: bool = False
    """Static variants: train every removal count from the smallest target's to the largest's (k uniform per step)
    instead of the speed target's only, so that one LoRA serves every target (`merge --prune-target` accepts each)."""
    span_order: bool = False
    """Static variants: remove the cheapest run of adjacent blocks at the speed target (`span_removal_order`),
    then greedy joint removal from it."""
    removal_target: float | None = None
    """Static variants with `fixed_removal`: train the removal of this target (its count of blocks) instead of the
    speed target's, and measure the variant at this target only (its decode speed too): one adapter per operating
    point. The target must be one of the run's `--targets`."""
    own_span: bool = False
    """With `removal_target`: remove the cheapest run of adjacent blocks as long as that target's removal, instead
    of the speed target's span continued greedily (`span_order`): one span for a layer replacement to stand in for,
    where the other may leave several."""
    steps: int | None = None
    """The learning rate decays to a tenth (cosine; `min_lr_ratio`): over the wall-clock budget by default
    (`BudgetDecay`), over this many steps with `--decay-over steps` (the time budget as a cap); None = as many steps
    as the time budget allows, at a constant learning rate."""


# The routed recipe after the first runs: queries at 1/25 of the lr (AdamW moves all 576 query coordinates by
# ~lr per step, so routing logits swing ~lr * d) and KL on every text position (captions are ~5 answer tokens).
TEXT_KL = {"query_lr_scale": 0.04, "distill_positions": "text"}
ROUTED = {**TEXT_KL, "use_gates": False, "max_drop_rate": 0.0, "lr": 2e-3}
LORA_QVO = {"r": 8, "lora_alpha": 16, "target_modules": r".*language_model.*\.(q_proj|v_proj|o_proj)"}
LORA_ALL = {"r": 16, "lora_alpha": 32,
            "target_modules": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"}
# LoRA healing of a static removal: LoRA+ on every projection, routers off (identity).
LORA_HEALING = {**ROUTED, "lora": LORA_ALL, "train_routers": False, "lora_b_lr_scale": 4.0}
# Learned per-token gates pulled to a compute target, trained as they are measured: image positions run every block
# (`measuring.SKIP_IMAGE_POSITIONS`). A/B on `gate_b3_candidates` (240 steps each, seed 0, test; HISTORY.md, "Per-token
# gates trained with image positions kept"): caption agreement 0.730 / 0.520 / 0.486 at 10 / 20 / 30 % against
# 0.700 / 0.417 / 0.469 trained with them skipping; the text level (x1.422 / x1.920 / x3.367 against x1.424 /
# x1.946 / x3.346).
# LoRA healing from a layer replacement (`lora_mlp_span_layer`, below): the layer in front of each removed span
# retrained first on 192 captured training batches, 12 passes; then the LoRA at half LORA_HEALING's rate.
LAYER_HEALING = {**LORA_HEALING, "lr": 1e-3, "replace_removed": True, "replacement": "layer",
                 "replacement_batches": 192, "replacement_epochs": 12, "replacement_lr": 2e-3}
# The same for a removal of several spans: every span's layer fitted from the full model's stream, one capture, 8
# passes (each span's passes are paid from the budget).
MULTI_SPAN_LAYER_HEALING = {**LAYER_HEALING, "replacement_epochs": 8, "replacement_inputs": "full"}
GATE_LORA = {"r": 8, "lora_alpha": 16, "target_modules": r".*language_model.*\.(q_proj|v_proj)"}
GATES_ON_TEXT = {**TEXT_KL, "use_gates": True, "max_drop_rate": 0.1, "compute_target": 0.7, "compute_weight": 5.0,
                 "skip_image_positions": SKIP_IMAGE_POSITIONS, "compute_counted_on": "text"}
# The compute target counted on the answer tokens (what a decode runs), not on every text position: counted there,
# the caption batches' chat template and prompt (~80 % of their text positions) took the skipping, and the gates
# skipped 5 % of a decode's layer executions at the 20 % target. A/B on `gate_lora_candidates` (seed 0, one build,
# val, both calibrated on the answer tokens; HISTORY.md, "Per-token compute counted on the answer tokens"):
# agreement 0.743 / KL 0.342 at 19.7 % of the decode's block FLOPs saved, against 0.706 / 0.422 trained on text.
GATES = {**GATES_ON_TEXT, "compute_counted_on": "response"}
# The gates in front of blocks of 2 layers on the 7 blocks cheapest to remove (14 layers), at the 20 % point's
# compute target: the `gate_lora_candidates_b2` recipe without its LoRA.
B2_CANDIDATE_GATES = {**GATES, "skip_candidates": 7, "compute_target": 0.8}
B2_GATE_ROUTER = {"block_size": 2, "skip_gate": True}
VARIANTS = {
    # Routers trained under a removal schedule (a random prefix of the removal order skipped by every token),
    # evaluated with the static policy removing a prefix of that same order: the routers re-weight around the gap.
    "routed_static": Variant("routed_static", "static", {"block_size": 1}, ROUTED),
    "routed_static_lora": Variant("routed_static_lora", "static", {"block_size": 1}, {**ROUTED, "lora": LORA_QVO}),
    # One operating point: always the speed target's blocks removed, LoRA healing that configuration only.
    "routed_static_lora_fixed": Variant("routed_static_lora_fixed", "static", {"block_size": 1},
                                        {**ROUTED, "lora": LORA_QVO}, fixed_removal=True),
    # The same point healed by LoRA on every projection, attention and MLP (r16): more capacity than q/v/o r8,
    # whose training KL flattened early.
    "routed_static_lora_mlp_fixed": Variant("routed_static_lora_mlp_fixed", "static", {"block_size": 1},
                                            {**ROUTED, "lora": LORA_ALL}, fixed_removal=True),
    # The same, removing the blocks greedy joint removal picks: a better starting point for the healing.
    "routed_static_lora_mlp_joint": Variant("routed_static_lora_mlp_joint", "static", {"block_size": 1},
                                            {**ROUTED, "lora": LORA_ALL}, fixed_removal=True, joint_order=True),
    # The same with the learning rate decayed (cosine, to a tenth) over a fixed number of steps: at a constant rate
    # its training KL stopped falling halfway through the budget (~0.27-0.30 over the last half): step noise.
    # 115 steps fit the 15 min budget at the ~7 s/step measured there.
    "routed_static_lora_mlp_joint_cosine": Variant("routed_static_lora_mlp_joint_cosine", "static", {"block_size": 1},
                                                   {**ROUTED, "lora": LORA_ALL}, fixed_removal=True, joint_order=True,
                                                   steps=115),
    # LoRA healing alone: routers off (identity, untrained), the student is the backbone with the joint blocks
    # deleted. With LoRA the trained routers had added nothing (identity routers + the same LoRA: perplexity within
    # 0.3 % at 10 and 20 %, 1.3 % at 30 %). Same cosine decay as above over 240 steps: bf16-mixed steps on bf16
    # frozen weights take 4.9 s on 2 CPU cores, so 20 minutes hold ~245 (it was set for 280 at 5.6 s/step on fp32
    # weights, and the cap ended it with the learning rate still ~0.3x). Healing follows the samples seen, not the
    # steps: batches of 2 for 400 steps (800 samples) healed as much as batches of 4 for 215 (860).
    # LoRA+ B matrices at 4x the rate (adopted after the eleventh run: val perplexity x1.116 against x1.155 at 20 %
    # over the same 240 steps; ratio 8 was worse).
    "lora_mlp_joint_plain": Variant("lora_mlp_joint_plain", "static", {"block_size": 1}, LORA_HEALING,
                                    fixed_removal=True, joint_order=True, steps=240),
    # The same healing started from a linear replacement of the removed layers (`replace_removed`): each removed
    # span replaced by a least-squares map on the MLP output of the layer in front of it, fitted on 32 training
    # batches before the first step (~1.5 min on 2 CPU cores, inside the 20 min: hence 225 steps) and folded into
    # that layer's down_proj at release. Training-free the map alone takes the 20 % removal from x1.80 to x1.37 val
    # perplexity, but 240 steps of LoRA from it ended worse than from plain removal (val x1.157 against x1.116 with
    # 32 fit batches; x1.190 at lr 5e-4; x1.155 with 64 batches): not in the default list (HISTORY.md, probes).
    "lora_mlp_joint_replaced": Variant("lora_mlp_joint_replaced", "static", {"block_size": 1},
                                       {**LORA_HEALING, "replace_removed": True, "replacement_batches": 32},
                                       fixed_removal=True, joint_order=True, steps=225),
    # The shipped recipe on the cheapest span of adjacent layers instead of the greedy joint picks: by hand on val,
    # layers 13-18 healed to x1.081 against x1.116 for the joint picks {13, 14, 16, 17, 18, 26} in the same 240 steps
    # (test x1.129 against x1.148); their plain removal x1.598 against x1.804.
    "lora_mlp_span": Variant("lora_mlp_span", "static", {"block_size": 1}, LORA_HEALING,
                             fixed_removal=True, span_order=True, steps=240),
    # The same healing started from a layer replacement (`replacement: layer`): layer 12, in front of the span, first
    # retrained alone to write what layers 12-18 wrote (on 192 training batches captured once, 12 passes), then frozen
    # while the LoRA heals the rest; the release ships it as layer 12. By hand on val Austen text (1,024 chunks of
    # 256 tokens, 4 passes, no LoRA): the 20 % point at x1.109 against x2.05 for the plain removal of the same
    # layers. Its fit is spent from the same 20-minute budget (`BudgetDecay`). The LoRA at half the recipe's rate:
    # from this start the recipe's 0.002 made the training KL climb over the first tenths (0.18 -> 0.20), 0.001
    # did not, and healed further on val (x1.095 against x1.100, caption KL 0.083 against 0.097; HISTORY.md).
    # 8 passes over the capture instead of 4: the replacement alone read x1.132 against x1.148 on val text (384
    # batches x 4 passes: x1.131, 100 s dearer), for ~76 s of the budget's LoRA steps (HISTORY.md, "8 passes");
    # 12 instead of 8 (val x1.126): test x1.042 / x1.039 / x1.047 / x1.032 over four seeds against x1.043 / x1.041
    # / x1.056 / x1.039, for ~60 s more of the budget (HISTORY.md, "12 passes over the capture")
    "lora_mlp_span_layer": Variant("lora_mlp_span_layer", "static", {"block_size": 1}, LAYER_HEALING,
                                   fixed_removal=True, span_order=True, steps=240),
    # The layer-replacement recipe for the 10 and 30 % points, each trained for its own removal and measured there,
    # as `lora_mlp_span_t10` / `_t30` are for the plain start. The span order's first 3 layers (by single-block
    # impact inside the span) may form two spans, each replaced by the layer in front of it. At 30 % the cheapest
    # span of 9 (`own_span`) instead of the 6-span and three greedy joint picks beyond it: on val, one build, one
    # seed each, x1.157 against x1.181, caption KL 0.149 against 0.160, agreement not told apart (-0.021 [-0.051,
    # +0.009]); one layer to fit instead of three left 488 LoRA steps instead of 388 (HISTORY.md, "One span at
    # 30 %"). The replacement's settings are the 20 % point's, not tuned for these, except that every span's layer
    # is fitted from the full model's stream, all captured in one forward (`replacement_inputs: full`): fitted each
    # on its own capture with the earlier spans replaced, the 10 % removal {14}, {16, 17} took 15 of the 20 minutes
    # on 2 CPU cores (some of it shared with other work), leaving 61 LoRA steps.
    "lora_mlp_span_layer_t10": Variant("lora_mlp_span_layer_t10", "static", {"block_size": 1}, MULTI_SPAN_LAYER_HEALING,
                                       fixed_removal=True, span_order=True, steps=240, removal_target=0.1),
    "lora_mlp_span_layer_t30": Variant("lora_mlp_span_layer_t30", "static", {"block_size": 1}, MULTI_SPAN_LAYER_HEALING,
                                       fixed_removal=True, span_order=True, steps=240, removal_target=0.3,
                                       own_span=True),
    # `lora_mlp_span`'s recipe for the 10 and 30 % points, each trained for its own removal (the span order's first
    # 3 / 9 blocks) and measured there: by hand in the 20-minute budget, x1.028 at 10 % and x1.175-1.207 at 30 %
    # (test, pruned) against x1.170 / x1.691 for `lora_mlp_span`'s 20 % adapter at those points (HISTORY.md, "One
    # LoRA per operating point").
    "lora_mlp_span_t10": Variant("lora_mlp_span_t10", "static", {"block_size": 1}, LORA_HEALING,
                                 fixed_removal=True, span_order=True, steps=240, removal_target=0.1),
    "lora_mlp_span_t30": Variant("lora_mlp_span_t30", "static", {"block_size": 1}, LORA_HEALING,
                                 fixed_removal=True, span_order=True, steps=240, removal_target=0.3),
    # `lora_mlp_span` trained on every removal count the targets take (3..9 layers of the span order for 10-30 %),
    # so that one LoRA serves every target. Probed with `bench.measure` (240 steps each, test text, one build): x1.035 /
    # x1.118 / x1.380 at 10 / 20 / 30 %, against x1.173 / x1.126 / x1.704 for the same recipe trained at 20 % only.
    "lora_mlp_span_elastic": Variant("lora_mlp_span_elastic", "static", {"block_size": 1}, LORA_HEALING,
                                     elastic_removal=True, span_order=True, steps=240),
    # Per-token policies: learned gates pulled to a compute target, and the ReSkip recent-weight rule under a
    # drop-rate curriculum; same query lr and KL positions as the routed variants.
    "gate": Variant("gate", "gate", {"block_size": 1, "skip_gate": True}, GATES),
    # The same gates in front of blocks of 3 layers: 10 routers instead of 30, so routing costs ~1.5 % of a routed
    # decode instead of ~4 %, but a token skips 3 layers at a time.
    "gate_b3": Variant("gate_b3", "gate", {"block_size": 3, "skip_gate": True}, GATES),
    # The same gates trained on the 5 blocks cheapest to remove only (`skip_candidates`), at a compute target the
    # 20 % point needs (a probe by hand: routers alone x1.09 against x1.21, val text x2.00 against x2.15 at 20 %).
    "gate_b3_candidates": Variant("gate_b3_candidates", "gate", {"block_size": 3, "skip_gate": True},
                                  {**GATES, "skip_candidates": 5, "compute_target": 0.8}),
    "recent_weight": Variant("recent_weight", "recent_weight", {"block_size": 1},
                             {**TEXT_KL, "use_gates": False, "max_drop_rate": 0.3, "drop_warmup_steps": 50}),
    # `gate` with LoRA healing (r 8 on q/v) trained beside the gates, under the same simulated skipping.
    "gate_lora": Variant("gate_lora", "gate", {"block_size": 1, "skip_gate": True},
                         {**GATES, "lora": GATE_LORA}),
    # `gate_lora` trained on the 14 single layers cheapest to remove only (`skip_candidates`), at the 20 % point's
    # compute target: the candidates are what lifted the gates without LoRA most at 10 % (`gate_b3_candidates`
    # x1.443 against `gate` x1.967 in the sixteenth run).
    "gate_lora_candidates": Variant("gate_lora_candidates", "gate", {"block_size": 1, "skip_gate": True},
                                    {**GATES, "lora": GATE_LORA, "skip_candidates": 14, "compute_target": 0.8}),
    # `gate_lora_candidates` in front of blocks of 2 layers: 15 routers instead of 30, so routing costs ~1.3-1.7 % of
    # a batch-1 generate call instead of ~2.5-2.7 % (RESULTS.md, router overhead by block size); its 7 candidate
    # blocks are 14 layers, as many as `gate_lora_candidates` skips among, but a token skips both layers of a block or
    # neither.
    "gate_lora_candidates_b2": Variant("gate_lora_candidates_b2", "gate", B2_GATE_ROUTER,
                                       {**B2_CANDIDATE_GATES, "lora": GATE_LORA}),
    # `gate_lora_candidates_b2` with the static healing's LoRA capacity (r 16 on every projection, attention and MLP)
    # instead of r 8 on q/v: a static removal healed far further once its LoRA reached the MLP. Rejected (seed 0, one
    # build, val, beside r 8 trained on the same build): x1.335 / x1.413 / x1.586 / x1.778 at 0 / 10 / 20 / 30 %
    # against x1.028 / x1.129 / x1.363 / x1.618, at the static healing's rates (lr 2e-3, B x4) x1.135 / x1.209 /
    # x1.417 / x1.613: with skipping off it already reads caption KL 0.40-0.47 against 0.20 (HISTORY.md, "LoRA on
    # every projection beside the gates").
    "gate_lora_mlp_candidates_b2": Variant("gate_lora_mlp_candidates_b2", "gate", B2_GATE_ROUTER,
                                           {**B2_CANDIDATE_GATES, "lora": LORA_ALL}),
    # `gate_lora_candidates_b2` with a quarter of its steps run whole (`dense_step_fraction`): trained under skips
    # only, the recipe's routers and LoRA drift from the base with skipping off (val caption KL 0.20-0.34 at 0 %
    # saved). Not adopted (seeds 0 and 1 beside the recipe, val): lower caption KL with skipping off and at 30 %,
    # agreement and ROUGE-L level or higher at 20 %, but Austen perplexity x1.395 / x1.341 at 20 % against x1.363 /
    # x1.280 (HISTORY.md, "Keeping the unskipped model near the base").
    "gate_lora_candidates_b2_dense": Variant("gate_lora_candidates_b2_dense", "gate", B2_GATE_ROUTER,
                                             {**B2_CANDIDATE_GATES, "lora": GATE_LORA, "dense_step_fraction": 0.25}),
    # `gate_lora_candidates_b2` with stand-ins for the skipped layers (`RouterConfig.skip_stand_in`): a token skipping
    # a layer gets a d x d map of its input, fitted to the layer by least squares when training starts, instead of
    # nothing. Training-free, random skipping of the 9 cheapest layers read x1.31 instead of x1.87 with them at 20 %
    # (val text, `python -m bench.stand_in_probe`). Trained, seeds 0 / 1 on val: x1.068 / x1.062, x1.164 / x1.180,
    # x1.275 / x1.330 at 10 / 20 / 30 % against the recipe's x1.092-1.129, x1.280-1.363, x1.618-1.640 (HISTORY.md,
    # "Stand-ins for skipped layers"). Retrained with the K/V writes and stand-ins in the compute estimate, seeds 0 / 1:
    # x1.051 / x1.067, x1.150 / x1.162, x1.248 / x1.261; seed 0 with compute_weight 20 x1.069 / x1.163 / x1.260,
    # rejected (HISTORY.md, "A skip's K/V write in the compute estimate").
    "gate_lora_candidates_b2_stand_in": Variant("gate_lora_candidates_b2_stand_in", "gate",
                                                {**B2_GATE_ROUTER, "skip_stand_in": True},
                                                {**B2_CANDIDATE_GATES, "lora": GATE_LORA}),
    # `gate_lora_candidates_b2_stand_in` with its learning rate decayed (cosine to a tenth over the budget's wall
    # clock, as the static healing's is) instead of constant: its training KL was flat over the last half of the
    # budget (0.18-0.19), as the static healing's was at a constant rate before it decayed. Seeds 0 / 1 on val:
    # x0.988 / x0.991, x1.041 / x1.053, x1.132 / x1.166, x1.227 / x1.257 at 0 / 10 / 20 / 30 % against x1.002 /
    # x1.005, x1.051 / x1.067, x1.150 / x1.162, x1.248 / x1.261 at a constant rate; caption KL with skipping off
    # 0.042 / 0.046 against 0.114 / 0.090, at 20 % 0.173 / 0.140 against 0.181 / 0.185 (HISTORY.md, "The stand-in
    # gates with a decaying learning rate").
    "gate_lora_candidates_b2_stand_in_cosine": Variant("gate_lora_candidates_b2_stand_in_cosine", "gate",
                                                       {**B2_GATE_ROUTER, "skip_stand_in": True},
                                                       {**B2_CANDIDATE_GATES, "lora": GATE_LORA}, steps=240),
    # `gate_lora_candidates` as trained before 2026-12-06: its compute target counted on every text position (the
    # adapters trained then, without the key in their recipe, are stale for it).
    "gate_lora_candidates_text": Variant("gate_lora_candidates_text", "gate", {"block_size": 1, "skip_gate": True},
                                         {**GATES_ON_TEXT, "lora": GATE_LORA, "skip_candidates": 14,
                                          "compute_target": 0.8}),
}


# What `make bench` trains and measures: our routers without LoRA (static, per-token gates, the ReSkip rule), the
# gates with LoRA healing (on every layer, and on the cheapest layers only: `gate_lora_candidates` replaced
# `gate_b3_candidates`, x1.167 / x1.372 / x1.891 at 10 / 20 / 30 % against x1.443 / x1.943 / x3.852; the same in
# front of blocks of 2 layers, whose routing costs less: x1.141 / x1.305 / x1.536 by hand on test), LoRA healing
# from plain removal at 20 %, and from a layer replacement at each target (at 10 / 30 % x0.996 / x1.169 against
# x1.025 / x1.266 from plain removal). The same with stand-ins for the skipped layers replaced `gate_lora_candidates`
# (block size 1) on 2026-12-07: val x1.164 / x1.180 at 20 % on two seeds against x1.363 / x1.280 without them; then
# the same with its learning rate decayed replaced it (`_cosine`: level or lower perplexity at every target on two
# seeds, far nearer the base with skipping off). The variants they superseded stay selectable with --variants (their
# last table rows are in RESULTS.md's earlier runs).
DEFAULT_VARIANTS = ["routed_static", "lora_mlp_span", "lora_mlp_span_layer_t10", "lora_mlp_span_layer",
                    "lora_mlp_span_layer_t30", "gate", "gate_lora", "gate_lora_candidates_b2",
                    "gate_lora_candidates_b2_stand_in_cosine", "recent_weight"]


def selected_variants(names: list[str], train_steps: int | None = None) -> list[Variant]:
    """The named variants; `train_steps` replaces the step count of those trained over a fixed number of steps
    (the others train for as many steps as the time budget allows)."""
    variants = [VARIANTS[name] for name in names]
    return [dataclasses.replace(v, steps=train_steps) if train_steps and v.steps else v for v in variants]


def removal_settings(variant: Variant, orders: dict[str, list[int]], max_removed_blocks: int,
                     speed_removed_blocks: int, min_target_blocks: int = 0,
                     target_blocks: dict[float, int] | None = None) -> dict[str, Any]:
    """What a static variant trains without: its removal order (`orders`: "impact", "joint", "span") and how
    many of its blocks a step removes (empty for the other policies): the speed target's count (`fixed_removal`)
    or its own target's (`removal_target`, counted in `target_blocks`: each target's blocks; the order's prefix of
    that length only), the smallest target's to the largest's (`elastic_removal`), else 0 to the largest target's."""
    if variant.policy != "static":
        return {}
    order = orders["span" if variant.span_order else "joint" if variant.joint_order else "impact"]
    if variant.fixed_removal and variant.removal_target is not None:
        if variant.removal_target not in (target_blocks or {}):
            raise SystemExit(f"{variant.name} is trained and measured at target {variant.removal_target}, which this "
                             f"run does not measure (--targets {' '.join(map(str, target_blocks or {}))}): add it")
        fewest = most = target_blocks[variant.removal_target]
        # Measured at its own target only: the blocks it removes are all of the order it needs (an adapter healed
        # by hand for those blocks, `bench.heal --removal`, is the same adapter).
        order = (orders[own_span_key(most)] if variant.own_span else order)[:most]
    elif variant.fixed_removal:
        fewest = most = speed_removed_blocks
    else:
        fewest, most = (min_target_blocks if variant.elastic_removal else 0), max_removed_blocks
    return {"removal_order": list(order), "max_removed_blocks": most, "min_removed_blocks": fewest}


def own_span_key(blocks: int) -> str:
    """The key of `orders` (`removal_settings`) under which the cheapest span of `blocks` adjacent blocks is."""
    return f"span of {blocks}"
