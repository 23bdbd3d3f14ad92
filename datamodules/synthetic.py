"""Built-in offline data: synthetic shapes images whose captions state colours, shapes, count and positions."""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from .shards import MANIFEST, Record, write_manifest, write_records

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 210, 20),
           "purple": (140, 50, 170), "orange": (250, 140, 20), "black": (15, 15, 15)}
BACKGROUNDS = {"white": (255, 255, 255), "grey": (170, 170, 170)}
SHAPES = ("circle", "square", "triangle")
# 3 x 3 grid cells in reading order.
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
_COUNT = {1: "One shape", 2: "Two shapes", 3: "Three shapes"}
GENERATOR_VERSION = 1


def _where(pos: str) -> str:
    return "in the centre" if pos == "centre" else f"at the {pos}"


def render_scene(rng: random.Random, size: int = 64) -> tuple[Image.Image, str]:
    """One image with 1-3 shapes in distinct grid cells and the caption that describes it exactly."""
    bg = rng.choice(sorted(BACKGROUNDS))
    img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
    draw = ImageDraw.Draw(img)
    cells = sorted(rng.sample(range(9), rng.randint(1, 3)))
    cell, parts = size / 3, []
    for c in cells:
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        x0, y0 = (c % 3) * cell, (c // 3) * cell
        m = cell * 0.15
        box = (x0 + m, y0 + m, x0 + cell - m, y0 + cell - m)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=COLOURS[colour])
        parts.append(f"a {colour} {shape} {_where(POSITIONS[c])}")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return img, f"{_COUNT[len(cells)]} on a {bg} background: {listed}."


def text_conversation(rng: random.Random) -> list[dict]:
    """A text-only question/answer pair (arithmetic or colour facts), to mix text data into the stream."""
    if rng.random() < 0.5:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    else:
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        q, ans = f"Name the shape and colour in: a {colour} {shape}.", f"It is a {shape} and it is {colour}."
    return [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]


def synthetic_records(num_samples: int, seed: int = 0, image_size: int = 64,
                      text_only_fraction: float = 0.0) -> list[Record]:
    """`num_samples` builder records (PNG + txt caption, or a json text-only conversation)."""
    rng = random.Random(seed)
    records = []
    for i in range(num_samples):
        if rng.random() < text_only_fraction:
            files = {"json": json.dumps({"messages": text_conversation(rng)}, sort_keys=True).encode()}
        else:
            img, caption = render_scene(rng, image_size)
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            files = {"png": buf.getvalue(), "txt": caption.encode()}
        records.append(Record(f"synth_{i:06d}", f"synthetic:{i}", lambda files=files: files))
    return records


def synthetic_spec(**kw) -> dict:
    return {"version": GENERATOR_VERSION, **kw}


def write_synthetic_shards(
    output_dir: str | os.PathLike,
    num_samples: int = 512,
    seed: int = 0,
    image_size: int = 64,
    maxcount: int = 64,
    val_fraction: float = 0.125,
    min_val_shards: int = 4,
    text_only_fraction: float = 0.0,
) -> dict:
    """Render `num_samples` synthetic samples and write them as train/val shards; returns the manifest.

    `write_synthetic_shards(dir)` renders them with Pillow and writes them through the shard builder, giving the
    usual layout: `dir/train-000000.tar ...`, `dir/val-000000.tar ...` and `dir/manifest.json` (whose `synthetic`
    entry records the generator arguments, so a cache can tell whether it is still valid).
    """
    spec = synthetic_spec(num_samples=num_samples, seed=seed, image_size=image_size, maxcount=maxcount,
                          val_fraction=val_fraction, min_val_shards=min_val_shards,
                          text_only_fraction=text_only_fraction)
    records = synthetic_records(num_samples, seed, image_size, text_only_fraction)
    manifest = write_records(records, output_dir, maxcount, val_fraction, seed, min_val_shards,
                             source="synthetic")
    manifest["synthetic"] = spec
    write_manifest(output_dir, manifest)
    return manifest


def ensure_synthetic_shards(output_dir: str | os.PathLike, **kw) -> dict:
    """Reuse `output_dir` if its manifest was written with the same arguments and all shards exist; else write."""
    path = Path(output_dir) / MANIFEST
    defaults = write_synthetic_shards.__defaults__
    names = write_synthetic_shards.__code__.co_varnames[1:1 + len(defaults)]
    wanted = synthetic_spec(**{**dict(zip(names, defaults)), **kw})
    try:
        manifest = json.loads(path.read_text())
        shards = [s for split in manifest["splits"].values() for s in split["shards"]]
        if manifest.get("synthetic") == wanted and all(
                (Path(output_dir) / s["name"]).stat().st_size == s["bytes"] for s in shards):
            return manifest
    except (OSError, ValueError, KeyError):
        pass
    return write_synthetic_shards(output_dir, **kw)
