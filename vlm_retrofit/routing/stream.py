"""The depth stream of one forward pass: its sources, their normalised keys and presence masks."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Callable

import torch
from torch import Tensor

from . import native
from .router import inverse_rms, rms_normalize


class SourceStack:
    """The sources written to the stream so far (s_0 = decoder input, then one delta per block).

    A source no token has (its block was skipped by every token) is `drop`ped rather than stored as an
    all-absent entry: it would take no weight and count nothing, so leaving it out is the same function
    with less work. Stored sources keep their slot number (`slot_index`) so source biases stay aligned.

    Two layouts, the same values:
    * `buffered` (decoding and short prompts: no autograd, few tokens): each block's delta is written once, by the
      subtraction itself, into a preallocated fp32 [capacity, tokens, d] buffer whose first K slots are contiguous, with its
      inverse RMS beside it. A router scores all sources with one matrix-vector product and mixes them with one
      more (a multiply-sum for several tokens). Re-stacking a growing list (or a normalised copy of it) at every
      block costs more memory traffic than the routing itself. On fp32 CPU streams a layer's push and router are
      one call into the fused kernels (`routing.native`), or one call each under a skip policy.
    * listed (training, prefill): per-source tensors, never a [K, B, T, d] copy of the stream; in-place buffer
      writes would break autograd.
    """

    buffer_max_tokens = 64
    """Forwards with at most this many tokens (batch x length) and no autograd use the buffered layout.

    Longer inputs (prefill) keep the listed layout. Its sequential sum is the residual stream's own order: on
    SmolLM2, whose activations reach ~25,000, a multiply-sum over the source axis moved identity at init from
    7e-5 to 1e-4 over a real prompt, the invariant's limit. A buffered layout mixing source by source kept the
    identity but was no faster in prefill (768 tokens: ~1.2x the base vs ~1.15x listed)."""

    native_max_tokens = 768
    """The same limit where the fused kernels take the stream (fp32 on CPU). They mix source by source in the
    stream's order, so identity holds at any length, on one thread. Until 2026-12-04 they fell behind the listed
    layout from ~192 tokens (limit 96); since their stream memory is kept between forwards and each router reads its
    sources once, a batch-8 caption prefill (672 tokens, SmolLM2, block size 1) routes through them in 83 ms of hooks
    against 113 ms listed (alternating calls). The kept memory is the largest stream's: ~110 MB at 768 tokens there."""

    def __init__(self, first: Tensor, capacity: int, eps: float, buffers: native.StreamBuffers | None = None) -> None:
        self.shape = first.shape
        self.dtype = first.dtype
        self.eps = eps
        tokens, width = first.shape[:-1].numel(), first.shape[-1]
        use_native = not torch.is_grad_enabled() and native.usable(first)
        self.buffered = (not torch.is_grad_enabled()
                         and tokens <= (self.native_max_tokens if use_native else self.buffer_max_tokens))
        self._count = 0
        self.device = first.device
        self._slots: list[int] | None = None
        """The slot of each stored source, once one was dropped (until then source i is slot i)."""
        self._dropped = 0
        self._slot_index: Tensor | None = None
        self.any_absent = False
        """Whether some stored source is absent for some token (else presence masks are all True)."""
        self._present: Tensor | list[Tensor | None]
        if self.buffered:
            if use_native:  # in memory kept between forwards where `buffers` is given (`native.StreamBuffers`)
                self._values = native.stream_buffer(buffers, "values", (capacity, tokens, width), torch.float32)
                self._inv_rms = native.stream_buffer(buffers, "inv_rms", (capacity, tokens), torch.float32)
                self._present = native.stream_buffer(buffers, "present", (capacity, tokens), torch.bool).fill_(True)
            else:
                self._values = first.new_empty((capacity, tokens, width), dtype=torch.float32)
                self._inv_rms = first.new_empty((capacity, tokens), dtype=torch.float32)
                self._present = torch.ones((capacity, tokens), dtype=torch.bool, device=first.device)
            self.native = (native.NativeStream(self._values, self._inv_rms, self._present, first.shape, eps, buffers)
                           if use_native else None)
            """Fused C kernels for delta pushes and routers (`routing.native`), on buffered fp32 CPU streams."""
        else:
            self.native = None
            self._values_list: list[Tensor] = []
            self._keys_list: list[Tensor] = []
            self._present = []
        self.push(first)

    def restart(self, first: Tensor) -> bool:
        """Start another forward on this stream's buffers with `first` as s_0, where that forward has the last one's
        shape and the fused kernels took both, and no tensor the last one handed out is held anywhere (see
        `NativeStream.restart`). False, with nothing changed, otherwise: then build a new stack."""
        if (self.native is None or torch.is_grad_enabled() or first.shape != self.shape or first.dtype != self.dtype
                or first.device != self.device or not self.native.restart()):
            return False
        if self.any_absent:
            self._present.fill_(True)
        self._count = self._dropped = 0
        self._slots = self._slot_index = None
        self.any_absent = False
        self.push(first)
        return True

    @cached_property
    def zero(self) -> Tensor:
        """A 0-d fp32 zero: the ignored `input` of the PyTorch routers' addmm (beta = 0)."""
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def __len__(self) -> int:
        """Number of stored sources (K of the next router)."""
        return self._count

    @property
    def num_slots(self) -> int:
        """Sources written so far, dropped ones included."""
        return self._count + self._dropped

    def drop(self) -> None:
        """Record a source that no token has: its slot is used up, nothing is stored."""
        if self._slots is None:
            self._slots = list(range(self._count))
        self._dropped += 1
        self._slot_index = None

    def slot_index(self) -> Tensor | None:
        """Long [K]: the slot of each stored source, or None while none was dropped (slot i = position i)."""
        if not self._dropped:
            return None
        if self._slot_index is None:
            self._slot_index = _slot_tensor(tuple(self._slots), self.device)
        return self._slot_index

    def expand(self, alpha: Tensor, num_slots: int) -> Tensor:
        """A router's weights over the stored sources [K, ...] -> over its `num_slots` sources, 0 at dropped ones."""
        index = self.slot_index()
        if index is None or alpha.shape[0] == num_slots:
            return alpha
        full = alpha.new_zeros((num_slots, *alpha.shape[1:]))
        return full.index_copy_(0, index[: alpha.shape[0]], alpha)

    def push(self, source: Tensor, present: Tensor | None = None) -> None:
        """Append a source [B, T, d]; `present` is a bool [B, T] mask of the tokens that have it (None = all)."""
        if self.buffered:
            if self.native is not None and self.native.push_source(self._count, source):
                self._mark_buffered(present)  # the kernel copied it and wrote its inverse RMS
                return
            self._values[self._count] = source.reshape(-1, source.shape[-1])
            self._push_buffered(present)
        else:
            self._push_listed(source, present)

    def push_delta(self, output: Tensor, routed_input: Tensor, present: Tensor | None = None) -> None:
        """Append a block's delta, `output - routed_input` ([B, T, d] each), computed in the stream's dtype."""
        if self.buffered:
            if self.native is not None and self.native.push_delta(self._count, output, routed_input):
                self._mark_buffered(present)  # the kernel wrote the delta and its inverse RMS
                return
            width = output.shape[-1]
            if output.shape != self.shape or routed_input.shape != self.shape:
                # `out=` would resize the buffer's storage to fit, under the fused kernels' pointers into it.
                raise RuntimeError(f"a block's output {tuple(output.shape)} and routed input {tuple(routed_input.shape)} "
                                   f"do not match its stream {tuple(self.shape)}: does a hook on a decoder layer "
                                   "return a value (which replaces the layer's output)?")
            # The subtraction writes straight into the buffer: no temporary, no copy.
            torch.sub(output.reshape(-1, width), routed_input.reshape(-1, width), out=self._values[self._count])
            self._push_buffered(present)
        else:
            self._push_listed(output - routed_input, present)

    def push_delta_and_route(self, output: Tensor, routed_input: Tensor, params: native.KernelParams | None,
                             gate: native.KernelParams | None = None) -> int | None:
        """`push_delta` of a delta every token has, then a router (its `params`, and the skip `gate` of the block it
        feeds where given) over all sources, in one fused call (`routing.native`): the row of `native` holding the
        router's output, weights and gate probability.

        None, with nothing pushed, where that call does not apply (no fused kernels, unusual inputs): then push and
        route apart."""
        if self.native is None:
            return None
        num_slots = self.num_slots + 1
        # After a dropped source the kernel maps stored sources to their biases by slot, this one's included.
        slot_index = _slot_tensor((*self._slots, num_slots - 1), self.device) if self._dropped else None
        row = self.native.push_route(self._count, output, routed_input, self.any_absent, params, num_slots,
                                     slot_index, gate)
        if row is not None:
            self._pushed(None)
        return row

    def route_fused(self, params: native.KernelParams | None, gate: native.KernelParams | None = None) -> int | None:
        """A router (its `params`, and the skip `gate` of the block it feeds where given) over every stored source in
        one fused call: the row of `native` holding its output, as `push_delta_and_route`. None where the kernels
        do not apply (then the router's PyTorch ops)."""
        if self.native is None:
            return None
        return self.native.route(self._count, self.num_slots, self.any_absent, params, self.slot_index(), gate)

    def _push_buffered(self, present: Tensor | None) -> None:
        i = self._count
        inverse_rms(self._values[i], self.eps, out=self._inv_rms[i])
        self._mark_buffered(present)

    def _mark_buffered(self, present: Tensor | None) -> None:
        if present is not None:
            self._present[self._count] = present.reshape(-1)
        self._pushed(present)

    def _push_listed(self, source: Tensor, present: Tensor | None) -> None:
        self._values_list.append(source)
        self._keys_list.append(rms_normalize(source, self.eps))
        self._present.append(present)
        self._pushed(present)

    def _pushed(self, present: Tensor | None) -> None:
        if self._slots is not None:
            self._slots.append(self.num_slots)
            self._slot_index = None
        self.any_absent = self.any_absent or present is not None
        self._count += 1

    def source(self, i: int) -> Tensor:
        """Source i as pushed ([B, T, d]; fp32 in the buffered layout)."""
        return self._values[i].view(self.shape) if self.buffered else self._values_list[i]

    def key(self, i: int) -> Tensor:
        """The RMS-normalised fp32 key of source i, [B, T, d]."""
        if self.buffered:
            return (self._values[i] * self._inv_rms[i, :, None]).view(self.shape)
        return self._keys_list[i]

    def present_mask(self, k: int | None = None) -> Tensor | None:
        """Bool [k, B, T] of which of the first k sources each token has; None when every token has all."""
        k = self._count if k is None else k
        if not self.any_absent:
            return None
        if self.buffered:
            return self._present[:k].view(k, *self.shape[:-1])
        masks = self._present[:k]
        if all(p is None for p in masks):
            return None
        ones = torch.ones(self.shape[:-1], dtype=torch.bool, device=self._keys_list[0].device)
        return torch.stack([ones if p is None else p for p in masks])

    # -- the buffered layout, for the router -----------------------------------------------------------
    def flat_values(self) -> Tensor:
        """[K, tokens, d] fp32 view of every source (buffered layout only)."""
        return self._values[: self._count]

    def flat_inv_rms(self) -> Tensor:
        """[K, tokens] fp32 inverse RMS of every source: its key is value * inv_rms (buffered layout only)."""
        return self._inv_rms[: self._count]

    def flat_present(self) -> Tensor | None:
        """[K, tokens] bool presence, or None when every token has every source (buffered layout only)."""
        return self._present[: self._count] if self.any_absent else None


