"""Training-free probe of stand-ins for skipped layers: random per-token skipping of the cheapest layers on held-out
Austen text, with the skipped layers' stand-ins at zero (a plain skip) and fitted by least squares.

    python -m bench.stand_in_probe [--candidates 9] [--rates 0.333 0.667] [--fit-chunks 64]

Routers at init (uniform routing: the retrofit is the plain model), block size 1. The stand-ins are fitted on
`--fit-chunks` chunks of the Austen training split (the full model's stream) and measured on val chunks after the
ones the bench calibrates on; the candidates are the first `--candidates` layers of the bench's removal order
(`RUNS/removal_order.json`, written by `bench.run` / `bench.heal`). Prints perplexity ratios to the base.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from .run import RUNS


def _chunks(tokenizer, text: str, count: int, length: int, skip: int = 0) -> torch.Tensor:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    chunks = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][skip:skip + count]
    return torch.stack(chunks)


@torch.no_grad()
def mean_nll(model, chunks: torch.Tensor, batch: int = 4) -> float:
    """Mean next-token negative log-likelihood over `chunks` [N, T]."""
    total, count = 0.0, 0
    for ids in chunks.split(batch):
        logits = model(input_ids=ids).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                         reduction="sum"))
        count += ids[:, 1:].numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", type=int, default=9, help="cheapest layers random skipping may skip")
    parser.add_argument("--rates", type=float, nargs="+", default=[1 / 3, 2 / 3],
                        help="per-token skip probability on each candidate layer")
    parser.add_argument("--fit-chunks", type=int, default=64, help="Austen training chunks the stand-ins fit on")
    parser.add_argument("--eval-chunks", type=int, default=16, help="held-out val chunks measured")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--runs", default=str(RUNS), help="where removal_order.json is")
    args = parser.parse_args(argv)

    from vlm_retrofit import RouterConfig, attach_routers
    from vlm_retrofit.routing import fit_stand_ins
    from vlm_retrofit.skipping import RandomPolicy

    from .data import austen_split
    from .real_vlm import load_real_vlm

    torch.manual_seed(0)
    model, processor = load_real_vlm(build=False)
    tokenizer = processor.tokenizer
    order = json.loads((Path(args.runs) / "removal_order.json").read_text())["order"]
    candidates = order[:args.candidates]
    fit = _chunks(tokenizer, "\n\n".join(austen_split("train")) + "\n", args.fit_chunks, args.chunk_tokens)
    held_out = _chunks(tokenizer, "\n\n".join(austen_split("val")) + "\n", args.eval_chunks, args.chunk_tokens,
                       skip=16)  # after the val chunks the bench calibrates per-token policies on
    adapter = attach_routers(model, RouterConfig(skip_stand_in=True))
    base = mean_nll(model, held_out)
    print(f"base perplexity {math.exp(base):.2f} on {held_out.shape[0]} x {held_out.shape[1]} held-out tokens; "
          f"candidates (cheapest first): {candidates}")
    started = time.perf_counter()
    explained = fit_stand_ins(adapter, [{"input_ids": ids} for ids in fit.split(8)], ridge=args.ridge,
                              layers=candidates)
    print(f"stand-ins fitted on {fit.numel()} tokens in {time.perf_counter() - started:.0f} s; R^2 "
          + ", ".join(f"{i}:{explained[i]:.2f}" for i in candidates))
    fitted = {k: v.clone() for k, v in adapter.stand_ins.state_dict().items()}
    zero = {k: torch.zeros_like(v) for k, v in fitted.items()}
    print("| skip rate on the candidates | layer executions skipped | ppl ratio, plain skip | ppl ratio, stand-ins |")
    print("|---|---|---|---|")
    for rate in args.rates:
        ratios = []
        for state in (zero, fitted):
            adapter.stand_ins.load_state_dict(state)
            with adapter.skipping(RandomPolicy(rate=rate, seed=0, blocks=candidates)) as report:
                ratios.append(math.exp(mean_nll(model, held_out) - base))
        print(f"| {rate:.3f} | {report.skipped_layer_fraction:.3f} | x{ratios[0]:.3f} | x{ratios[1]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
