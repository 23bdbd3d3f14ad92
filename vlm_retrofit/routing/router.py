"""The depth-softmax math: one router mixes the sources written to the stream so far (DESIGN §2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .stream import SourceStack


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """1 / RMS over the hidden dimension, in fp32, keeping that dimension (size 1)."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """RMS-normalise over the hidden dimension, in fp32, without a gain."""
    x = x.float()  # once: inverse_rms's own cast is then a no-op
    return x * inverse_rms(x, eps)


class DepthRouter(nn.Module):
    """Router in front of one block: `x = K * sum_i softmax_i(q . RMSNorm(s_i) + b_i) * s_i`.

    With q = 0 and b = 0 the softmax is uniform and `x = sum_i s_i`, the plain residual stream: the
    multiplier K (number of sources present) is what makes the retrofit an exact identity at init.
    """

    def __init__(self, hidden_size: int, num_sources: int, *, source_bias: bool, init_scale: float = 0.0,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        query = torch.zeros(hidden_size, device=device)
        if init_scale > 0:
            query = torch.randn(hidden_size, generator=generator).mul_(init_scale).to(device)
        self.query = nn.Parameter(query)
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.bias = nn.Parameter(torch.zeros(num_sources, device=device)) if source_bias else None
        self.num_sources = num_sources

    def forward(self, stack: "SourceStack") -> tuple[Tensor, Tensor]:
        """Mix every source on `stack` (a `SourceStack`).

        Sources absent for a token (its `present_mask` is False) are masked out of the softmax and not
        counted in K. Returns the routed input [B, T, d] (dtype of the stream) and the routing weights alpha
        [K, B, T] (fp32).
        """
        k = len(stack)
        # q . (g * n) == (q * g) . n: fold the key-norm gain into the query once per call.
        scorer = self.query * self.key_norm_weight
        if stack.buffered:
            return self._mix_buffered(stack, k, scorer)
        logits = torch.stack([stack.key(i) @ scorer for i in range(k)])  # [K, B, T]
        if self.bias is not None:
            logits = logits + self._source_bias(stack, k)[:, None, None]
        count: Tensor | float = float(k)
        present = stack.present_mask(k)
        if present is not None:
            logits = logits.masked_fill(~present, float("-inf"))
            count = present.sum(0).to(logits.dtype)  # [B, T]
        alpha = torch.softmax(logits, dim=0)
        mixed = alpha[0, ..., None] * stack.source(0).float()
        for i in range(1, k):
            mixed = mixed + alpha[i, ..., None] * stack.source(i).float()
        mixed = mixed * (count[..., None] if isinstance(count, Tensor) else count)
        return mixed.to(stack.dtype), alpha

    def _source_bias(self, stack: "SourceStack", k: int) -> Tensor:
        index = stack.slot_index()
        return self.bias[:k] if index is None else self.bias[index]

    def _mix_buffered(self, stack: "SourceStack", k: int, scorer: Tensor) -> tuple[Tensor, Tensor]:
        # Decoding: a handful of small kernels per router whatever K is, each reading the buffer at most once
        # (q . (v * r) == (q . v) * r scores without a normalised copy); batched matmuls over a strided
        # [tokens, K, d] view were several times slower.
        values = stack.flat_values()  # [K, tokens, d], contiguous
        width = values.shape[-1]
        logits = (values.view(-1, width) @ scorer).view(k, -1) * stack.flat_inv_rms()  # [K, tokens]
        if self.bias is not None:
            logits = logits + self._source_bias(stack, k)[:, None]
        present = stack.flat_present()
        if present is not None:
            logits = logits.masked_fill(~present, float("-inf"))
            scale = present.sum(0, keepdim=True).to(logits.dtype)
        else:
            scale = float(k)
        alpha = torch.softmax(logits, dim=0)
        weights = alpha * scale
        if weights.shape[1] == 1:  # one token: a vector-matrix product, no [K, d] temporary
            mixed = weights.t() @ values.view(k, width)
        else:
            mixed = (weights.unsqueeze(-1) * values).sum(0)
        return mixed.view(stack.shape).to(stack.dtype), alpha.view(k, *stack.shape[:-1])


class SkipGate(nn.Module):
    """Learned gate on a block's routed input: `p = sigmoid(g . RMSNorm(x) + c)`, the probability the block runs."""

    def __init__(self, hidden_size: int, *, init_bias: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size, device=device))
        self.norm_weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.bias = nn.Parameter(torch.full((), float(init_bias), device=device))

    def forward(self, routed_input: Tensor, eps: float) -> Tensor:
        """Run probability per token, [B, T] fp32."""
        return torch.sigmoid(rms_normalize(routed_input, eps) @ (self.query * self.norm_weight) + self.bias)
