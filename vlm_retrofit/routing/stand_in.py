"""Stand-ins for skipped layers: a linear map a token that skips a layer passes through instead of nothing.

A decoder layer adds `f(h)` to the stream. A token that skips it gets `h` back; with a stand-in it gets
`h + RMSNorm(h) W + b` instead, a d x d map fitted by least squares to what the layer adds (`fit_stand_ins`, on the
full model's stream) and optionally trained with the routers. It costs one d x d matrix product per skipped token
(about a tenth of a SmolLM2-135M layer) and the kv-only cache write as before. Zero at init, so a skip is the
identity there, as without stand-ins. A skipped block's delta is then the stand-ins' update and stays present for
later routers: it is what the block wrote for that token.

Measured training-free on the real VLM of `bench/` (held-out Austen text, random per-token skipping of the 9
cheapest layers, `python -m bench.stand_in_probe`): perplexity x1.87 -> x1.31 at 20 % of the layer executions
skipped, x1.36 -> x1.12 at 10 % (bench/HISTORY.md, "Stand-ins for skipped layers").
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from ..backbones import layer_hidden_states, layer_output
from .router import rms_normalize


class StandIn(nn.Module):
    """What a token that skips one decoder layer adds to the stream: `RMSNorm(h) W + b` (no gain: W carries it)."""

    def __init__(self, hidden_size: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device))

    def forward(self, hidden: Tensor, eps: float) -> Tensor:
        """`hidden` plus the stand-in's update, in `hidden`'s dtype (the update is computed in fp32)."""
        update = torch.addmm(self.bias, rms_normalize(hidden, eps).reshape(-1, hidden.shape[-1]), self.weight)
        return hidden + update.reshape(hidden.shape).to(hidden.dtype)

    @property
    def fitted(self) -> bool:
        """Whether it holds a fit (anything but the zero of init, under which a skip is the plain identity)."""
        return bool(self.weight.detach().any() or self.bias.detach().any())

    def flops_per_token(self) -> int:
        """Multiply-adds of the matrix product, counted as 2 FLOPs each (the norm and bias are left out)."""
        return 2 * self.weight.shape[0] * self.weight.shape[1]


@torch.no_grad()
def fit_stand_ins(adapter: Any, batches: Iterable[Mapping[str, Any]], *, ridge: float = 1e-2,
                  layers: Iterable[int] | None = None) -> dict[int, float]:
    """Fit the adapter's stand-ins to what their layers add in the full model: the model as given, routers off
    (in training the fit runs before the first step, where a LoRA adds nothing yet).

    Least squares of `f(h) ~ RMSNorm(h) W + b` over the real tokens of `batches` (forward keywords of the model,
    their `attention_mask` marking the real positions), each layer on the full model's stream, ridge-regularised by
    `ridge` times the mean diagonal of the normal equations. `layers` defaults to every layer that has a stand-in.
    Returns each layer's share of the update's variance explained on those tokens (R^2).
    """
    model, eps = adapter.model, adapter.config.key_norm_eps
    targets = sorted(int(k) for k in adapter.stand_ins) if layers is None else sorted(int(i) for i in layers)
    missing = [i for i in targets if str(i) not in adapter.stand_ins]
    if missing:
        raise ValueError(f"layers {missing} have no stand-in (the adapter has them for {sorted(map(int, adapter.stand_ins))})")
    decoder = adapter.spec.get_layers(model)
    hidden_size = adapter.stand_ins[str(targets[0])].weight.shape[0] if targets else 0
    gram = {i: torch.zeros(hidden_size + 1, hidden_size + 1, dtype=torch.float64) for i in targets}
    cross = {i: torch.zeros(hidden_size + 1, hidden_size, dtype=torch.float64) for i in targets}
    sums = {i: torch.zeros(2, hidden_size, dtype=torch.float64) for i in targets}  # target sum, sum of squares
    counts = dict.fromkeys(targets, 0)
    real: list[Tensor | None] = [None]

    def capture(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            hidden = layer_hidden_states(args, kwargs)
            out = layer_output(output)
            keep = real[0]
            x, y = rms_normalize(hidden, eps), (out.float() - hidden.float())
            x, y = (x[keep], y[keep]) if keep is not None else (x.reshape(-1, hidden_size), y.reshape(-1, hidden_size))
            x = torch.cat([x, torch.ones_like(x[:, :1])], 1).double().cpu()
            y = y.double().cpu()
            gram[index] += x.T @ x
            cross[index] += x.T @ y
            sums[index] += torch.stack([y.sum(0), y.pow(2).sum(0)])
            counts[index] += x.shape[0]
        return hook

    handles = [decoder[i].register_forward_hook(capture(i), with_kwargs=True) for i in targets]
    try:
        with adapter.disabled():
            for inputs in batches:
                mask = inputs.get("attention_mask")
                real[0] = mask.bool() if mask is not None and mask.dim() == 2 else None
                model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    explained = {}
    for i in targets:
        if not counts[i]:
            raise ValueError("fit_stand_ins: the batches hold no real token to fit on")
        normal = gram[i].clone()
        normal.diagonal().add_(float(ridge) * float(normal.diagonal().mean()))
        solution = torch.linalg.solve(normal, cross[i])  # [d + 1, d]: W over the bias row
        stand_in = adapter.stand_ins[str(i)]
        stand_in.weight.copy_(solution[:-1].to(stand_in.weight))
        stand_in.bias.copy_(solution[-1].to(stand_in.bias))
        # Residual sum of squares from the normal equations: y'y - 2 s'X'y + s'X'X s.
        total_sq = float(sums[i][1].sum())
        rss = total_sq - 2 * float((solution * cross[i]).sum()) + float((solution * (gram[i] @ solution)).sum())
        centred = total_sq - float((sums[i][0].pow(2) / counts[i]).sum())
        explained[i] = 1.0 - rss / centred if centred > 0 else 0.0
    return explained

