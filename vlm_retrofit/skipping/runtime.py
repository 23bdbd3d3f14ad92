"""The skip runtime: per-token block decisions, skipped layers as identity with a kv-only cache write."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..backbones import KVPathError, image_positions, layer_hidden_states, unwrap_model
from ..backbones.registry import no_rotary
from ..errors import InputError
from ..routing.adapter import CACHELESS_LAYERS, RouterAdapter
from .accounting import LayerCost, SkipReport, weight_flops
from .policies import SkipPolicy


def kv_only(layer: nn.Module, parts: Any, hidden: Tensor, kwargs: dict) -> None:
    """Write a skipped layer's K/V for `hidden` into the cache: input norm -> k/v proj -> k-norm -> rotary.

    Every layer's cache must grow every step: HF computes the mask's kv-length once per forward from one
    layer's cache, and a missing entry crashes padded batches or silently corrupts the rest (docs/design.md §3).
    """
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return
    rotates = parts.rotary_fn is not no_rotary
    if rotates and kwargs.get("position_embeddings") is None:
        raise KVPathError(f"{type(layer).__name__} was called without position_embeddings (its attention computes "
                        "rotary embeddings itself, as some remote-code models do): a skipped layer's kv-only cache "
                        "path rotates keys with the decoder's (cos, sin), so this family cannot skip blocks")
    attention = parts.attention
    normed = parts.input_norm(hidden)
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    keys = parts.k_proj(normed)
    if parts.k_norm is not None and parts.k_norm_over_projection:
        keys = parts.k_norm(keys)  # OLMoE: one norm over all heads' keys, before they are split
    keys = keys.view(shape)
    if parts.k_norm is not None and not parts.k_norm_over_projection:
        keys = parts.k_norm(keys)  # per-head norm over head_dim: same result before or after the transpose
    keys = keys.transpose(1, 2)
    values = parts.v_proj(normed).view(shape).transpose(1, 2)
    if rotates:
        cos, sin = kwargs["position_embeddings"]
        _, keys = parts.rotary_fn(keys, keys, cos, sin)
    extra = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "position_embeddings", "attention_mask")}
    cache.update(keys, values, attention.layer_idx, kwargs=extra)


def _map_output(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    # transformers 5 layers return a Tensor; older ones a tuple whose first item is the hidden state.
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    return fn(output)


def key_padding_mask(mask: Any, batch: int, length: int, window: int | None = None) -> Tensor | None:
    """[batch, length], zero / False at padding, over the cache and a forward's tokens, from the top model's
    attention mask: the 2-D one as it is (no copy on the decode path), or the 4-D ones `generate` builds with a
    static cache (a tensor, or a dict by attention type), read from the last query row, which sees every real token
    before it and itself, and no padding. A model whose every layer attends over a sliding `window` has no
    full-attention mask: its row is read only while the window holds every position (beyond, the positions it
    leaves out would read as padding). None when the mask says nothing of the padding."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", mask.get("sliding_attention"))
    if not isinstance(mask, Tensor) or mask.shape[0] != batch:
        return None
    if mask.dim() == 2:
        return mask if mask.shape[1] == length else None
    if mask.dim() != 4 or mask.shape[-1] < length or (window is not None and length > window):
        return None
    row = mask[:, 0, -1, :length]
    # Additive float masks hold 0 where attended and the dtype's minimum where not.
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


