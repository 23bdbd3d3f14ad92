"""Skip policies: per-token decisions, made from the routing state before a block runs (docs/design.md §4)."""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..errors import InputError
from ..routing.config import BlockLayout


class SkipPolicy:
    """Decides, before block `block` runs, which tokens skip it. Only asked for skippable blocks."""

    name = "custom"
    reads_gates = False
    """True when `skip_mask` reads the adapter's skip gates: the fused kernels then evaluate them as they route."""
    skip_image_positions = True
    """False: visual-placeholder positions run every block (the runtime clears their skips). At batch 1 a
    per-token policy saves prefill compute only where every prompt token skips a block, which almost never
    happens, while every caption token reads the image positions' keys and values: skipping there costs quality
    and saves nearly nothing."""

    def validate(self, layout: BlockLayout, adapter: Any) -> None:
        """Refuse settings that do not exist for this backbone (called once, before any forward)."""

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        """Bool [B, T]: True where the token skips the block; None = every token runs it."""
        raise NotImplementedError

    def may_skip(self, layout: BlockLayout) -> tuple[int, ...]:
        """The blocks this policy can ever skip; the runtime patches only their layers."""
        return layout.skippable_blocks

    def removed_blocks(self) -> frozenset[int]:
        """Blocks that every token skips at every step for as long as the policy is active.

        No token ever reads their KV cache, so the runtime writes none for them (no kv-only work at all).
        """
        return frozenset()


def check_skippable_blocks(what: str, blocks, layout: BlockLayout) -> None:
    bad = sorted(b for b in blocks if b not in layout.skippable_blocks)
    if bad:
        raise InputError(
            f"{what} names block(s) {bad}, which cannot be skipped on this backbone; skippable blocks are "
            f"{list(layout.skippable_blocks)} (never-skip: {list(layout.never_skip_blocks)})"
        )


def recent_source_weight(state: Any, key: str) -> Tensor:
    """alpha on the most recent *present* source of each token, [B, T], from router `key`'s last weights."""
    alpha = state.alpha(key)  # [K, B, T]
    k = alpha.shape[0]
    present = state.stack.present_mask(k)
    if present is None:  # every token has every source: the most recent is the last
        return alpha[k - 1]
    index = torch.arange(k, device=alpha.device).view(k, 1, 1) * present
    return alpha.gather(0, index.amax(0, keepdim=True)).squeeze(0)


def _per_block(values: float | Mapping[Any, float] | None) -> float | dict[int, float] | None:
    # JSON (adapter_config.json) stores block keys as strings.
    if values is None or not isinstance(values, Mapping):
        return None if values is None else float(values)
    return {int(k): float(v) for k, v in values.items()}


def _lookup(values: float | dict[int, float] | None, block: int) -> float | None:
    return values.get(block) if isinstance(values, dict) else values


def _thresholded_blocks(layout: BlockLayout, *values: float | dict[int, float] | None) -> tuple[int, ...]:
    """The skippable blocks a per-block threshold (or a scalar, which applies to all) can make skip: a calibration
    restricted to candidate blocks sets thresholds for those only, and the runtime then patches only their layers."""
    if any(v is not None and not isinstance(v, dict) for v in values):
        return layout.skippable_blocks
    named = set().union(*(v for v in values if isinstance(v, dict)))
    return tuple(b for b in layout.skippable_blocks if b in named)


def _image_setting(skip_image_positions: bool, image_values: Any, what: str) -> bool:
    if not skip_image_positions and image_values is not None:
        raise InputError(f"{what} are set while skip_image_positions=False keeps image positions from skipping: "
                         "drop one of the two")
    return bool(skip_image_positions)


def _skip_by_modality(score: Tensor, threshold: float | None, image_threshold: float | None, token_is_image: Tensor | None,
                      skips: Callable[[Tensor, float], Tensor]) -> Tensor:
    """`skips(score, threshold)` at text positions and `skips(score, image_threshold)` at visual placeholders (when
    both are known); a position whose threshold is None runs."""
    skip = skips(score, threshold) if threshold is not None else torch.zeros_like(score, dtype=torch.bool)
    if image_threshold is not None and token_is_image is not None:
        skip = torch.where(token_is_image, skips(score, image_threshold), skip)
    return skip