@lru_cache(maxsize=1024)
def _index_tensor(slots: tuple[int, ...], device: torch.device) -> Tensor:
    # A fixed skip pattern (static removal) repeats the same slot lists at every decoding step.
    return torch.tensor(slots, device=device)


def _slot_tensor(slots: tuple[int, ...], device: torch.device) -> Tensor:
    """Long [K]: `slots` as a tensor, cached. A normal tensor even under inference_mode: the cache outlives the
    forward, and a later training step indexes the bias with it (inference tensors cannot be saved for backward)."""
    if not torch.is_inference_mode_enabled():  # entering the context costs more than the lookup: once per layer
        return _index_tensor(slots, device)
    with torch.inference_mode(False):
        return _index_tensor(slots, device)


@dataclass
class StreamState:
    """Per-forward state of the depth stream, shared by the router hooks and a skip controller."""

    stack: SourceStack | None = None
    routed_input: Tensor | None = None
    alphas: dict[str, Tensor] = field(default_factory=dict)
    """Routing weights [K, B, T] of each router run so far, by key; those of `fused_rows` aside."""
    fused_params: list[native.KernelParams | None] | None = None
    """Every router's parameters as the fused kernels read them, in block order (the final router last), when this
    forward's stream goes through them; else None."""
    fused_gates: list[native.KernelParams | None] | None = None
    """Under a skip controller, the skip gate (if any) of the block each router feeds, like `fused_params`."""
    gate_run: dict[str, Tensor] = field(default_factory=dict)
    """Run probabilities [B, T] the fused kernels computed with a router's output, by the key of the block's gate."""
    fused_rows: dict[str, int] = field(default_factory=dict)
    """Routers the fused decode path ran: key -> the row of `stack.native` holding their output; their weights are
    read from it only on request (`alpha`)."""
    token_is_image: Tensor | None = None
    """Bool [B, T] of visual-placeholder positions, when a skip context knows the input ids and the forward holds
    some (None in decode steps and text-only batches: per-modality rules then cost no work per block)."""
    token_is_real: Tensor | None = None
    """Bool [B, T]: False at padding positions, when a skip context knows the attention mask."""
    context_length: int = 0
    """Tokens the KV cache held when this forward began (0 in prefill or without a cache)."""
    attention_mask: Tensor | None = None
    """[B, context_length + T], zero / False at padding: the top model's attention mask over the cache and this
    forward's tokens, when a skip context knows it (None: no padding anywhere)."""

    route_whole: Callable[[int, Tensor, str], Tensor | None] | None = None
    """Where this forward runs every block for every token (no skip controller) through the fused kernels: pushes the
    delta of a block and runs the router after it in one call, `route_whole(block, output, key)` -> that router's
    output, or None where the kernels decline (then push and route apart). Set by `enable_whole_routing`."""

    def enable_whole_routing(self) -> None:
        """Set `route_whole` for this forward's fused stream: one kernel call per layer and the bookkeeping it needs,
        nothing else. A decoding step runs it between layers whose weights evict every cache, where each Python
        operation costs several times its warm price: the general path (`RouterAdapter._push_and_mix`) spent as
        much again on its checks for skip policies, dropped sources and gates, none of which a whole forward has."""
        stack = self.stack
        native = stack.native
        route, rows, fused_rows = native.whole_routing(self.fused_params), native.routed_rows, self.fused_rows

        def route_whole(block: int, output: Tensor, key: str) -> Tensor | None:
            count = stack._count
            # Block b's delta goes to slot b + 1 where every earlier block pushed one (else: the general path).
            row = route(block, output, self.routed_input) if count == block + 1 else None
            if row is None:
                return None
            stack._count = count + 1
            routed = self.routed_input = rows[row]
            fused_rows[key] = row
            return routed

        self.route_whole = route_whole

    def sequence_positions(self) -> Tensor:
        """Long [B, T]: each token's position in its own sequence, padding not counted (left padding shifts a
        row's positions in the batch; these stay those of the row alone). -1 at leading padding."""
        tokens = self.stack.shape[1]
        mask = self.attention_mask
        if mask is None:
            return torch.arange(self.context_length, self.context_length + tokens,
                                device=self.stack.device).expand(self.stack.shape[0], tokens)
        return mask.long().cumsum(-1)[:, -tokens:] - 1

    def alpha(self, key: str) -> Tensor:
        """Router `key`'s weights [K, B, T] over the stored sources in this forward."""
        row = self.fused_rows.get(key)
        return self.alphas[key] if row is None else self.stack.native.alpha_row(row)

    def routed_keys(self) -> list[str]:
        """The routers run so far in this forward."""
        return [*self.fused_rows, *self.alphas]
