"""Turning decoded samples into model batches with the backbone's own processor, chat template and loss mask."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from vlm_retrofit.backbones.loading import require_chat_template

log = logging.getLogger("vlm_retrofit.datamodules")


@dataclass
class Example:
    """A decoded, validated sample: `turns` are (role, text) pairs; the image belongs to the first user turn."""

    key: str
    url: str
    turns: list[tuple[str, str]]
    image: Image.Image | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_processor(name: str):
    """`"tiny:<family>"` -> `vlm_retrofit.testing.tiny_vlm(family)[1]`; else a HF id / local path via
    `AutoProcessor.from_pretrained(name, trust_remote_code=False)`, falling back to `AutoTokenizer` for text LMs."""
    if name.startswith("tiny:"):
        from vlm_retrofit.testing import tiny_vlm

        return tiny_vlm(name.split(":", 1)[1])[1]
    from vlm_retrofit.backbones.loading import load_processor as load_pretrained_processor

    return load_pretrained_processor(name)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatFormatter:
    """Renders `Example`s with the processor's chat template and collates them into a model batch.

    Conventions (the training loss relies on them):

    * Batches are RIGHT-padded: row i holds its real tokens at positions `0 .. L_i-1` (`L_i = attention_mask[i].sum()`).
    * `loss_mask[i, t]` is True iff `input_ids[i, t+1]` is a response token, i.e. it is aligned with the logits:
      `logits[:, t]` predicts `input_ids[:, t+1]`, so `loss = ce(logits[:, :-1][loss_mask[:, :-1]],
      input_ids[:, 1:][loss_mask[:, :-1]])`. The last column is always False.
    * Response tokens = every assistant turn's content plus the template's end-of-turn marker (e.g. `<|im_end|>`,
      `<end_of_utterance>`), excluding whitespace the template puts after it. Prompt, image and padding tokens are
      never in the mask. Decoding `input_ids[:, 1:][loss_mask[:, :-1]]` of a caption sample gives the caption
      (possibly with a leading space, from byte-level BPE) followed by the end-of-turn marker.
    * Mixed image / text-only batches: the processor gets all texts and, per sample, a (possibly empty) list of
      images. Families whose processor cannot mix (found by probing at start) get one modality per batch.
    * One image per sample, placed before the prompt in the first user turn.

    `collate(examples)` returns `(batch or None, rejected)` where `rejected` lists `(example, reason, detail)` for
    samples that could not be used (reasons `too_long`, `format_error`). `max_length` truncates the sequence on
    the right (losing the end of a long response); a sample whose prompt alone does not fit is rejected.
    """

    def __init__(self, processor, max_length: int = 512, source: str = "the backbone"):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.suffix_style = type(processor).__name__.startswith("PaliGemma")  # prompt / suffix, no chat turns
        if not self.suffix_style:
            require_chat_template(processor, source, "formats the training samples and their loss mask")
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_length = max_length
        self.takes_images = hasattr(processor, "image_processor")
        self._warned_text_only = False
        self.image_layout = self._probe() if self.takes_images else "none"
        self.can_mix = self.image_layout in ("nested", "flat", "none")

    # ------------------------------------------------------------------ chat rendering
    def chat(self, ex: Example) -> list[dict]:
        """`ex` as chat-template messages (content parts for processors, plain strings for tokenizers)."""
        msgs, image_done = [], False
        for role, text in ex.turns:
            if not self.takes_images:
                msgs.append({"role": role, "content": text})
                continue
            content = [{"type": "text", "text": text}]
            if role == "user" and ex.image is not None and not image_done:
                content.insert(0, {"type": "image"})
                image_done = True
            msgs.append({"role": role, "content": content})
        return msgs

    def _render(self, msgs: list[dict], gen: bool = False) -> str:
        return self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def spans(self, msgs: list[dict]) -> tuple[str, list[tuple[int, int, list[int]]]]:
        """Rendered text and, per assistant turn, (start, stop) counted from the END of the sequence + its ids.

        Counting from the end makes the spans independent of how many tokens the processor expands the image
        into (the image sits before every response)."""
        full = self._render(msgs)
        ids = self._ids(full)
        out = []
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            a = _lcp(self._ids(self._render(msgs[:j], gen=True)), ids)
            b = _lcp(self._ids(self._render(msgs[: j + 1]).rstrip()), ids)
            if b > a:
                out.append((len(ids) - a, len(ids) - b, ids[a:b]))
        return full, out

    # ------------------------------------------------------------------ processor calls
    def _call(self, texts: list[str], images: list[Image.Image | None], layout: str | None = None):
        layout = layout or self.image_layout
        kw: dict[str, Any] = dict(padding=True, padding_side="right", return_tensors="pt")
        if not self.takes_images:
            return dict(self.tokenizer(texts, add_special_tokens=False, return_token_type_ids=False, **kw))
        if any(im is not None for im in images):
            if layout == "flat":
                kw["images"] = [im for im in images if im is not None]
            else:
                kw["images"] = [[im] if im is not None else [] for im in images]
        out = dict(self.processor(text=texts, add_special_tokens=False, **kw))
        out.pop("labels", None)
        return out

    def _probe(self) -> str:
        """Which `images=` layout lets this processor take image and text-only samples in one call."""
        if self.suffix_style:
            return "suffix"
        img = Image.new("RGB", (32, 32), (128, 64, 0))
        texts = [self._render(self.chat(Example("p", "", [("user", "Hi"), ("assistant", "Yo")], im)))
                 for im in (img, None)]
        for layout in ("nested", "flat"):
            try:
                self._call(texts, [img, None], layout)
                return layout
            except Exception:  # noqa: BLE001 - any failure means "try the next layout"
                continue
        return "grouped"  # one modality per batch; nested lists, which also work for single-modality batches

    def _suffix_call(self, examples: list[Example]):
        """PaliGemma-style processors: `processor(text=prompt, images=..., suffix=response)`; labels mark the
        response (suffix) tokens, which also get token_type_ids 1."""
        if any(ex.image is None for ex in examples):
            raise ValueError("this processor needs an image in every sample")
        image_token = getattr(self.processor, "image_token", "<image>")
        prompts = [image_token + next(t for r, t in ex.turns if r == "user") for ex in examples]
        answers = [[t for r, t in ex.turns if r == "assistant"][-1] for ex in examples]
        out = dict(self.processor(text=prompts, images=[ex.image for ex in examples], suffix=answers,
                                  padding=True, padding_side="right", return_tensors="pt"))
        labels = out.pop("labels")
        return out, labels != -100

    # ------------------------------------------------------------------ collate
    def collate(self, examples: list[Example]) -> tuple[dict[str, Any] | None, list[tuple[Example, str, str]]]:
        rejected: list[tuple[Example, str, str]] = []
        if not self.takes_images and any(ex.image is not None for ex in examples):
            if not self._warned_text_only:
                log.warning("text-only processor: images are dropped, their captions train as text")
                self._warned_text_only = True
            examples = [Example(ex.key, ex.url, ex.turns, None, ex.extra) for ex in examples]
        while examples:
            try:
                out, resp = self._encode(examples)
            except Exception as exn:  # noqa: BLE001 - find the culprit(s) one by one
                if len(examples) == 1:
                    return None, rejected + [(examples[0], "format_error", f"{type(exn).__name__}: {exn}")]
                good = []
                for ex in examples:
                    try:
                        self._encode([ex])
                        good.append(ex)
                    except Exception as one:  # noqa: BLE001
                        rejected.append((ex, "format_error", f"{type(one).__name__}: {one}"))
                if len(good) == len(examples):
                    raise
                examples = good
                continue
            lengths = out["attention_mask"].sum(1)
            starts = [(int(n) - s if s is not None else None) for n, s in zip(lengths, resp["first"])]
            long = [i for i, s in enumerate(starts) if s is not None and s >= self.max_length]
            if long:  # the prompt alone does not fit: drop those samples and encode the rest again
                rejected += [(examples[i], "too_long", f"prompt is {starts[i]} tokens > max_length") for i in long]
                examples = [ex for i, ex in enumerate(examples) if i not in long]
                continue
            return self._finish(out, resp["mask"]), rejected
        return None, rejected

    def _encode(self, examples: list[Example]):
        if self.suffix_style:
            out, mask = self._suffix_call(examples)
            firsts = [int(m.nonzero()[0]) if m.any() else None for m in mask]
            n = out["attention_mask"].sum(1)
            return out, {"mask": mask, "first": [None if f is None else int(n[i]) - f for i, f in enumerate(firsts)]}
        chats = [self.chat(ex) for ex in examples]
        rendered = [self.spans(c) for c in chats]
        out = self._call([r[0] for r in rendered], [ex.image for ex in examples])
        ids, lengths = out["input_ids"], out["attention_mask"].sum(1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        first = []
        for i, (_, spans) in enumerate(rendered):
            n = int(lengths[i])
            for start, stop, expect in spans:
                if n - start < 0 or ids[i, n - start:n - stop].tolist() != expect:
                    raise ValueError(f"response tokens of {examples[i].key!r} not found where expected")
                mask[i, n - start:n - stop] = True
            if not spans:
                raise ValueError(f"sample {examples[i].key!r} has no response tokens")
            first.append(spans[0][0])
        return out, {"mask": mask, "first": first}

    def _finish(self, out: dict[str, Any], response: torch.Tensor) -> dict[str, Any]:
        """Truncate sequence-aligned tensors to max_length and shift the response mask into the loss mask."""
        ids = out["input_ids"]
        B, T = ids.shape
        if T > self.max_length:
            for k, v in list(out.items()):
                if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == (B, T) and not k.startswith("pixel"):
                    out[k] = v[:, : self.max_length].contiguous()
            response = response[:, : self.max_length]
        loss_mask = torch.zeros_like(response)
        loss_mask[:, :-1] = response[:, 1:]
        out["loss_mask"] = loss_mask & out["attention_mask"].bool()
        return out