class RecentWeightPolicy(SkipPolicy):
    """Skip when the router puts more than a per-block threshold on the most recent present source (ReSkip).

    `image_thresholds`, when given, apply at visual-placeholder positions (image and text tokens route
    differently, so calibration sets them apart); `thresholds` apply everywhere else. `skip_image_positions=False`
    keeps image positions from skipping at all (see `SkipPolicy.skip_image_positions`).
    """

    name = "recent_weight"

    def __init__(self, thresholds: float | Mapping[int, float],
                 image_thresholds: float | Mapping[int, float] | None = None, skip_image_positions: bool = True) -> None:
        self.thresholds = _per_block(thresholds)
        self.image_thresholds = _per_block(image_thresholds)
        self.skip_image_positions = _image_setting(skip_image_positions, self.image_thresholds, "image_thresholds")

    def validate(self, layout: BlockLayout, adapter: Any) -> None:
        for values in (self.thresholds, self.image_thresholds):
            if isinstance(values, dict):
                check_skippable_blocks("recent_weight thresholds", values, layout)
        if 0 in layout.skippable_blocks:
            raise InputError("recent_weight cannot decide block 0: its router has a single source. Mark block 0 never-skip")

    def may_skip(self, layout: BlockLayout) -> tuple[int, ...]:
        return _thresholded_blocks(layout, self.thresholds, self.image_thresholds)

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        threshold = _lookup(self.thresholds, block)
        image_threshold = _lookup(self.image_thresholds, block)
        if threshold is None and image_threshold is None:
            return None
        return _skip_by_modality(recent_source_weight(state, str(block)), threshold, image_threshold,
                                 state.token_is_image, torch.gt)


class GatePolicy(SkipPolicy):
    """Skip when the learned gate's run probability falls below `threshold`.

    `image_threshold`, when given, applies at visual-placeholder positions; `threshold` applies everywhere else.
    Gates can score image and text tokens very differently (the benchmark's skipped image positions most), and
    one threshold for both then realises another skip rate on text, which is what a decode runs; calibration
    sets them apart. `skip_image_positions=False` keeps image positions from skipping at all.
    """

    name = "gate"
    reads_gates = True

    def __init__(self, threshold: float | Mapping[int, float] = 0.5,
                 image_threshold: float | Mapping[int, float] | None = None, skip_image_positions: bool = True) -> None:
        self.threshold = _per_block(threshold)
        self.image_threshold = _per_block(image_threshold)
        self.skip_image_positions = _image_setting(skip_image_positions, self.image_threshold, "image_threshold")

    def validate(self, layout: BlockLayout, adapter: Any) -> None:
        if not adapter.config.skip_gate:
            raise InputError("the gate policy needs an adapter trained with RouterConfig(skip_gate=True); "
                             "use recent_weight, static or random instead")
        for values in (self.threshold, self.image_threshold):
            if isinstance(values, dict):
                check_skippable_blocks("gate thresholds", values, layout)

    def may_skip(self, layout: BlockLayout) -> tuple[int, ...]:
        return _thresholded_blocks(layout, self.threshold, self.image_threshold)

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        threshold = _lookup(self.threshold, block)
        image_threshold = _lookup(self.image_threshold, block)
        if threshold is None and image_threshold is None:
            return None
        key = str(block)
        run = state.gate_run.get(key)  # computed with the routed input by the fused kernels, where they ran
        if run is None:
            run = adapter.gates[key](state.routed_input, adapter.config.key_norm_eps)
        return _skip_by_modality(run, threshold, image_threshold, state.token_is_image, torch.lt)


class StaticPolicy(SkipPolicy):
    """A fixed set of blocks removed for every token (e.g. chosen by Block Influence on calibration data).

    While it is active the removed layers run nothing and write no KV cache (nobody would read it), except
    those that HF sizes attention masks from. A cache filled this way is refused by any later forward that
    would run those layers: continue it only under the same removal, or start a new one.
    """

    name = "static"

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = frozenset(int(b) for b in blocks)

    def validate(self, layout: BlockLayout, adapter: Any) -> None:
        check_skippable_blocks("static blocks", self.blocks, layout)

    def may_skip(self, layout: BlockLayout) -> tuple[int, ...]:
        return tuple(b for b in layout.skippable_blocks if b in self.blocks)

    def removed_blocks(self) -> frozenset[int]:
        return self.blocks

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        if block not in self.blocks:
            return None
        return torch.ones(state.routed_input.shape[:-1], dtype=torch.bool, device=state.routed_input.device)


