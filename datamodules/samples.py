"""Decoding one raw WebDataset sample (bytes per extension) into a validated `Example`, or a skip reason."""

from __future__ import annotations

import io
import json
import re
import warnings
from typing import Any, Sequence

import numpy as np
from PIL import Image

from .formatting import Example

_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "model": "assistant",
          "bot": "assistant", "system": "system"}
_IMAGE_MARK = re.compile(r"\s*<image>\s*")


class Skip(Exception):
    """A sample that cannot be used: `reason` (one of quality.REASONS) and a short detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Transparency is composited on white; high bit-depth greyscale is rescaled."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        hi = a.max() if a.size else 1.0
        scale = 255.0 if img.mode == "F" and hi <= 1.0 else (255.0 / 65535.0 if hi > 255 else 1.0)
        img = Image.fromarray(np.clip(a * scale, 0, 255).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return img.convert("RGB")


MAX_IMAGE_PIXELS = 40_000_000
"""Images with more pixels are skipped (`huge_image`), by the datamodule's default and by the shard builder."""


def decode_image(data: bytes, max_image_pixels: int, max_image_side: int) -> Image.Image:
    """Bytes -> RGB PIL image, or `Skip("corrupt_image" | "huge_image")`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_image_pixels:
                raise Skip("huge_image", f"{w}x{h} > max_image_pixels={max_image_pixels}")
            if max(w, h) > max_image_side and img.format == "JPEG":
                img.draft("RGB", (max_image_side, max_image_side))  # cheap DCT-domain downscale
            img.load()
    except Skip:
        raise
    except Image.DecompressionBombError as exn:
        raise Skip("huge_image", str(exn)) from None
    except Exception as exn:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise Skip("corrupt_image", f"{type(exn).__name__}: {exn}") from None
    if w == 0 or h == 0:
        raise Skip("corrupt_image", "empty image")
    img = to_rgb(img)
    if max(img.size) > max_image_side:
        img.thumbnail((max_image_side, max_image_side), Image.Resampling.BICUBIC)
    return img


def _content(content: Any) -> tuple[str, bool]:
    """(text, mentions_image) of a message content: a string or a list of typed parts."""
    if content is None:
        return "", False
    if isinstance(content, str):
        return _IMAGE_MARK.sub(" ", content).strip(), "<image>" in content
    if isinstance(content, list):
        texts, image = [], False
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                image = True
            elif isinstance(part, dict) and "text" in part:
                texts.append(str(part["text"]))
        text, mark = _content(" ".join(texts))
        return text, image or mark
    raise Skip("bad_json", f"message content of type {type(content).__name__}")


def parse_conversation(messages: Any) -> tuple[list[tuple[str, str]], bool]:
    """Normalised (role, text) turns ending with an assistant turn, and whether an image is referenced."""
    if not isinstance(messages, list) or not messages:
        raise Skip("bad_json", "conversation is not a non-empty list")
    turns, image = [], False
    for m in messages:
        if not isinstance(m, dict):
            raise Skip("bad_json", "message is not an object")
        role = _ROLES.get(str(m.get("role", m.get("from", ""))).lower())
        if role is None:
            raise Skip("bad_json", f"unknown role {m.get('role', m.get('from'))!r}")
        text, mark = _content(m.get("content", m.get("value")))
        image |= mark
        turns.append((role, text))
    while turns and turns[-1][0] != "assistant":
        turns.pop()
    if not any(r == "assistant" and t for r, t in turns):
        raise Skip("empty_text", "no non-empty assistant turn")
    if not any(r == "user" for r, _ in turns):
        turns.insert(0 if turns[0][0] != "system" else 1, ("user", ""))
    return turns, image


def parse_text(ext: str, data: bytes, prompt: str) -> tuple[list[tuple[str, str]], bool, bool]:
    """(turns, needs_image, is_caption) from a txt or json payload."""
    if ext == "json":
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exn:
            raise Skip("bad_json", str(exn)) from None
        if isinstance(obj, list):
            turns, image = parse_conversation(obj)
            return turns, image, False
        if not isinstance(obj, dict):
            raise Skip("bad_json", "expected an object or a list")
        for name in ("messages", "conversations"):
            if name in obj:
                turns, image = parse_conversation(obj[name])
                return turns, image, False
        caption = obj.get("caption", obj.get("text"))
        if not isinstance(caption, str):
            raise Skip("bad_json", "no caption/text/messages field")
    else:
        caption = data.decode("utf-8", errors="replace")
    caption = caption.strip()
    if not caption:
        raise Skip("empty_text", "empty caption")
    return [("user", prompt), ("assistant", caption)], True, True


def decode_sample(sample: dict[str, Any], image_keys: Sequence[str], text_keys: Sequence[str], prompt: str,
                  max_image_pixels: int, max_image_side: int) -> Example:
    """A raw sample (`__key__`, `__url__`, ext -> bytes) -> `Example`, or raises `Skip`.

    Rules (documented for users of the data module):

    * Text: the first of `text_keys` present. `txt` = a caption (needs an image). `json` = a caption
      (`{"caption"|"text": ...}`, needs an image) or a conversation (`{"messages"|"conversations": [...]}` or a bare
      list; roles user/human, assistant/gpt/model, system; content a string or a list of `{"type": "text"|"image"}`
      parts; LLaVA-style `<image>` markers are removed). A conversation with no image reference and no image file is
      a TEXT-ONLY sample (mixing text data into the stream); one that mentions an image needs the image file.
    * Images: odd modes are CONVERTED to RGB (alpha composited on white; P, L, 1, CMYK, YCbCr, 16-bit and float
      greyscale rescaled). Images with more than `max_image_pixels` pixels are SKIPPED (`huge_image`) before being
      decoded (decompression-bomb safe); others with a side longer than `max_image_side` are DOWNSCALED (aspect
      kept) before the processor sees them.
    """
    key, url = sample.get("__key__"), sample.get("__url__", "?")
    text_key = next((k for k in text_keys if k in sample), None)
    image_key = next((k for k in image_keys if k in sample), None)
    if text_key is None:
        raise Skip("missing_text", f"none of {list(text_keys)} (has {sorted(k for k in sample if k[:2] != '__')})")
    turns, needs_image, _ = parse_text(text_key, sample[text_key], prompt)
    if image_key is None:
        if needs_image:
            raise Skip("missing_image", f"none of {list(image_keys)} (has "
                                        f"{sorted(k for k in sample if k[:2] != '__')})")
        return Example(key, url, turns, None)
    image = decode_image(sample[image_key], max_image_pixels, max_image_side)
    return Example(key, url, turns, image)
