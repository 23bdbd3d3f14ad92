"""Distillation losses: KL(teacher || student) and hidden-state error on masked positions, the compute penalty, router entropy."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

PENALTIES = ("hinge", "squared")


KL_CHUNK_ELEMENTS = 1 << 20
"""Positions x vocabulary per chunk of the KL (1 M elements: a 4 MB fp32 temporary, within a core's L2 and below
glibc's mmap threshold, so chunks reuse warm memory instead of faulting in fresh pages). On SmolLM2's vocabulary, 4
sequences of ~220 positions, 2 CPU cores: 0.22 s per training step's KL against 1.03 s at 8 M elements
(whole steps, interleaved in one process: 0.92x the time; `python -m bench.step_speed --against kl-chunks-8m`)."""


class _ChunkedKL(torch.autograd.Function):
    """Per-position `T^2 * KL(softmax(t/T) || softmax(s/T))` of [N, V] logits, in fp32 chunks of positions.

    The gradient is known when the value is: `d/ds = T * (softmax(s/T) - softmax(t/T))` per position, times the
    caller's weight for it. Forward writes it once, so no [N, V] fp32 tensor outlives its chunk (autograd through
    log_softmax + kl_div keeps several and runs a dozen passes over them). It is held in the student logits' dtype,
    bfloat16 for float16 logits: the loss scale of fp16 mixed precision is applied only in backward, and fp16
    would flush the small entries before it. Backward scales it in fp32, chunk by chunk. The teacher gets no
    gradient.
    """

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, needs_grad: bool) -> Tensor:
        """Rows of the KL [N] (fp32); with `needs_grad`, the gradient for backward."""
        rows = student.new_empty(student.shape[0], dtype=torch.float32)
        held_dtype = torch.bfloat16 if student.dtype == torch.float16 else student.dtype
        grad = torch.empty_like(student, dtype=held_dtype) if needs_grad else None
        chunk = max(1, KL_CHUNK_ELEMENTS // max(1, student.shape[-1]))
        for begin in range(0, student.shape[0], chunk):
            s, t = student[begin:begin + chunk].float(), teacher[begin:begin + chunk].float()
            if temperature != 1.0:  # a full pass over the logits each: not for the usual T = 1
                s, t = s / temperature, t / temperature
            log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
            p_t = log_t.exp()
            rows[begin:begin + chunk] = (p_t * (log_t - log_s)).sum(-1) * (temperature ** 2)
            if grad is not None:
                grad[begin:begin + chunk] = (log_s.exp_().sub_(p_t)).mul_(temperature)
        ctx.save_for_backward(grad)
        ctx.student_dtype, ctx.chunk = student.dtype, chunk
        return rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows: Tensor):
        """The held gradient times each row's weight (the mean's 1/N, any loss scale), in fp32."""
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        out = torch.empty_like(grad, dtype=ctx.student_dtype)
        weights = grad_rows.float().unsqueeze(-1)
        for begin in range(0, grad.shape[0], ctx.chunk):
            out[begin:begin + ctx.chunk] = grad[begin:begin + ctx.chunk].float() * weights[begin:begin + ctx.chunk]
        return out, None, None, None


def distillation_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None,
                    temperature: float = 1.0) -> Tensor:
    """Mean over the selected positions of `T^2 * KL(softmax(t/T) || softmax(s/T))`, computed in fp32.

    `student_logits` and `teacher_logits` are [..., V] with the same leading shape; `mask` (bool, that leading
    shape) selects the positions that count (None = all). With no selected position the result is a zero that
    still depends on the student (so backward works and does nothing). The teacher is a target: no gradient
    reaches it. Computed in chunks of positions with the gradient written in the forward (`_ChunkedKL`): the
    same values as autograd through `log_softmax` and `kl_div`, in less time and memory.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if mask is not None:
        student_logits, teacher_logits = student_logits[mask], teacher_logits[mask]
    student = student_logits.reshape(-1, student_logits.shape[-1])
    teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1]).detach()
    if student.shape[0] == 0:
        return student.float().sum() * 0.0
    needs_grad = student.requires_grad and torch.is_grad_enabled()  # not under no_grad, e.g. validation
    return _ChunkedKL.apply(student, teacher, float(temperature), needs_grad).mean()


def hidden_state_distillation(student_states: Sequence[Tensor], teacher_states: Sequence[Tensor],
                              pairs: Sequence[tuple[int, int]], mask: Tensor | None = None) -> Tensor:
    """Mean over `pairs` (student index, teacher index into the `hidden_states` tuples) of the per-token relative
    squared error `||s - t||^2 / ||t||^2` over the selected positions, computed in fp32.

    Relative per token because residual-stream norms grow with depth and a few tokens (the first, attention sinks)
    are orders of magnitude larger than the rest: an absolute error would be theirs alone. `mask` (bool [B, T])
    selects the positions that count (None = all). With no pair or no position the result is a zero that still
    depends on the student.
    """
    terms = []
    for s_index, t_index in pairs:
        student, teacher = student_states[s_index].float(), teacher_states[t_index].float()
        if mask is not None:
            student, teacher = student[mask], teacher[mask]
        if student.numel() == 0:
            continue
        error = (student - teacher).square().sum(-1) / teacher.square().sum(-1).clamp_min(1e-6)
        terms.append(error.mean())
    if not terms:
        return student_states[pairs[0][0] if pairs else -1].float().sum() * 0.0
    return torch.stack(terms).mean()


def compute_penalty(expected_compute: Tensor, target: float | None, weight: float, kind: str = "hinge") -> Tensor:
    """Pull the expected executed fraction of decoder-block compute toward `target`.

    `hinge`: `weight * relu(expected - target)` (only penalises running too much); `squared`:
    `weight * (expected - target)^2`. `target=None` or `weight=0` gives 0.
    """
    if kind not in PENALTIES:
        raise ValueError(f"compute penalty must be one of {PENALTIES}, got {kind!r}")
    expected = torch.as_tensor(expected_compute, dtype=torch.float32)
    if target is None or weight == 0:
        return expected.new_zeros(()) * 0.0
    gap = expected.float() - float(target)
    value = torch.relu(gap) if kind == "hinge" else gap.square()
    return value * float(weight)


def routing_entropy(alpha: Tensor, valid: Tensor | None = None) -> Tensor:
    """Mean entropy (nats) of routing weights `alpha` [K, B, T] (softmax over dim 0) over the valid tokens [B, T]."""
    alpha = alpha.detach().float()
    entropy = -torch.special.xlogy(alpha, alpha).sum(0)  # absent sources have alpha 0 and add nothing
    if valid is not None:
        valid = valid.to(entropy.device).bool()
        if valid.shape != entropy.shape:
            return entropy.mean()
        return entropy[valid].mean() if bool(valid.any()) else entropy.new_zeros(())
    return entropy.mean()


def routing_entropies(alphas: Mapping[str, Tensor], valid: Tensor | None = None) -> dict[str, Tensor]:
    """`routing_entropy` of every router in `alphas` (e.g. `adapter.last_routing_weights`)."""
    return {key: routing_entropy(alpha, valid) for key, alpha in alphas.items()}


def drop_rate_at(step: int, max_drop_rate: float, warmup_steps: int) -> float:
    """Drop-rate curriculum: a linear ramp from 0 to `max_drop_rate` over `warmup_steps`, then constant."""
    if warmup_steps <= 0:
        return float(max_drop_rate)
    return float(max_drop_rate) * min(1.0, max(0, step) / warmup_steps)