class RandomPolicy(SkipPolicy):
    """Skip each (token, block) with probability `rate`, by a hash of the token's position and its decoder input;
    only `blocks` (default: every skippable block) are ever skipped; image positions too unless
    `skip_image_positions=False`.

    A hash rather than an RNG stream: the same token gets the same decision with and without a KV cache, alone or
    left-padded in a batch, and across runs, so random baselines are reproducible and comparable. It is integer
    arithmetic on the exact bits of the decoder input (an embedding row, the same in every pass; not at image
    positions, whose features a batched matmul computes) and the position in the token's own sequence: no float
    result that a kernel choice could move by an ulp, and every occurrence of a token decides on its own.
    """

    name = "random"
    _MASK = (1 << 31) - 1

    def __init__(self, rate: float, seed: int = 0, blocks: list[int] | None = None,
                 skip_image_positions: bool = True) -> None:
        if not 0.0 <= rate <= 1.0:
            raise InputError(f"random skip rate must be in [0, 1], got {rate}")
        self.rate, self.seed = float(rate), int(seed)
        self.skip_image_positions = bool(skip_image_positions)
        self.blocks = None if blocks is None else sorted({int(b) for b in blocks})
        self._weights: Tensor | None = None
        self._decided: tuple[weakref.ref, Tensor] | None = None
        """(the stream of the forward they were computed for, every block's decisions): one pass per forward, no
        stream kept."""

    def validate(self, layout: BlockLayout, adapter: Any) -> None:
        if self.blocks is not None:
            check_skippable_blocks("random blocks", self.blocks, layout)

    def may_skip(self, layout: BlockLayout) -> tuple[int, ...]:
        if self.blocks is None:
            return layout.skippable_blocks
        return tuple(b for b in layout.skippable_blocks if b in self.blocks)

    @classmethod
    def _mix(cls, x: Tensor) -> Tensor:
        # An integer finaliser on 31-bit values: every product stays below 2^62, so int64 never overflows.
        for multiplier in (0x2C1B3C6D, 0x297A2D39):
            x = ((x ^ (x >> 15)) * multiplier) & cls._MASK
        return x ^ (x >> 15)

    def _token_hash(self, state: Any) -> Tensor:
        """Int64 [B, T] hash of each token's decoder input bits (a visual placeholder's: none) and its position in
        its own sequence (`StreamState.sequence_positions`: a row decides alike alone and left-padded in a batch)."""
        source = state.stack.source(0)  # the decoder input as pushed: fp32 (buffered) or the model's dtype, same values
        bits = source.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        weights = self._weights
        if weights is None or weights.shape[0] != bits.shape[-1] or weights.device != bits.device:
            generator = torch.Generator().manual_seed(self.seed)  # the same weights on any device
            weights = torch.randint(1, 1 << 16, (bits.shape[-1],), generator=generator, dtype=torch.int64)
            self._weights = weights = weights.to(bits.device)
        content = (bits * weights).sum(-1)
        if state.token_is_image is not None:
            # Image features are a batched matmul's output: their low bits move with the batch they ran in.
            content = content.masked_fill(state.token_is_image, 0)
        positions = state.sequence_positions().to(bits.device)
        return self._mix((content + positions * 0x9E3779B1 + self.seed) & self._MASK)

    def _decisions(self, state: Any, num_blocks: int) -> Tensor:
        """Bool [num_blocks, B, T]: every block's decisions for this forward, computed together at its first block
        (a dozen small integer ops per block would cost more than a decoding step's block)."""
        # Keyed by the forward's state, not its stream: a decoding step reuses the last one's stream.
        if self._decided is not None and self._decided[0]() is state:
            return self._decided[1]
        hashed = self._token_hash(state)
        block_keys = torch.arange(1, num_blocks + 1, dtype=torch.int64, device=hashed.device) * 0x632BE5AB
        mixed = self._mix((hashed + block_keys.view(-1, *[1] * hashed.dim())) & self._MASK)
        decisions = mixed.double() / (self._MASK + 1) < self.rate
        self._decided = (weakref.ref(state), decisions)
        return decisions

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        return self._decisions(state, adapter.layout.num_blocks)[block]


class PatternPolicy(SkipPolicy):
    """Skip by a user function `fn(block, state) -> bool [B, T]` (tests, custom rules)."""

    name = "pattern"

    def __init__(self, fn: Callable[[int, Any], Tensor | None]) -> None:
        self.fn = fn

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        return self.fn(block, state)


POLICIES: dict[str, type[SkipPolicy]] = {
    "recent_weight": RecentWeightPolicy,
    "gate": GatePolicy,
    "static": StaticPolicy,
    "random": RandomPolicy,
}


def make_policy(name: str, **kwargs: Any) -> SkipPolicy:
    """Build a policy by name; an unknown name, or a missing or unknown setting, is refused naming the valid ones."""
    if name not in POLICIES:
        raise InputError(f"unknown skip policy {name!r}; valid policies: {', '.join(POLICIES)}")
    cls = POLICIES[name]
    try:
        inspect.signature(cls).bind(**kwargs)  # a missing or unknown setting, before anything is built
    except TypeError as error:
        settings = ", ".join(inspect.signature(cls).parameters) or "none"
        raise InputError(f"skip policy {name!r}: {error}. Its settings: {settings}; or pass target_saving= to use a "
                         "stored calibration (`vlm_retrofit calibrate` writes one)") from None
    return cls(**kwargs)
