"""The depth-softmax math: one router mixes the sources written to the stream so far (DESIGN §2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """RMS-normalise over the hidden dimension, in fp32, without a gain."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class DepthRouter(nn.Module):
    """Router in front of one block: `x = K * sum_i softmax_i(q . RMSNorm(s_i) + b_i) * s_i`.

    With q = 0 and b = 0 the softmax is uniform and `x = sum_i s_i`, the plain residual stream: the
    multiplier K (number of sources present) is what makes the retrofit an exact identity at init.
    """

    stack_max_tokens = 64
    """Calls with at most this many tokens (batch x length) take the stacked path (same value, fewer kernels)."""

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

    def forward(self, sources: list[Tensor], normed_sources: list[Tensor],
                present: list[Tensor | None] | None = None) -> tuple[Tensor, Tensor]:
        """Mix `sources` (each [B, T, d]); `normed_sources` are their `rms_normalize`d fp32 versions.

        `present[i]` is a bool [B, T] mask of the tokens for which source i exists (None = all); absent
        sources are masked out of the softmax and not counted in K. Returns the routed input (dtype of the
        sources) and the routing weights alpha [K, B, T] (fp32).
        """
        k = len(sources)
        # Few tokens (decoding): stack the sources and mix them in one kernel each, since per-source kernels
        # launched from Python would dominate. Many tokens (prefill, training): loop, never holding a [K, B, T, d]
        # copy of the stream.
        stacked = sources[0].shape[:-1].numel() <= self.stack_max_tokens
        # q . (g * n) == (q * g) . n: fold the key-norm gain into the query once per call.
        scorer = self.query * self.key_norm_weight
        if stacked:
            logits = torch.stack(normed_sources) @ scorer  # [K, B, T]
        else:
            logits = torch.stack([n @ scorer for n in normed_sources])
        if self.bias is not None:
            logits = logits + self.bias[:k, None, None]
        count: Tensor | float = float(k)
        if present is not None and any(p is not None for p in present):
            mask = torch.stack([torch.ones_like(logits[0], dtype=torch.bool) if p is None else p for p in present])
            logits = logits.masked_fill(~mask, float("-inf"))
            count = mask.sum(0).to(logits.dtype)  # [B, T]
        alpha = torch.softmax(logits, dim=0)
        if stacked:
            mixed = torch.einsum("kbt,kbtd->btd", alpha, torch.stack(sources).float())
        else:
            mixed = alpha[0, ..., None] * sources[0].float()
            for i in range(1, k):
                mixed = mixed + alpha[i, ..., None] * sources[i].float()
        mixed = mixed * (count[..., None] if isinstance(count, Tensor) else count)
        return mixed.to(sources[0].dtype), alpha


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
