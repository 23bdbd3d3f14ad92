"""Benchmark measurements: perplexity, teacher-forced agreement and KL, captions, and decode speed, side by side."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from torch import Tensor

Method = Callable[[], ContextManager[Any]]
"""Enters the skipping of one method for the duration of a measurement (`contextlib.nullcontext` = base)."""


@torch.no_grad()
def perplexity(model, chunks: Iterable[Tensor], method: Method, reports: list | None = None) -> float:
    """Perplexity of `model` under `method` on token-id chunks (each [T]), no cache; what `method` yields per
    chunk (its skip report) is appended to `reports`."""
    total_nll, total_tokens = 0.0, 0
    for ids in chunks:
        with method() as report:
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        if reports is not None:
            reports.append(report)
        total_nll += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
        total_tokens += ids.numel() - 1
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def greedy(model, inputs: dict[str, Any], max_new_tokens: int, method: Method, pad_token_id: int) -> tuple[Tensor, Any, float]:
    """Greedy continuation under `method`: (new tokens [B, N], the method's report or None, seconds)."""
    _sync()
    start = time.perf_counter()
    with method() as report:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    _sync()
    return out[:, inputs["input_ids"].shape[1]:], report, time.perf_counter() - start


@torch.no_grad()
def teacher_forced(model, inputs: dict[str, Any], continuation: Tensor, method: Method,
                   base_logits: Tensor | None = None, reports: list | None = None) -> tuple[Tensor, float, float]:
    """Run prompt + the base's greedy continuation once under `method` (what it yields goes to `reports`).

    Returns the logits at the continuation positions, the top-1 agreement with the continuation (how often
    the method would have produced the base's token) and KL(base || method) averaged over those positions.
    """
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], continuation], dim=1)
    extra = continuation.shape[1]
    full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(continuation)], dim=1)
    with method() as report:
        logits = model(**full, use_cache=False).logits[:, -extra - 1:-1].float()
    if reports is not None:
        reports.append(report)
    agreement = (logits.argmax(-1) == continuation).float().mean().item()
    kl = 0.0
    if base_logits is not None:
        p = torch.log_softmax(base_logits, -1)
        q = torch.log_softmax(logits, -1)
        kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return logits, agreement, kl


@torch.no_grad()
def decode_speed(model, inputs: dict[str, Any], method: Method, pad_token_id: int, new_tokens: int = 32,
                 repeats: int = 2) -> float:
    """Generated tokens per second (best of `repeats`), min_new_tokens forcing a fixed length."""
    best = 0.0
    for _ in range(repeats):
        with method():
            seconds = timed_generate(model, inputs, pad_token_id, new_tokens)
        best = max(best, inputs["input_ids"].shape[0] * new_tokens / seconds)
    return best


def timed_generate(model, inputs: dict[str, Any], pad_token_id: int, new_tokens: int) -> float:
    """Wall-clock seconds of one greedy generate call of exactly `new_tokens` tokens."""
    _sync()
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=pad_token_id)
    _sync()
    return time.perf_counter() - start


def timed_forward(model, inputs: dict[str, Any]) -> float:
    """Wall-clock seconds of one forward over `inputs`: a generate call's prefill (the vision tower included)."""
    _sync()
    start = time.perf_counter()
    model(**inputs)
    _sync()
    return time.perf_counter() - start


WARM_UP_TOKENS = 2  # prefill and one decoding step: each shape a timed call runs


def paired_speed_ratios(model, inputs: dict[str, Any], method: Method, base_method: Method, pad_token_id: int, *,
                        rounds: int = 4, new_tokens: int = 32) -> list[float]:
    """One decode-speed ratio (tokens/s under `method` ÷ under `base_method`) per round of `paired_ratios`, each
    from one greedy generate call of `new_tokens` per side (the untimed warm-up calls generate `WARM_UP_TOKENS`)."""
    return paired_ratios(lambda: timed_generate(model, inputs, pad_token_id, new_tokens), method, base_method,
                         rounds=rounds, warm_up=lambda: timed_generate(model, inputs, pad_token_id, WARM_UP_TOKENS))


def paired_ratios(timed: Callable[[], float], method: Method, base_method: Method, *, rounds: int,
                  warm_up: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of `timed()` under `base_method` ÷ under `method`, one ratio per round, each from two adjacent calls
    in ABBA order: the base first in even rounds, `method` first in odd ones, so that a machine speeding up or
    slowing down during the measurement favours neither side. Each side first runs `warm_up` (default `timed`)
    once, untimed: a device's first calls pay one-off costs (CUDA's lazy initialisation and kernel choice). Paid by
    the first round's base call, they made a 2-round GPU measurement read the routed model 1.87x the base's speed."""
    for side in (base_method, method):
        with side():
            (warm_up or timed)()
    ratios = []
    for round_ in range(rounds):
        order = (base_method, method) if round_ % 2 == 0 else (method, base_method)
        seconds = []
        for run in order:
            with run():
                seconds.append(timed())
        base_seconds, method_seconds = seconds if round_ % 2 == 0 else seconds[::-1]
        ratios.append(base_seconds / method_seconds)
    return ratios


def speed_ratio(model, inputs: dict[str, Any], method: Method, base_method: Method, pad_token_id: int, *,
                rounds: int = 4, new_tokens: int = 32) -> float:
    """The median of `paired_speed_ratios` (machines are noisy: side by side in one call is the only comparison
    that holds, and the median of paired rounds ignores one disturbed round)."""
    return statistics.median(paired_speed_ratios(model, inputs, method, base_method, pad_token_id, rounds=rounds,
                                                 new_tokens=new_tokens))


@contextlib.contextmanager
def timed_routing(adapter) -> Iterator[list[float]]:
    """Accumulate in `spent[0]` the wall-clock seconds spent in `adapter`'s router hooks: each forward's stream
    setup (layer 0's hook), delta pushes, router mixing and the hooks' own Python.

    Host time: on CUDA the kernels run asynchronously, so there it counts the launches only.
    """
    spent = [0.0]

    def timed(hook: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    from vlm_retrofit.routing import entry

    # The hook functions are swapped for timed ones in place, on the same modules.
    wrapped = [(module, entry.entry_hook(module)) for module in adapter._entry_modules()]
    for module, hook in wrapped:
        entry.replace_hook(module, timed(hook))
    try:
        yield spent
    finally:
        for module, hook in wrapped:
            entry.replace_hook(module, hook)


@torch.no_grad()
def routing_share(model, adapter, inputs: dict[str, Any], pad_token_id: int, *, rounds: int = 3,
                  new_tokens: int = 32) -> float:
    """Fraction of a routed `generate` call's wall clock spent routing (the fastest of `rounds` calls).

    A wall-clock ratio against the base moves by several per cent between calls on a busy CPU; this share is
    measured inside one call, so it resolves the router overhead (1 / (1 - share)) far more finely. It leaves
    out the dispatch of the hooks and any slowdown routing causes in the layers themselves (evicted caches).
    """
    best_total, best_share = math.inf, 0.0
    for _ in range(rounds):
        with timed_routing(adapter) as spent:
            total = timed_generate(model, inputs, pad_token_id, new_tokens)
        if total < best_total:
            best_total, best_share = total, spent[0] / total
    return best_share


def _sync() -> None:
    # GPU kernels run asynchronously: a wall-clock reading must wait for them.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def nullmethod() -> ContextManager[Any]:
    return contextlib.nullcontext()
