"""The depth stream of one forward pass: its sources, their normalised keys and presence masks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .router import rms_normalize


class SourceStack:
    """The sources written to the stream so far (s_0 = decoder input, then one delta per block).

    Two layouts, the same values:
    * `buffered` (decoding: no autograd, few tokens): every source is copied once into a preallocated fp32
      [tokens, capacity, d] buffer, so a router reads all of them with one matmul and mixes them with one
      batched matmul. Re-stacking a growing list at every block costs more than the routing itself.
    * listed (training, prefill): per-source tensors, never a [K, B, T, d] copy of the stream, and in-place
      buffer writes would break autograd.
    """

    buffer_max_tokens = 64
    """Forwards with at most this many tokens (batch x length) and no autograd use the buffered layout."""

    def __init__(self, first: Tensor, capacity: int, eps: float) -> None:
        self.shape = first.shape
        self.dtype = first.dtype
        self.eps = eps
        tokens = first.shape[:-1].numel()
        self.buffered = not torch.is_grad_enabled() and tokens <= self.buffer_max_tokens
        self._count = 0
        self._any_absent = False
        self._present: Tensor | list[Tensor | None]
        if self.buffered:
            width = first.shape[-1]
            self._values = first.new_empty((tokens, capacity, width), dtype=torch.float32)
            self._keys = torch.empty_like(self._values)
            self._present = torch.ones((tokens, capacity), dtype=torch.bool, device=first.device)
        else:
            self._values_list: list[Tensor] = []
            self._keys_list: list[Tensor] = []
            self._present = []
        self.push(first)

    def __len__(self) -> int:
        return self._count

    def push(self, source: Tensor, present: Tensor | None = None) -> None:
        """Append a source [B, T, d]; `present` is a bool [B, T] mask of the tokens that have it (None = all)."""
        i = self._count
        if self.buffered:
            flat = source.reshape(-1, source.shape[-1])
            self._values[:, i] = flat
            self._keys[:, i] = rms_normalize(flat, self.eps)
            if present is not None:
                self._present[:, i] = present.reshape(-1)
        else:
            self._values_list.append(source)
            self._keys_list.append(rms_normalize(source, self.eps))
            self._present.append(present)
        self._any_absent = self._any_absent or present is not None
        self._count += 1

    def source(self, i: int) -> Tensor:
        """Source i as pushed ([B, T, d]; fp32 in the buffered layout)."""
        return self._values[:, i].view(self.shape) if self.buffered else self._values_list[i]

    def key(self, i: int) -> Tensor:
        """The RMS-normalised fp32 key of source i, [B, T, d]."""
        return self._keys[:, i].view(self.shape) if self.buffered else self._keys_list[i]

    def present_mask(self, k: int | None = None) -> Tensor | None:
        """Bool [k, B, T] of which of the first k sources each token has; None when every token has all."""
        k = self._count if k is None else k
        if not self._any_absent:
            return None
        if self.buffered:
            return self._present[:, :k].t().reshape(k, *self.shape[:-1])
        masks = self._present[:k]
        if all(p is None for p in masks):
            return None
        ones = torch.ones(self.shape[:-1], dtype=torch.bool, device=self._keys_list[0].device)
        return torch.stack([ones if p is None else p for p in masks])

    # -- the buffered layout, for the router -----------------------------------------------------------
    def flat_values(self) -> Tensor:
        """[tokens, K, d] fp32 view of every source (buffered layout only)."""
        return self._values[:, : self._count]

    def flat_keys(self) -> Tensor:
        """[tokens, K, d] fp32 view of every key (buffered layout only)."""
        return self._keys[:, : self._count]

    def flat_present(self) -> Tensor | None:
        """[tokens, K] bool presence, or None when every token has every source (buffered layout only)."""
        return self._present[:, : self._count] if self._any_absent else None


@dataclass
class StreamState:
    """Per-forward state of the depth stream, shared by the router hooks and a skip controller."""

    stack: SourceStack | None = None
    routed_input: Tensor | None = None
    alphas: dict[str, Tensor] = field(default_factory=dict)
    token_is_image: Tensor | None = None
    """Bool [B, T] of visual-placeholder positions, when a skip context knows the input ids."""
    token_is_real: Tensor | None = None
    """Bool [B, T]: False at padding positions, when a skip context knows the attention mask."""
