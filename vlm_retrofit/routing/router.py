"""The depth-softmax math: one router mixes the sources written to the stream so far (docs/design.md §2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .native import KernelParams

if TYPE_CHECKING:
    from .stream import SourceStack


def inverse_rms(x: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """1 / RMS over the hidden dimension, in fp32, without that dimension; written into `out` when given.

    Both forms do the same arithmetic, so in PyTorch ops a token's key is bitwise the same in either stream layout
    (the fused kernels of `routing.native` sum the RMS in another order).
    """
    squares = x.float().pow(2)
    if out is None:
        return torch.rsqrt(squares.mean(-1) + eps)
    return torch.mean(squares, -1, out=out).add_(eps).rsqrt_()


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """RMS-normalise over the hidden dimension, in fp32, without a gain."""
    x = x.float()  # once: inverse_rms's own cast is then a no-op
    return x * inverse_rms(x, eps)[..., None]


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
        # Registered even when absent: the decode path reads `_parameters["bias"]` (attribute access costs more).
        self.register_parameter("bias", nn.Parameter(torch.zeros(num_sources, device=device)) if source_bias else None)
        self.num_sources = num_sources

    def forward(self, stack: "SourceStack") -> tuple[Tensor, Tensor]:
        """Mix every source on `stack` (a `SourceStack`).

        Sources absent for a token (its `present_mask` is False) are masked out of the softmax and not
        counted in K. Returns the routed input [B, T, d] (dtype of the stream) and the routing weights alpha
        [K, B, T] (fp32).
        """
        k = len(stack)
        if stack.buffered:
            return self._mix_buffered(stack, k)
        # q . (g * n) == (q * g) . n: fold the key-norm gain into the query once per call.
        scorer = self.query * self.key_norm_weight
        logits = torch.stack([stack.key(i) @ scorer for i in range(k)])  # [K, B, T]
        if self.bias is not None:
            logits = logits + self._source_bias(stack, k)[:, None, None]
        count: Tensor | float = float(k)
        present = stack.present_mask(k)
        if present is not None:
            logits = logits.masked_fill(~present, float("-inf"))
            count = present.sum(0).to(logits.dtype)  # [B, T]
        # The softmax by hand, to form the mixing weights K * alpha as exp(l - max) / (sum / K): at uniform routing
        # every exp is 1 and the sum is K, so each weight is exactly 1 and the mix is the plain sum of the sources in
        # the residual stream's own order, bit for bit in fp32 (K * softmax rounds 1/K and K apart: ~1e-4 on real
        # logits). One exp pass serves both.
        shifted = (logits - logits.amax(0, keepdim=True)).exp()  # s_0 is present for every token: a finite max
        total = shifted.sum(0, keepdim=True)
        alpha = shifted / total
        weights = (shifted / (total / count)).unsqueeze(-1)
        mixed = weights[0] * stack.source(0).float()
        in_place = not torch.is_grad_enabled()  # one kernel per source; autograd needs the out-of-place form
        for i in range(1, k):  # source by source: the residual stream's own summation order
            source = stack.source(i).float()
            mixed = mixed.addcmul_(weights[i], source) if in_place else mixed + weights[i] * source
        return mixed.to(stack.dtype), alpha

    def _source_bias(self, stack: "SourceStack", k: int) -> Tensor:
        index = stack.slot_index()
        bias = self._parameters["bias"]
        return bias[:k] if index is None else bias[index]

    def _inference_params(self) -> tuple[Tensor, KernelParams | None]:
        """The scorer q * g, and the kernels' view of it and of the bias (None where they cannot read them)."""
        params = self._parameters
        return folded_for_inference(self, params["query"], params["key_norm_weight"], params["bias"])

    def _mix_buffered(self, stack: "SourceStack", k: int) -> tuple[Tensor, Tensor]:
        scorer, params = self._inference_params()
        row = stack.route_fused(params)  # one C call (routing.native) where the kernels take the stream
        if row is not None:
            return stack.native.routed_rows[row], stack.native.alpha_row(row)
        # Decoding runs this once per block per token on a few tokens, so Python work costs as much as the
        # arithmetic: a handful of kernels whatever K is, each reading the buffer at most once, few helper calls.
        # q . (v * r) == (q . v) * r scores without a normalised copy, and the K multiplier rides on the mixing
        # product.
        values = stack.flat_values()  # [K, tokens, d], contiguous
        tokens = values.shape[1]
        flat = values.view(k * tokens, values.shape[2])
        scores = torch.mv(flat, scorer).view(k, tokens)
        if self._parameters["bias"] is not None:
            logits = torch.addcmul(self._source_bias(stack, k).unsqueeze(1), scores, stack.flat_inv_rms())  # [K, tokens]
        else:
            logits = scores * stack.flat_inv_rms()
        present = stack.flat_present()
        if present is not None:
            logits = logits.masked_fill(~present, float("-inf"))
        alpha = torch.softmax(logits, dim=0)
        if tokens == 1 and present is None:  # one token: one vector-matrix product, K applied inside it
            mixed = torch.addmm(stack.zero, alpha.t(), flat, beta=0, alpha=k)
        else:
            count = float(k) if present is None else present.sum(0, keepdim=True).to(alpha.dtype)  # K per token
            weights = alpha * count
            mixed = weights.t() @ flat if tokens == 1 else (weights.unsqueeze(-1) * values).sum(0)
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

    def _inference_params(self) -> KernelParams | None:
        """The gate as the fused kernels read it (the query times the norm gain, and the bias), for a routed input
        they compute; None where they cannot."""
        params = self._parameters
        return folded_for_inference(self, params["query"], params["norm_weight"], params["bias"])[1]


def folded_for_inference(module: nn.Module, query: Tensor, gain: Tensor,
                         bias: Tensor | None) -> tuple[Tensor, KernelParams | None]:
    """`query * gain`, and the fused kernels' view of it and of `bias`, cached on `module`.

    Without autograd the parameters only change in place (optimizer steps, load_state_dict) or by moving, which
    version counters and data pointers show: the gain is folded into the query once, not per call. Callers pass
    `module._parameters` entries: nn.Module.__getattr__ costs as much as a small kernel at decode time.
    """
    key = (query._version, gain._version, query.data_ptr(), gain.data_ptr(), bias is not None and bias.data_ptr())
    cached = module.__dict__.get("_folded_cache")
    if cached is None or cached[0] != key:
        scorer = query * gain
        # The cache holds the query and gain it was made from: a parameter replaced by another (assigned, loaded
        # with assign=True) could otherwise be allocated at the freed one's address with the same version count.
        cached = (key, scorer, KernelParams.of(scorer, bias), query, gain)
        module.__dict__["_folded_cache"] = cached
    return cached[1], cached[2]
