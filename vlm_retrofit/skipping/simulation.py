"""Training-time skip simulation: the inference skip function with sampled masks and straight-through gates."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from ..routing.adapter import RouterAdapter
from .runtime import SkipController


class SkipSimulation(SkipController):
    """Sample per-token skips for every skippable block during one training forward.

    A token runs block n when its gate sample says so (if `use_gates` and the adapter has gates) and the
    drop-rate draw does not drop it. The layer output is `input + m * (layer(input) - input)` with m the
    0/1 run decision: in value exactly `where(skip, input, layer(input))`, the function cached inference
    uses (invariant 2); with stand-ins, `stand_in(input)` in place of `input` there, as at inference. With gates,
    `m = hard + p - p.detach()` carries the straight-through gradient to the gate; the skipped block's delta is
    absent from later routers just as at inference (present, the stand-ins', where it has them).
    `removed_blocks` are skipped by every token in this forward (a removal schedule: the routers learn to
    re-weight around blocks a static policy will remove at inference); under a `budget` they use that much of it.
    `counted_positions` (bool [B, T], e.g. the real text positions) are the tokens whose compute the expected and
    realised keep rates average over; default every position. Counted over padding and image placeholders too,
    a compute target is met most cheaply by skipping those, which saves a decode nothing.
    `candidate_blocks`: the only blocks sampled per token (the others run for every token, as they will under a
    policy calibrated with the same `candidates`); default every skippable block.
    `skip_image_positions=False`: visual placeholders run every sampled block, as under a policy calibrated so; their
    gates then get no gradient there.
    """

    mode = "blend"
    sparse_mlp = False  # the straight-through gradient reads the layer's output at the skipping positions too (and
    # the stand-ins' at the running ones: a gate's gradient weighs the layer against its stand-in)

    def __init__(self, adapter: RouterAdapter, drop_rate: float = 0.0, *, use_gates: bool = True,
                 budget: int | float | None = None, generator: torch.Generator | None = None,
                 removed_blocks: Iterable[int] = (), counted_positions: Tensor | None = None,
                 candidate_blocks: Iterable[int] | None = None, skip_image_positions: bool = True) -> None:
        super().__init__(adapter, policy=None, budget=budget)
        # Nothing counted (e.g. a batch of padding only) counts every position.
        self.counted_positions = (counted_positions if counted_positions is not None and bool(counted_positions.any())
                                  else None)
        self.removed_blocks = frozenset(int(b) for b in removed_blocks)
        if not self.removed_blocks <= self.skippable:
            raise ValueError(f"removed_blocks {sorted(self.removed_blocks - self.skippable)} are not skippable; "
                             f"skippable blocks are {sorted(self.skippable)}")
        # A removed block's routed input would feed a layer whose output nothing uses: it is not computed (its
        # stand-ins, where it has them, do use it).
        self.bypassed_blocks = self.removed_blocks - self.stand_in_blocks
        if self.budget is not None:
            # At inference a static policy's removed blocks count against the budget (every token skips them);
            # here too: the sampled blocks get what is left of it.
            if len(self.removed_blocks) > self.budget:
                raise ValueError(f"skip budget {budget} ({self.budget} blocks per token) is smaller than the "
                                 f"{len(self.removed_blocks)} removed blocks {sorted(self.removed_blocks)}: raise "
                                 "the budget or remove fewer blocks")
            self.budget -= len(self.removed_blocks)
        self.candidate_blocks = None if candidate_blocks is None else frozenset(int(b) for b in candidate_blocks)
        if self.candidate_blocks is not None and not self.candidate_blocks <= self.skippable:
            raise ValueError(f"candidate_blocks {sorted(self.candidate_blocks - self.skippable)} are not skippable; "
                             f"skippable blocks are {sorted(self.skippable)}")
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        self.drop_rate = float(drop_rate)
        self.skip_image_positions = bool(skip_image_positions)
        self.use_gates = bool(use_gates and adapter.config.skip_gate)
        self.generator = generator
        self.skipped_cost = {layer: self.skipped_layer_cost(layer, writes_cache=block not in self.removed_blocks)
                             for block in self.skippable for layer in self.layout.layers_of_block(block)}
        """Decoder layer index -> what a token skipping it still spends at decode, as a share of its context-free
        FLOPs (`skipped_layer_cost`): a per-token skip writes its K/V, a removed block nothing; stand-ins run."""
        self._multiplier: dict[int, Tensor] = {}
        self.expected_keep: dict[int, Tensor] = {}
        self.realised_keep: dict[int, float] = {}

    def begin_forward(self, state: Any) -> None:
        super().begin_forward(state)
        self._multiplier.clear()
        self.expected_keep.clear()
        self.realised_keep.clear()

    def _uniform(self, like: Tensor) -> Tensor:
        # Drawn on the CPU generator so runs are reproducible on any device, then moved.
        return torch.rand(like.shape, generator=self.generator).to(like.device)

    def decide(self, block: int, state: Any) -> None:
        sampled = self.candidate_blocks is None or block in self.candidate_blocks or block in self.removed_blocks
        if block not in self.skippable or not sampled:
            self._skip[block] = None
            return
        routed = state.routed_input
        if block in self.removed_blocks:
            skip = torch.ones(routed.shape[:-1], dtype=torch.bool, device=routed.device)
            self._skip[block] = skip
            self._multiplier[block] = torch.zeros(skip.shape, device=routed.device)
            self.expected_keep[block] = torch.zeros((), device=routed.device)
            self.realised_keep[block] = 0.0
            # Its delta is dropped from the stream, as at inference, and its layer runs nothing: the multiplier
            # is 0 with no gate behind it, so the output would carry neither value nor gradient. (With stand-ins
            # they run in its place and their delta stays: `bypassed_blocks`, `ran`.)
            self._none_ran.add(block)
            self._record_decision(block, state, skip)
            return
        run = self._uniform(routed[..., 0]) >= self.drop_rate
        keep_prob = torch.full((), 1.0 - self.drop_rate, device=routed.device)
        gate_prob = None
        if self.use_gates:
            gate_prob = self.adapter.gates[str(block)](routed, self.adapter.config.key_norm_eps)
            run = run & (self._uniform(gate_prob) < gate_prob.detach())
            keep_prob = self._counted_mean(gate_prob) * (1.0 - self.drop_rate)
        decided = None  # positions whose run decision is sampled: all, or the text positions
        if not self.skip_image_positions and state.token_is_image is not None:
            decided = ~state.token_is_image
            run = run | state.token_is_image
        skip = self._apply_budget(~run)  # a token out of budget runs the block after all
        multiplier = (~skip).float()
        if gate_prob is not None:
            straight_through = gate_prob - gate_prob.detach()  # value 0: the multiplier's value is unchanged
            multiplier = multiplier + (straight_through if decided is None else straight_through * decided)
        self._skip[block] = skip
        self._multiplier[block] = multiplier
        self.expected_keep[block] = keep_prob
        self.realised_keep[block] = 1.0 - float(self._counted_mean(skip.float()))
        self._record_decision(block, state, skip)

    def _counted_mean(self, values: Tensor) -> Tensor:
        """Mean of `values` [B, T] over the counted positions (all of them when none were given or their shape is
        not this forward's). A weighted sum, not a boolean index: no device sync per block."""
        counted = self.counted_positions
        if counted is None or counted.shape != values.shape:
            return values.mean()
        weight = counted.to(device=values.device, dtype=torch.float32)  # bf16 sums over many tokens lose digits
        return (values.float() * weight).sum() / weight.sum()

    def _combine(self, block: int, skipped: Tensor, out: Tensor, skip: Tensor) -> Tensor:
        multiplier = self._multiplier[block].to(skipped.dtype)[..., None]
        return skipped + multiplier * (out - skipped)

    def expected_compute(self) -> Tensor:
        """Expected executed fraction of decoder-layer compute (differentiable through the gates)."""
        return torch.as_tensor(self._executed_layers(self.expected_keep)) / self.layout.num_layers

    def realised_compute(self) -> float:
        """The executed fraction of decoder-layer compute this forward's sampled skips came to."""
        return float(self._executed_layers(self.realised_keep)) / self.layout.num_layers

    def _executed_layers(self, keep_rates: dict[int, Tensor] | dict[int, float]) -> Tensor | float:
        """Layer executions per counted token given each sampled block's keep rate (unsampled blocks run). A token
        that skips a layer still writes its K/V at decode and runs its stand-in, if any: it counts as that share of
        the layer's FLOPs (`skipped_cost`), so a compute target is not met by skips that save less than they seem to."""
        total: Tensor | float = 0.0
        for block in range(self.layout.num_blocks):
            keep = keep_rates.get(block)
            for layer in self.layout.layers_of_block(block):
                total = total + (1.0 if keep is None else keep + (1.0 - keep) * self.skipped_cost[layer])
        return total
