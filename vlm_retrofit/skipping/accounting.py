"""SkipReport: decoder-block compute counted from what actually ran (kv-only cost, context length and sliding windows included)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from torch import nn


@dataclass(frozen=True)
class LayerCost:
    """FLOPs of one decoder layer per token, from config dimensions (multiply-adds count as 2)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    """The MLP width a token runs; None where the config declares none (then only `dense_flops` can count it)."""
    mlp_matrices: int = 3  # gated MLP: gate, up, down
    sliding_window: int | None = None
    """Keys a query attends to at most (itself included), as HF's sliding-window mask; None: the whole context."""
    dense_flops: int | None = None
    """The layer's context-free FLOPs per token measured from its weights (`per_layer` given the layers), in place of
    the config formula of `dense`: a mixture of experts or a convolution layer is not what the config's sizes say."""
    attends: bool = True
    """False for a layer without attention (a hybrid's convolution layer): no cost that grows with the context."""

    @classmethod
    def from_config(cls, text_config: Any, layer: int | None = None) -> "LayerCost":
        """The cost of decoder layer `layer` (None: a full-attention layer, whatever the config's pattern)."""
        heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        return cls(
            hidden_size=int(text_config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=_mlp_width(text_config),
            sliding_window=None if layer is None else sliding_window_of(text_config, layer),
        )

    @classmethod
    def per_layer(cls, text_config: Any, num_layers: int, layers: Sequence[nn.Module] | None = None,
                  attention_attr: str = "self_attn") -> "list[LayerCost]":
        """One cost per decoder layer: sliding-window layers attend over at most their window. Given the `layers`,
        each one's context-free cost is measured from its weights (`weight_flops`), and a layer without the
        attention module `attention_attr` has no attention cost."""
        costs = [cls.from_config(text_config, layer) for layer in range(num_layers)]
        if layers is None:
            return costs
        return [replace(cost, dense_flops=weight_flops(layer, text_config),
                        attends=getattr(layer, attention_attr, None) is not None)
                for cost, layer in zip(costs, layers, strict=True)]

    @property
    def kv_projection(self) -> int:
        """k and v projections of one token: all the kv-only path does (norm and rotary are negligible)."""
        return 2 * 2 * self.hidden_size * self.num_kv_heads * self.head_dim

    @property
    def dense(self) -> int:
        """Everything in a layer that does not depend on the context: q/k/v/o projections and the MLP."""
        if self.dense_flops is not None:
            return self.dense_flops
        if self.intermediate_size is None:
            raise ValueError("the config declares no MLP width (intermediate_size, or moe_intermediate_size with "
                             "num_experts_per_tok): count the layers from their weights (LayerCost.per_layer with "
                             "the layers)")
        d, q = self.hidden_size, self.num_heads * self.head_dim
        return 2 * d * q + self.kv_projection + 2 * q * d + self.mlp_matrices * 2 * d * self.intermediate_size

    def attention(self, new_tokens: int, kv_length: int) -> int:
        """Scores and weighted values for `new_tokens` causal queries ending at a context of `kv_length`."""
        if not self.attends:
            return 0
        past = kv_length - new_tokens
        attended = new_tokens * past + new_tokens * (new_tokens + 1) // 2  # query at 0-based position p: p + 1 keys
        window = self.sliding_window
        if window is not None and kv_length > window:
            # Queries past the first `window` positions attend to `window` keys each instead of p + 1.
            first = max(past, window)  # the first query whose causal context exceeds the window
            beyond = kv_length - first
            attended -= beyond * (first + kv_length + 1) // 2 - beyond * window
        return 2 * 2 * self.num_heads * self.head_dim * attended

    def full(self, batch: int, new_tokens: int, kv_length: int) -> int:
        return batch * (new_tokens * self.dense + self.attention(new_tokens, kv_length))

    def kv_only(self, batch: int, new_tokens: int) -> int:
        return batch * new_tokens * self.kv_projection


def _mlp_width(text_config: Any) -> int | None:
    """The width of the MLP one token runs: `intermediate_size`, or where a mixture of experts declares none
    (Qwen3.5-MoE) its experts' width times the experts each token uses, plus the shared expert's; None if neither."""
    width = getattr(text_config, "intermediate_size", None)
    if width:
        return int(width)
    routed = (int(getattr(text_config, "moe_intermediate_size", 0) or 0)
              * int(getattr(text_config, "num_experts_per_tok", 0) or 0))
    return routed + int(getattr(text_config, "shared_expert_intermediate_size", 0) or 0) or None


def _experts_used(text_config: Any) -> tuple[int, int] | None:
    """(experts each token uses, experts) of a mixture-of-experts config; None for a dense one."""
    used = getattr(text_config, "num_experts_per_tok", None)
    total = next((getattr(text_config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                  if getattr(text_config, name, None)), None)
    return (int(used), int(total)) if used and total else None


def weight_flops(layer: nn.Module, text_config: Any) -> int:
    """FLOPs per token of one decoder layer's weights (a multiply-add counts as 2), measured from the layer.

    A linear layer costs in x out (its declared sizes: quantised weights store fewer elements); any other weight of
    two or more dimensions (a convolution's kernel, a mixture's stacked expert matrices) one multiply-add per
    element. Weights under an `experts` module are read by `num_experts_per_tok` of its `num_experts` per token.
    Norms and biases are left out, as in the config formula (`LayerCost.dense`), which this equals on a dense layer.
    """
    experts = _experts_used(text_config)
    total = 0.0
    for name, module in layer.named_modules():
        parts = name.split(".")
        # PEFT's machinery is not the backbone's: an adapter's wrapper (its base layer counts), its LoRA matrices, and
        # a `modules_to_save` wrapper with its trained copies (the original module counts, of the same shape).
        if (hasattr(module, "base_layer") or hasattr(module, "original_module") or "modules_to_save" in parts
                or any(part.startswith("lora_") for part in parts)):
            continue
        share = experts[0] / experts[1] if experts and "experts" in parts else 1.0
        # A linear layer, quantised or not (GPTQ's name their sizes infeatures / outfeatures).
        rows = getattr(module, "in_features", getattr(module, "infeatures", None))
        cols = getattr(module, "out_features", getattr(module, "outfeatures", None))
        if isinstance(rows, int) and isinstance(cols, int):
            total += 2 * rows * cols * share
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2 and not param_name.endswith("bias"):  # a mixture's stacked expert biases are 2-D
                total += 2 * param.numel() * share
    return int(total)


def sliding_window_of(text_config: Any, layer: int) -> int | None:
    """The sliding window of decoder layer `layer`, as HF's attention masks apply it.

    With `layer_types`, only "sliding_attention" layers slide (Gemma 2/3, Qwen2 with `use_sliding_window`);
    without them, a set `sliding_window` applies to every layer (Mistral). Chunked attention counts as full.
    """
    window = getattr(text_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer] == "sliding_attention" else None
    return int(window)


@dataclass
class PhaseCount:
    """FLOPs of one phase (prefill or decode) of generation."""

    executed_flops: int = 0
    full_flops: int = 0
    tokens: int = 0
    forwards: int = 0

    @property
    def compute_saved(self) -> float:
        return 1.0 - self.executed_flops / self.full_flops if self.full_flops else 0.0


@dataclass
class SkipReport:
    """What a skipping context really ran.

    `executed_flops / full_flops` covers decoder blocks only (embeddings, vision tower and LM head are the
    same with and without skipping). A layer counts as executed whenever it ran for any token of the step
    (mixed steps compute and select); a layer skipped by every token costs its kv-only cache write, and a
    layer a static policy removes for the whole context costs nothing (no token ever reads its cache).
    Forwards run with the routers disabled (e.g. a distillation teacher) are not counted. Each layer is costed
    by its own `LayerCost`: a sliding-window layer attends over its window only, so at long contexts skipping a
    full-attention layer saves more.
    """

    num_blocks: int
    policy: str = ""
    block_layers: list[int] = field(default_factory=list)
    """Decoder layers in each block (weights the token-level skip fraction)."""
    prefill: PhaseCount = field(default_factory=PhaseCount)
    decode: PhaseCount = field(default_factory=PhaseCount)
    block_tokens: list[int] = field(default_factory=list)
    block_skipped_tokens: list[int] = field(default_factory=list)
    block_text_tokens: list[int] = field(default_factory=list)
    """Real text tokens (no padding, no visual placeholders) decided per block: what a decode step holds."""
    block_text_skipped_tokens: list[int] = field(default_factory=list)
    layer_calls: dict[str, int] = field(default_factory=lambda: {"full": 0, "mixed": 0, "kv_only": 0, "skipped": 0})
    """Calls of the layers the policy may skip, by what they ran (a static policy's other layers are not
    patched and not counted here; their FLOPs are in the phase counts all the same)."""
    kv_only_layers: set[int] = field(default_factory=set)
    """The decoder layers that wrote K/V through the kv-only path at least once (`check_skip_consistency` asks
    that every kind of attention layer that may skip did)."""
    wall_seconds: float = 0.0
    generated_tokens: int = 0
    """Tokens generated: one per row of each forward that was given a KV cache (every forward of `generate`).
    Teacher-forced calls (no cache passed) count none, so `tokens_per_second` is a generation rate."""

    def __post_init__(self) -> None:
        self.block_layers = self.block_layers or [1] * self.num_blocks
        self.block_tokens = self.block_tokens or [0] * self.num_blocks
        self.block_skipped_tokens = self.block_skipped_tokens or [0] * self.num_blocks
        self.block_text_tokens = self.block_text_tokens or [0] * self.num_blocks
        self.block_text_skipped_tokens = self.block_text_skipped_tokens or [0] * self.num_blocks

    # -- recording (called by the skip runtime) ---------------------------------------------------------
    def phase(self, is_prefill: bool) -> PhaseCount:
        return self.prefill if is_prefill else self.decode

    def record_decision(self, block: int, tokens: int, skipped: int, text_tokens: int | None = None,
                        text_skipped: int | None = None) -> None:
        """Count one block decision: real tokens and how many skipped, and the same over real text tokens
        (default: every real token is text)."""
        self.block_tokens[block] += tokens
        self.block_skipped_tokens[block] += skipped
        self.block_text_tokens[block] += tokens if text_tokens is None else text_tokens
        self.block_text_skipped_tokens[block] += skipped if text_skipped is None else text_skipped

    def record_layer(self, kind: str, executed: int, full: int, is_prefill: bool) -> None:
        self.layer_calls[kind] += 1
        phase = self.phase(is_prefill)
        phase.executed_flops += executed
        phase.full_flops += full

    @classmethod
    def merged(cls, reports: "list[SkipReport]") -> "SkipReport":
        """One report summing several (e.g. one per generate call)."""
        total = cls(num_blocks=reports[0].num_blocks, policy=reports[0].policy, block_layers=list(reports[0].block_layers))
        for report in reports:
            for mine, theirs in ((total.prefill, report.prefill), (total.decode, report.decode)):
                mine.executed_flops += theirs.executed_flops
                mine.full_flops += theirs.full_flops
                mine.tokens += theirs.tokens
                mine.forwards += theirs.forwards
            for name in ("block_tokens", "block_skipped_tokens", "block_text_tokens", "block_text_skipped_tokens"):
                setattr(total, name, [a + b for a, b in zip(getattr(total, name), getattr(report, name))])
            for kind, count in report.layer_calls.items():
                total.layer_calls[kind] += count
            total.kv_only_layers |= report.kv_only_layers
            total.wall_seconds += report.wall_seconds
            total.generated_tokens += report.generated_tokens
        return total

    # -- results ----------------------------------------------------------------------------------------
    @property
    def executed_flops(self) -> int:
        return self.prefill.executed_flops + self.decode.executed_flops

    @property
    def full_flops(self) -> int:
        return self.prefill.full_flops + self.decode.full_flops

    @property
    def compute_saved(self) -> float:
        """1 - executed / full decoder-block FLOPs over the whole context."""
        return 1.0 - self.executed_flops / self.full_flops if self.full_flops else 0.0

    @property
    def skip_rates(self) -> list[float]:
        """Fraction of token decisions that skipped each block (0 for blocks that never skip)."""
        return [s / t if t else 0.0 for s, t in zip(self.block_skipped_tokens, self.block_tokens)]

    @property
    def text_skip_rates(self) -> list[float]:
        """`skip_rates` over real text tokens only (visual placeholders left out)."""
        return [s / t if t else 0.0 for s, t in zip(self.block_text_skipped_tokens, self.block_text_tokens)]

    @property
    def skipped_layer_fraction(self) -> float:
        """Token-level fraction of decoder-layer executions skipped: what batch-1 decoding would save
        before kv-only costs. `compute_saved` is lower in batches and in prefills, where a block only some tokens
        skip saves their MLP only."""
        return self._layer_weighted(self.skip_rates)

    @property
    def skipped_text_layer_fraction(self) -> float:
        """`skipped_layer_fraction` over real text tokens only (visual placeholders left out): decode steps hold
        text tokens only, so this is what a decode skips when image positions skip otherwise than text."""
        return self._layer_weighted(self.text_skip_rates)

    def _layer_weighted(self, rates: list[float]) -> float:
        layers = sum(self.block_layers)
        return sum(rate * n for rate, n in zip(rates, self.block_layers)) / layers if layers else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "compute_saved": self.compute_saved,
            "compute_saved_prefill": self.prefill.compute_saved,
            "compute_saved_decode": self.decode.compute_saved,
            "executed_flops": self.executed_flops,
            "full_flops": self.full_flops,
            "skip_rates": self.skip_rates,
            "text_skip_rates": self.text_skip_rates,
            "skipped_layer_fraction": self.skipped_layer_fraction,
            "skipped_text_layer_fraction": self.skipped_text_layer_fraction,
            "layer_calls": dict(self.layer_calls),
            "prefill_tokens": self.prefill.tokens,
            "decode_tokens": self.decode.tokens,
            "generated_tokens": self.generated_tokens,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }

    def summary(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.skip_rates)
        return (
            f"decoder-block compute saved {100 * self.compute_saved:.1f} % "
            f"(prefill {100 * self.prefill.compute_saved:.1f} %, decode {100 * self.decode.compute_saved:.1f} %); "
            f"{self.generated_tokens} tokens in {self.wall_seconds:.2f} s ({self.tokens_per_second:.1f} tok/s); "
            f"skip rate per block: {rates}"
        )