class SkipController:
    """Context manager that lets a policy skip blocks per token while the model runs.

    Inside the context, each skippable block's layers are patched (on the instances, restored on exit):
    * every token runs → the original layer;
    * every token skips → identity, plus the kv-only cache write (no other work: compute really saved);
    * mixed → run and select with `where(skip, input, layer(input))` — the same function a no-cache
      reference applies, so cached and uncached generation agree (invariant 2). The layer's MLP (the spec's
      `mlp_attr`, position-wise) runs on the running tokens only: the skipping ones' outputs are discarded, and
      attention writes their K/V from the layer's input as the kv-only path does.
    A skipped block's delta is *absent* for that token in later routers (masked, not a zero source).
    With stand-ins (`RouterConfig.skip_stand_in`) a skipping token gets its layers' stand-ins instead of their input
    (`where(skip, stand_in(input), layer(input))` in every path above) and the block's delta stays present: the
    stand-ins wrote it. Their matrix products count in the executed FLOPs.
    """

    mode = "select"
    kv_only_when_all_skip = True
    """False runs fully skipped steps through the real layer and selects, as a reference for the kv-only path."""
    sparse_mlp = True
    """False runs a mixed block's MLP over every token, as a reference for the sparse path (and for training, whose
    straight-through gradient reads the layer's output at the skipping tokens too), and its stand-ins over every
    token (True: at the skipping tokens only)."""

    def __init__(self, adapter: RouterAdapter, policy: SkipPolicy | None = None, *, budget: int | float | None = None) -> None:
        self.adapter = adapter
        self.layout = adapter.layout
        self.policy = policy
        self.budget = resolve_budget(budget, len(self.layout.skippable_blocks))
        self.skippable = frozenset(self.layout.skippable_blocks)
        self.reads_gates = bool(getattr(policy, "reads_gates", False))
        """Whether the policy reads the adapter's skip gates (the adapter then evaluates them as it routes)."""
        if policy is not None:
            policy.validate(self.layout, adapter)
        self.report = SkipReport(num_blocks=self.layout.num_blocks, policy=getattr(policy, "name", ""),
                                 block_layers=[len(self.layout.layers_of_block(b)) for b in range(self.layout.num_blocks)])
        self.costs = LayerCost.per_layer(adapter.spec.get_text_config(adapter.model), self.layout.num_layers,
                                         adapter.spec.get_layers(adapter.model), adapter.spec.attention_attr)
        """One cost per decoder layer (sliding-window layers attend over their window only)."""
        windows = [cost.sliding_window for cost in self.costs]
        self._mask_window = None if None in windows else min(windows)
        """The window of a model whose every layer slides: its 4-D masks show padding only within it."""
        self._skip: dict[int, Tensor | None] = {}
        self._none_ran: set[int] = set()
        """Blocks that every token skips in this forward (their delta is dropped from the stream)."""
        self.cacheless_blocks = self._cacheless_blocks(adapter, policy)
        """Blocks no token runs while this context lasts: identity (or their stand-ins) with no cache write at all."""
        self._stand_ins = {int(layer): module for layer, module in adapter.stand_ins.items()}
        """Decoder layer index -> its stand-in (`RouterConfig.skip_stand_in`); empty without them."""
        self.stand_in_blocks = frozenset(b for b in self.skippable
                                         if all(i in self._stand_ins for i in self.layout.layers_of_block(b)))
        """Skippable blocks whose layers all have stand-ins: a token skipping them still writes a delta."""
        self.bypassed_blocks = self.cacheless_blocks - self.stand_in_blocks
        """Blocks whose routed input nothing reads (`bypasses`): no token runs them, and no stand-in computes from
        it."""
        self._context_length = 0
        """Tokens already in the cache when the current forward began."""
        self._used: Tensor | None = None
        # Only the layers of blocks the policy can skip go through the patched forward; the rest run untouched.
        self.patched_blocks = tuple(policy.may_skip(self.layout)) if policy is not None else self.layout.skippable_blocks
        patched_layers = {i for b in self.patched_blocks for i in self.layout.layers_of_block(b)}
        # The unpatched layers' costs, counted by kind (full / sliding attention): summed once per forward at decode.
        self._unpatched_costs = Counter(self.costs[i] for i in range(self.layout.num_layers) if i not in patched_layers)
        self._restore: list[tuple[nn.Module, Any]] = []
        self._mlp_flops: dict[int, int] = {}
        """Per patched layer index whose position-wise MLP runs on the running rows only: its FLOPs per token."""
        self._mlp_rows: Tensor | None = None
        """The run mask [B, T] of the mixed block running now, read by its patched MLP; None outside one."""
        self._mlp_spared = 0
        """Rows the patched MLP left out in the mixed block running now."""
        self._started = 0.0
        self._image_ids = torch.tensor(sorted(adapter.spec.image_token_ids(unwrap_model(adapter.model).config)))
        self._token_is_image: Tensor | None = None
        self._attention_mask: Any = None
        """The top model's attention mask in its current call as given (2-D, or 4-D masks with a static cache);
        `key_padding_mask` reads the padding from it."""
        self._continues_cache: bool | None = None
        """Whether the current call of the top model was given a KV cache (generate passes one from its prefill
        on; a teacher-forced call does not); None when the decoder was called without the top model."""
        self._real_tokens: int | None = None
        self._text_positions: Tensor | None = None
        """Bool [B, T] of real text positions in this forward; None when it holds no visual placeholder."""
        self._text_tokens: int | None = None

    def _cacheless_blocks(self, adapter: RouterAdapter, policy: SkipPolicy | None) -> frozenset[int]:
        """The policy's always-skipped blocks whose empty cache nothing reads.

        Under a budget only the first `budget` of them are skipped (in block order, the same for every token).
        HF sizes masks from the cache of layer 0 and of the first layer of each attention type (sliding
        window, full), so blocks holding one of those keep the kv-only write.
        """
        removed = sorted(policy.removed_blocks()) if policy is not None else []
        if self.budget is not None:
            removed = removed[: self.budget]
        config = adapter.spec.get_text_config(adapter.model)
        if getattr(config, "num_kv_shared_layers", 0):  # later layers read earlier layers' caches
            return frozenset()
        layer_types = list(getattr(config, "layer_types", None) or [])
        anchors = {0} | {layer_types.index(kind) for kind in set(layer_types)}
        return frozenset(b for b in removed if not anchors & set(self.layout.layers_of_block(b)))

    # -- context ---------------------------------------------------------------------------------------
    def __enter__(self) -> SkipReport:
        adapter = self.adapter
        if not adapter.attached:
            raise RuntimeError("skipping needs an attached adapter")
        adapter._set_controller(self)
        layers = adapter.spec.get_layers(adapter.model)
        try:
            top = unwrap_model(adapter.model)
            self._restore.append((top.register_forward_pre_hook(self._capture_input_ids, with_kwargs=True), None))
            self._restore.append((top.register_forward_hook(self._forget_input_ids), None))
            for block in self.patched_blocks:
                for index in self.layout.layers_of_block(block):
                    self._patch(block, index, layers[index])
        except BaseException:
            self._unpatch()
            adapter._set_controller(None)
            raise
        self._started = time.perf_counter()
        return self.report

    def __exit__(self, *exc: Any) -> None:
        self.report.wall_seconds += time.perf_counter() - self._started
        self._unpatch()
        self.adapter._set_controller(None)
        self._skip.clear()

    def _patch(self, block: int, index: int, layer: nn.Module) -> None:
        original = layer.forward  # bound method of the class (or an earlier instance patch)
        parts = self.adapter.spec.attention_parts(layer)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._layer_forward(block, index, layer, parts, original, args, kwargs)

        self._patch_forward(layer, forward)
        spec = self.adapter.spec
        mlp = getattr(layer, spec.mlp_attr, None) if spec.mlp_attr and self.sparse_mlp else None
        if isinstance(mlp, nn.Module):  # costed once per context (training makes one per step, without it)
            self._mlp_flops[index] = weight_flops(mlp, spec.get_text_config(self.adapter.model))
            self._patch_forward(mlp, self._rows_only(mlp.forward))

    def _patch_forward(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Give `module` an instance `forward` for the context; `_unpatch` restores the one it had."""
        self._restore.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def _rows_only(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """An MLP's forward that, while a mixed block runs (`_mlp_rows` set), computes the running rows only."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._mlp_rows is None:
                return original(*args, **kwargs)
            output, spared = rows_only(original, self._mlp_rows, args, kwargs)
            self._mlp_spared += spared
            return output

        return forward

    def _capture_input_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # Which positions are visual placeholders: per-modality thresholds need it at every layer.
        # None when there is none (every decode step): per-modality rules then cost no work per block.
        self._token_is_image = image_positions(kwargs.get("input_ids", args[0] if args else None), self._image_ids)
        self._attention_mask = kwargs.get("attention_mask")  # made a 2-D key mask in begin_forward
        self._continues_cache = any(kwargs.get(name) is not None for name in ("past_key_values", "cache"))

    def _forget_input_ids(self, module: nn.Module, args: tuple, output: Any) -> None:
        # The capture describes one call of the top model: a later forward that does not pass through it (the
        # decoder called directly) must not take its image positions or padding.
        self._token_is_image = self._continues_cache = self._attention_mask = None

    def _unpatch(self) -> None:
        for layer, previous in reversed(self._restore):
            if isinstance(layer, torch.utils.hooks.RemovableHandle):
                layer.remove()
            elif previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous
        self._restore.clear()

    # -- adapter callbacks -----------------------------------------------------------------------------
    def begin_forward(self, state: Any) -> None:
        tokens_shape = state.stack.shape[:-1]
        if self._token_is_image is not None and self._token_is_image.shape == tokens_shape:
            state.token_is_image = self._token_is_image
        mask = key_padding_mask(self._attention_mask, tokens_shape[0], state.context_length + tokens_shape[1],
                                self._mask_window)
        if mask is not None:
            state.attention_mask = mask
            if state.context_length == 0:  # decode steps hold no padding: no per-block masking work there
                state.token_is_real = mask.bool()
        self._skip.clear()
        self._none_ran.clear()
        self._used = None
        self._real_tokens = self._text_tokens = None
        image, real = state.token_is_image, state.token_is_real
        self._text_positions = None if image is None else (~image if real is None else real & ~image)
        self._context_length = state.context_length  # a removed layer's own cache stays empty: not its length
        self._count_forward(tokens_shape[0], tokens_shape[1], self._context_length)

    def decide(self, block: int, state: Any) -> None:
        self._skip[block] = None
        if block not in self.skippable or self.policy is None:
            return
        if block in self.cacheless_blocks:  # every token skips it, by the policy's own declaration
            if self.budget is not None:
                self._apply_budget(torch.ones(state.stack.shape[:-1], dtype=torch.bool, device=state.stack.device))
            self._none_ran.add(block)
            self._record_decision(block, state, None, everyone=True)
            return
        if block not in self.patched_blocks:  # the policy never skips it (its layers are not even patched)
            self._record_decision(block, state, None)
            return
        skip = self.policy.skip_mask(block, state, self.adapter)
        if skip is not None and not self.policy.skip_image_positions and state.token_is_image is not None:
            skip = skip & ~state.token_is_image  # visual placeholders run every block
        skip = self._apply_budget(skip)
        if skip is None:
            self._record_decision(block, state, None)
            return
        skipped = self._record_decision(block, state, skip)
        # Settle "nobody skips" and "everybody skips" once per block: the layer and the stream take fast paths.
        # Only real tokens decide: a padding position's output is nobody's (attention masks its K/V, which the
        # kv-only path still writes), so its decision must not hold a batch off either path.
        if skipped == 0:
            skip = None
        elif skipped == self._real_tokens:
            self._none_ran.add(block)
        self._skip[block] = skip

    def _read_skip_counts(self, skip: Tensor, state: Any) -> tuple[int, int]:
        """(real tokens skipping, real text tokens skipping) of one block's decision, in one read from the device.

        On CUDA every read waits for the GPU: the fast paths' any / all, the report's counts and the forward's
        token counts come back together instead of one wait each.
        """
        real, text = state.token_is_real, self._text_positions
        if real is None and text is None:  # every position is real text (a decoding step): one count
            skipped = int(skip.sum())
            if self._real_tokens is None:
                self._real_tokens = self._text_tokens = skip.numel()
            return skipped, skipped
        counts = {"real": (skip & real).sum() if real is not None else skip.sum()}
        counts["text"] = (skip & text).sum() if text is not None else counts["real"]
        if self._real_tokens is None:
            if real is not None:
                counts["real_tokens"] = real.sum()
            if text is not None:
                counts["text_tokens"] = text.sum()
        values = dict(zip(counts, torch.stack(list(counts.values())).tolist()))
        if self._real_tokens is None:
            self._real_tokens = values.get("real_tokens", skip.numel())
            self._text_tokens = values.get("text_tokens", self._real_tokens)
        return values["real"], values["text"]

    def _record_decision(self, block: int, state: Any, skip: Tensor | None, *, everyone: bool = False) -> int:
        """Skip rates count real tokens only: padding positions are computed but are nobody's output (and apart,
        real text tokens). Returns how many real tokens skip (`skip` None: none, or all with `everyone`, which the
        caller knows)."""
        if skip is not None:
            skipped_real, skipped_text = self._read_skip_counts(skip, state)
            self.report.record_decision(block, self._real_tokens, skipped_real, self._text_tokens, skipped_text)
            return skipped_real
        if self._real_tokens is None:  # once per forward: the same for every block
            real, text = state.token_is_real, self._text_positions
            self._real_tokens = int(real.sum()) if real is not None else state.routed_input.shape[:-1].numel()
            self._text_tokens = int(text.sum()) if text is not None else self._real_tokens
        self.report.record_decision(block, self._real_tokens, self._real_tokens if everyone else 0,
                                    self._text_tokens, self._text_tokens if everyone else 0)
        return 0

    def _apply_budget(self, skip: Tensor | None) -> Tensor | None:
        if skip is None or self.budget is None:
            return skip
        if self._used is None:
            self._used = torch.zeros(skip.shape, dtype=torch.int32, device=skip.device)
        skip = skip & (self._used < self.budget)
        self._used += skip.to(torch.int32)
        return skip

    def skipped_layer_cost(self, layer: int, writes_cache: bool) -> float:
        """What a token still spends on decoder layer `layer` when it skips it, as a share of the layer's
        context-free FLOPs: its stand-in's product (where it has one) and, with `writes_cache`, the kv-only write
        later tokens read (a per-token skip at decode writes it; a block removed for the whole context does not)."""
        cost = self.costs[layer]
        stand_in = self._stand_ins.get(layer)
        spent = (stand_in.flops_per_token() if stand_in is not None else 0) + (cost.kv_projection if writes_cache else 0)
        return spent / cost.dense

    @property
    def cacheless_layers(self) -> frozenset[int]:
        """Layer indices of `cacheless_blocks`: a cache filled here holds no K/V for them."""
        return frozenset(i for b in self.cacheless_blocks for i in self.layout.layers_of_block(b))

    def bypasses(self, block: int) -> bool:
        """True when nothing reads `block`'s routed input (`bypassed_blocks`): the adapter does not even route it."""
        return block in self.bypassed_blocks

    def ran(self, block: int) -> Tensor | bool | None:
        """Bool [B, T] mask of the tokens whose delta of `block` is present in this forward (None: every token's;
        False: none): those that ran it, or every token where its stand-ins wrote the skipping tokens' delta."""
        if block in self.stand_in_blocks:
            return None
        if block in self._none_ran:
            return False
        skip = self._skip.get(block)
        return None if skip is None else ~skip

    def _count_forward(self, batch: int, new_tokens: int, past: int) -> None:
        """Once per forward: its tokens, and the full cost of the layers that are not patched (they always run)."""
        phase = self.report.phase(past == 0)
        phase.forwards += 1
        phase.tokens += batch * new_tokens
        # Each forward of generate (given its cache from the prefill on) yields one token per row; a teacher-forced
        # call of the model yields none. Called without the top model, the forward is taken for a generation step.
        if self._continues_cache is not False:
            self.report.generated_tokens += batch
        always = sum(cost.full(batch, new_tokens, past + new_tokens) * n for cost, n in self._unpatched_costs.items())
        phase.executed_flops += always
        phase.full_flops += always

    # -- the patched layer -----------------------------------------------------------------------------
    def _layer_forward(self, block: int, index: int, layer: nn.Module, parts: Any, original: Callable, args: tuple,
                       kwargs: dict) -> Any:
        if not self.adapter.enabled:  # e.g. the distillation teacher: the plain layer, outside the report
            return original(*args, **kwargs)
        hidden = layer_hidden_states(args, kwargs)
        skip = self._skip.get(block)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        batch, new_tokens = hidden.shape[0], hidden.shape[1]
        past = self._context_length
        is_prefill = past == 0
        cost = self.costs[index]
        full = cost.full(batch, new_tokens, past + new_tokens)
        if block in self.cacheless_blocks:
            skipped, stand_in_flops = self._skipped_output(index, hidden)
            if not getattr(cache, "offloading", False):
                _mark_cacheless(cache, parts.attention.layer_idx)
                self.report.record_layer("skipped", stand_in_flops, full, is_prefill)
                return skipped
            # An offloading cache prefetches layer i + 1 when layer i writes: every layer keeps writing.
            kv_only(layer, parts, hidden, kwargs)
            self.report.record_layer("kv_only", cost.kv_only(batch, new_tokens) + stand_in_flops, full, is_prefill)
            self.report.kv_only_layers.add(index)
            return skipped
        if skip is None:
            self.report.record_layer("full", full, full, is_prefill)
            return original(*args, **kwargs)
        if self.kv_only_when_all_skip and block in self._none_ran:  # every token skips: kv-only, nothing else
            kv_only(layer, parts, hidden, kwargs)
            skipped, stand_in_flops = self._skipped_output(index, hidden)
            kind = "kv_only" if cache is not None else "skipped"
            executed = cost.kv_only(batch, new_tokens) if cache is not None else 0
            self.report.record_layer(kind, executed + stand_in_flops, full, is_prefill)
            if cache is not None:
                self.report.kv_only_layers.add(index)
            return skipped
        skipped, stand_in_flops = self._skipped_output(index, hidden, skip if self.sparse_mlp else None)
        mlp_flops = self._mlp_flops.get(index)
        if mlp_flops is None:
            self.report.record_layer("mixed", full + stand_in_flops, full, is_prefill)
            return _map_output(original(*args, **kwargs), lambda out: self._combine(block, skipped, out, skip))
        self._mlp_rows, self._mlp_spared = ~skip, 0
        try:
            output = original(*args, **kwargs)
        finally:
            self._mlp_rows = None
        self.report.record_layer("mixed", full - self._mlp_spared * mlp_flops + stand_in_flops, full, is_prefill)
        return _map_output(output, lambda out: self._combine(block, skipped, out, skip))

    def _skipped_output(self, index: int, hidden: Tensor, rows: Tensor | None = None) -> tuple[Tensor, int]:
        """What a token skipping layer `index` leaves in the stream (its input `hidden`, or its stand-in's output
        from it), and the FLOPs that took: over every row, or with `rows` (bool [B, T]) at those rows only (the
        others keep `hidden`; in a prefill few tokens skip, and a product over every row would cost more than the
        skips save)."""
        stand_in = self._stand_ins.get(index)
        if stand_in is None:
            return hidden, 0
        eps = self.adapter.config.key_norm_eps
        if rows is None:
            return stand_in(hidden, eps), stand_in.flops_per_token() * hidden.shape[0] * hidden.shape[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        picked = rows.reshape(-1).nonzero().squeeze(1)
        out = flat.index_copy(0, picked, stand_in(flat.index_select(0, picked), eps)).reshape(hidden.shape)
        return out, stand_in.flops_per_token() * picked.numel()

    def _combine(self, block: int, skipped: Tensor, out: Tensor, skip: Tensor) -> Tensor:
        """The layer's output where a token runs it, `skipped` (`_skipped_output`) where it skips."""
        return torch.where(skip[..., None], skipped, out)


def rows_only(mlp_forward: Callable[..., Any], run: Tensor, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """Call `mlp_forward` on the rows of its hidden states (the first positional argument, of `run`'s shape [B, T]
    before the hidden size) where `run` is True only, as one [1, N, D] call, with zeros at the other rows; returns
    the output and how many rows it spared. Exact for a position-wise MLP at the rows computed. A call of another
    shape (or without positional hidden states) runs as it is and spares none."""
    hidden = args[0] if args else None
    if not isinstance(hidden, Tensor) or hidden.shape[:-1] != run.shape:
        return mlp_forward(*args, **kwargs), 0
    rows = run.reshape(-1).nonzero().squeeze(1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    output = mlp_forward(flat.index_select(0, rows).unsqueeze(0), *args[1:], **kwargs)
    computed = output[0] if isinstance(output, tuple) else output  # a mixture may add its router logits
    scattered = computed.new_zeros(flat.shape[0], computed.shape[-1])
    scattered.index_copy_(0, rows, computed.reshape(-1, computed.shape[-1]))
    scattered = scattered.view(*hidden.shape[:-1], computed.shape[-1])
    spared = flat.shape[0] - rows.numel()
    return ((scattered, *output[1:]) if isinstance(output, tuple) else scattered), spared


def _mark_cacheless(cache: Any, layer_idx: int) -> None:
    """Note on the cache that `layer_idx` wrote nothing, so that a forward running that layer later is refused.

    An attached adapter refuses such a forward before any layer runs (`RouterAdapter._check_cache`). With the
    routers detached nothing checks, so the empty cache layer itself refuses to be written: attending over a
    cache that holds only the newest token would be silently wrong.
    """
    if cache is None:
        return
    marked = getattr(cache, CACHELESS_LAYERS, frozenset())
    if layer_idx in marked:
        return
    setattr(cache, CACHELESS_LAYERS, marked | {layer_idx})
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and layer_idx < len(layers):
        layers[layer_idx].update = _refuse_update(layer_idx)  # an instance attribute: this cache only


def _refuse_update(layer_idx: int) -> Callable[..., Any]:
    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"layer {layer_idx} of this KV cache holds no K/V: the cache was filled under static removal of that "
            "layer. Continue it only under the same static skipping with the routers attached, or start a new cache"
        )

    return update


def resolve_budget(budget: int | float | None, skippable: int) -> int | None:
    """Per-token skip budget: an int is a number of blocks, a float in (0, 1) a fraction of the skippable ones."""
    if budget is None:
        return None
    if isinstance(budget, float) and 0 < budget < 1:
        if int(budget * skippable) == 0:  # would turn every skip off without a word
            raise InputError(f"skip budget {budget} of {skippable} skippable blocks is less than one block per token: "
                             f"give at least {1 / skippable:.3f}, or a block count")
        return int(budget * skippable)
    if budget < 0 or int(budget) != budget:
        raise InputError(f"skip budget must be a block count >= 0 or a fraction in (0, 1), got {budget}")
    return int(budget)


def skipping(adapter: RouterAdapter, policy: str | SkipPolicy = "recent_weight", *, budget: int | float | None = None,
             target_saving: float | None = None, **policy_kwargs: Any) -> SkipController:
    """Build the skip context behind `adapter.skipping(...)`; see `RouterAdapter.skipping`."""
    from .policies import make_policy

    if isinstance(policy, SkipPolicy):
        if policy_kwargs or target_saving is not None:
            raise ValueError("pass either a SkipPolicy instance or a policy name with its settings, not both")
        return SkipController(adapter, policy, budget=budget)
    if target_saving is not None:
        calibrated = adapter.calibration.get(policy, {})
        key = f"{float(target_saving):.4f}"
        if key not in calibrated:
            stored = {name: sorted(float(t) for t in targets)
                      for name, targets in adapter.calibration.items() if targets}
            raise InputError(
                f"no {policy!r} calibration for target_saving={target_saving} on this adapter (stored: "
                f"{stored or 'none'}). Calibrate it first (`python -m vlm_retrofit calibrate --policy {policy} "
                f"--target-saving {target_saving}`, or vlm_retrofit.calibrate in Python), or give thresholds")
        policy_kwargs = {**calibrated[key], **policy_kwargs}
    return SkipController(adapter, make_policy(policy, **policy_kwargs), budget=budget)
