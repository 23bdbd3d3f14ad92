"""RouterConfig (what the user sets) and BlockLayout (that config resolved against one backbone)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Sequence

from ..errors import InputError


@dataclass
class RouterConfig:
    """Depth routers retrofitted into a frozen decoder (Block Attention Residuals)."""

    block_size: int = 1
    """Decoder layers per routed block; 1 routes in front of every layer. Ignored when `block_starts` is set."""
    block_starts: list[int] | None = None
    """Explicit block boundaries: the index of the first layer of each block, starting at 0, increasing."""
    skippable_blocks: list[int] | None = None
    """Blocks that skipping may remove; None = every block that is not never-skip."""
    never_skip_blocks: list[int] | None = None
    """Blocks that always run. None = the first and the last block. Blocks holding a layer the backbone
    keeps running (`BackboneSpec.never_skip_layers`, `feature_injection_layers`: a hybrid's recurrent layers, Qwen3-VL's
    deepstack injection) are added in any case."""
    key_norm_eps: float = 1e-6
    """Epsilon of the RMSNorm applied to each source before it is scored."""
    source_bias: bool = True
    """Learn a bias per (router, source) pair on top of the query score."""
    skip_gate: bool = False
    """Add a learned skip gate per skippable block, `p = sigmoid(g . RMSNorm(x) + c)`, p = probability it runs."""
    gate_init_bias: float = 3.0
    """Initial gate bias c: sigmoid(3) = 0.95, so gates start out running almost every block."""
    skip_stand_in: bool = False
    """Give every layer of each skippable block a stand-in: a token that skips the layer gets `h + RMSNorm(h) W + b`
    instead of `h` (a d x d map per layer, zero at init, fitted to the layer by least squares when training starts;
    `routing.stand_in`). A skipped block's delta then stays present for later routers. Costs one d x d product per
    skipped token, counted in the executed FLOPs."""
    init_scale: float = 0.0
    """Std of the pseudo-query init. 0 keeps the adapter an exact identity at init (invariant 1)."""

    def __post_init__(self) -> None:
        if int(self.block_size) < 1:
            raise InputError(f"RouterConfig.block_size must be >= 1, got {self.block_size}")
        if self.key_norm_eps <= 0:
            raise InputError(f"RouterConfig.key_norm_eps must be > 0, got {self.key_norm_eps}")
        if self.init_scale < 0:
            raise InputError(f"RouterConfig.init_scale must be >= 0, got {self.init_scale}")
        for name in ("block_starts", "skippable_blocks", "never_skip_blocks"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, [int(v) for v in value])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RouterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown RouterConfig field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    def layout(self, num_layers: int, backbone_always_run_layers: Iterable[int] = ()) -> "BlockLayout":
        """Resolve block boundaries and skippability for a decoder with `num_layers` layers."""
        if self.block_starts is not None:
            starts = list(self.block_starts)
            if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= num_layers:
                raise InputError(
                    f"RouterConfig.block_starts={starts} must start at 0, increase strictly and stay below "
                    f"the backbone's {num_layers} layers"
                )
        else:
            starts = list(range(0, num_layers, int(self.block_size)))
        num_blocks = len(starts)
        block_of_layer = [0] * num_layers
        for n, start in enumerate(starts):
            end = starts[n + 1] if n + 1 < num_blocks else num_layers
            for layer in range(start, end):
                block_of_layer[layer] = n

        def check(name: str, blocks: Sequence[int]) -> set[int]:
            bad = [b for b in blocks if not 0 <= b < num_blocks]
            if bad:
                raise InputError(
                    f"RouterConfig.{name} has block index(es) {bad}, but this backbone has {num_blocks} blocks "
                    f"({num_layers} layers, blocks of {self.block_size if self.block_starts is None else 'custom'} "
                    f"size): valid indices are 0..{num_blocks - 1}"
                )
            return set(blocks)

        never = check("never_skip_blocks", self.never_skip_blocks) if self.never_skip_blocks is not None else {0, num_blocks - 1}
        outside = [layer for layer in backbone_always_run_layers if not 0 <= layer < num_layers]
        if outside:  # dropped silently before: the layer meant to run always could then be skipped
            raise InputError(f"the backbone spec's never_skip_layers / feature_injection_layers name layer(s) "
                             f"{outside}, but this backbone has {num_layers} layers (0..{num_layers - 1}): fix the "
                             "family's BackboneSpec")
        never |= {block_of_layer[layer] for layer in backbone_always_run_layers}
        candidates = check("skippable_blocks", self.skippable_blocks) if self.skippable_blocks is not None else set(range(num_blocks))
        return BlockLayout(
            num_layers=num_layers,
            block_starts=tuple(starts),
            never_skip_blocks=tuple(sorted(never)),
            skippable_blocks=tuple(sorted(candidates - never)),
        )


@dataclass(frozen=True)
class BlockLayout:
    """Blocks of contiguous layers, and which of them skipping may remove."""

    num_layers: int
    block_starts: tuple[int, ...]
    never_skip_blocks: tuple[int, ...]
    skippable_blocks: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_starts)

    def layers_of_block(self, block: int) -> range:
        end = self.block_starts[block + 1] if block + 1 < self.num_blocks else self.num_layers
        return range(self.block_starts[block], end)

    def layers_of_blocks(self, blocks: Iterable[int]) -> list[int]:
        """The decoder layers of `blocks`, in the order given."""
        return [layer for block in blocks for layer in self.layers_of_block(block)]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
