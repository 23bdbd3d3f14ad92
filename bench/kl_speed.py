"""Distillation KL: the chunked KL with its gradient written in the forward vs autograd through log_softmax + kl_div.

    python -m bench.kl_speed            # SmolLM2's and Qwen2-VL's vocabularies, caption- and prose-sized batches

Prints, side by side in one run, forward + backward time (median of paired rounds) and the bytes held for the
backward between the two (what a training step keeps alive beside the activations) as ratios new / reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm_retrofit.training.losses import distillation_kl


def reference_kl(student, teacher, mask, temperature=1.0):
    """The formula autograd differentiates: what `distillation_kl` computed before it was chunked."""
    s, t = student[mask].float() / temperature, teacher[mask].float() / temperature
    log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    return torch.nn.functional.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1).mean() * temperature ** 2


def saved_bytes_and_seconds(fn, student, teacher, mask) -> tuple[int, float]:
    """Bytes of the tensors autograd holds for the backward of `fn`, and seconds of its forward + backward."""
    held: dict[int, int] = {}

    def pack(tensor):
        held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    student = student.detach().requires_grad_(True)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = fn(student, teacher, mask)
    loss.backward()
    return sum(held.values()), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Print the table: each shape timed in paired rounds, both KLs on the same logits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| vocabulary | positions (B x T) | reference s | chunked s | time ratio | held MB ref / chunked | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for vocab, batch, length in ((49_152, 4, 100), (49_152, 4, 215), (151_936, 4, 256)):
        generator = torch.Generator().manual_seed(0)
        student = torch.randn(batch, length, vocab, generator=generator).to(torch.bfloat16)
        teacher = torch.randn(batch, length, vocab, generator=generator).to(torch.bfloat16)
        mask = torch.rand(batch, length, generator=generator) < 0.8
        times: dict[str, list[float]] = {"reference": [], "chunked": []}
        held = {}
        for _ in range(args.rounds):  # paired rounds, alternating: the machine's drift hits both
            for name, fn in (("reference", reference_kl), ("chunked", distillation_kl)):
                held[name], seconds = saved_bytes_and_seconds(fn, student, teacher, mask)
                times[name].append(seconds)
        ref, new = statistics.median(times["reference"]), statistics.median(times["chunked"])
        print(f"| {vocab:,} | {int(mask.sum())} ({batch} x {length}) | {ref:.3f} | {new:.3f} | {new / ref:.2f} | "
              f"{held['reference'] / 2**20:.0f} / {held['chunked'] / 2**20:.0f} | {held['chunked'] / held['reference']:.2f} |")


if __name__ == "__main__":
    main()
