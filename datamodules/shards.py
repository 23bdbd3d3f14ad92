"""Shard builder: image + caption folders or JSONL into byte-reproducible WebDataset tars with a manifest."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import random
import re
import sys
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from PIL import Image

from vlm_retrofit.errors import InputError

from .samples import MAX_IMAGE_PIXELS

MANIFEST = "manifest.json"
FORMAT = "vlm_retrofit.shards/1"
IMAGE_EXTS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp", ".gif": "gif",
              ".tif": "tif", ".tiff": "tif"}
_STORED = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # kept byte-for-byte; other formats become PNG


class SkipInput(Exception):
    """An input item that cannot become a sample; `args[0]` is the reason."""


@dataclass
class Record:
    """One sample before writing: `files` maps extension -> bytes (loaded lazily by `load`)."""

    key: str
    source: str
    load: Callable[[], dict[str, bytes]] = field(repr=False)


def write_tar(path: str | os.PathLike, samples: Iterable[tuple[str, dict[str, bytes]]]) -> tuple[int, str]:
    """Write `(key, {ext: bytes})` samples as a deterministic tar; returns (bytes written, sha256 hex)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for key, files in samples:
            for ext in sorted(files):
                data = files[ext]
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    _atomic_write(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def _atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write via a per-process temp file + rename: concurrent writers (ranks) never expose partial files."""
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_manifest(output: str | os.PathLike, manifest: dict) -> None:
    _atomic_write(Path(output) / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def sanitize_key(name: str) -> str:
    """A webdataset-safe key: no dots (they start the extension), only [A-Za-z0-9_-/]."""
    return re.sub(r"[^A-Za-z0-9_\-/]", "_", name).strip("/") or "_"


def image_file(data: bytes, max_image_pixels: int = MAX_IMAGE_PIXELS) -> tuple[str, bytes]:
    """Validate image bytes; return (extension, bytes), re-encoding formats other than jpg/png/webp as PNG. An image
    that training would skip (more than `max_image_pixels` pixels, the datamodule's setting of that name) is left out
    here, listed as `huge_image`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides
            img = Image.open(io.BytesIO(data))
        with img:
            fmt = img.format
            if img.width * img.height > max_image_pixels:
                raise SkipInput("huge_image", f"{img.width}x{img.height} > {max_image_pixels} pixels, which the "
                                "datamodule skips (max_image_pixels): downscale it, or raise both limits")
            img.load()
            if fmt in _STORED:
                return _STORED[fmt], data
            out = io.BytesIO()
            img.save(out, format="PNG")
            return "png", out.getvalue()
    except SkipInput:
        raise
    except Image.DecompressionBombError as exn:  # beyond PIL's own limit (~179 M pixels)
        raise SkipInput("huge_image", str(exn)) from None
    except Exception as exn:  # noqa: BLE001 - anything PIL raises means unusable
        raise SkipInput("corrupt_image", f"{type(exn).__name__}: {exn}") from None


def text_file(text: str | None = None, messages: list | None = None) -> dict[str, bytes]:
    """`{"txt": caption}` or `{"json": {"messages": ...}}`, validated non-empty."""
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise SkipInput("bad_json", "conversation must be a non-empty list")
        return {"json": json.dumps({"messages": messages}, sort_keys=True, ensure_ascii=False).encode()}
    if text is None:
        raise SkipInput("missing_text", "no text")
    if not str(text).strip():
        raise SkipInput("empty_text", "empty caption")
    return {"txt": str(text).strip().encode("utf-8")}


def _folder_records(root: Path, max_image_pixels: int) -> tuple[list[Record], list[dict]]:
    groups: dict[str, dict[str, Path]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        stem = str(rel.with_suffix("")).replace(os.sep, "/")
        suffix = path.suffix.lower()
        kind = "image" if suffix in IMAGE_EXTS else {".txt": "txt", ".json": "json"}.get(suffix, "other")
        if kind == "other" and path.name.startswith("."):
            continue  # hidden files (.DS_Store, ...) are no samples
        group = groups.setdefault(stem, {})
        if kind in group and kind != "other":
            group.setdefault("dup", path)
        group[kind] = path
    records, skipped = [], []
    # Names that differ only in characters a key cannot hold ("photo.1", "photo_1") would share one key, and the
    # reader would merge or drop their samples: all of them are left out, listed.
    stems_of_key: dict[str, list[str]] = {}
    for stem in groups:
        stems_of_key.setdefault(sanitize_key(stem), []).append(stem)
    for stem, group in sorted(groups.items()):
        src = str(group.get("image") or group.get("txt") or group.get("json") or group.get("other"))
        key = sanitize_key(stem)
        if len(stems_of_key[key]) > 1:
            skipped.append({"source": src, "reason": "ambiguous",
                            "detail": f"names {sorted(stems_of_key[key])} all become key {key!r}: rename them"})
        elif "dup" in group:
            skipped.append({"source": src, "reason": "ambiguous", "detail": "several files with this name"})
        elif "other" in group and "image" not in group:
            # Not silently dropped: a caption beside an image of a format PIL is not asked to read (.heic) was
            # otherwise reported as a caption without an image.
            skipped.append({"source": str(group["other"]), "reason": "unsupported_file",
                            "detail": f"not an image of {'/'.join(sorted(set(IMAGE_EXTS.values())))}, a .txt caption "
                                      "or a .json conversation"})
        elif "image" not in group and "txt" in group:
            skipped.append({"source": src, "reason": "missing_image", "detail": "caption without an image"})
        elif "txt" not in group and "json" not in group:
            skipped.append({"source": src, "reason": "missing_text", "detail": "image without a .txt caption"})
        else:
            records.append(Record(key, src, _folder_loader(group, max_image_pixels)))
    return records, skipped


def _folder_loader(group: dict[str, Path], max_image_pixels: int) -> Callable[[], dict[str, bytes]]:
    def load() -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        if "txt" in group:
            files.update(text_file(group["txt"].read_text(encoding="utf-8", errors="replace")))
        else:
            try:
                obj = json.loads(group["json"].read_text(encoding="utf-8"))
            except ValueError as exn:
                raise SkipInput("bad_json", str(exn)[:200]) from None
            files.update(_json_text(obj))
        if "image" in group:
            ext, data = image_file(group["image"].read_bytes(), max_image_pixels)
            files[ext] = data
        elif "txt" in files:
            raise SkipInput("missing_image", "caption without an image")
        return files

    return load


def _json_text(obj) -> dict[str, bytes]:
    if isinstance(obj, list):
        return text_file(messages=obj)
    if not isinstance(obj, dict):
        raise SkipInput("bad_json", "expected an object")
    for name in ("messages", "conversations"):
        if name in obj:
            return text_file(messages=obj[name])
    for name in ("text", "caption"):
        if name in obj:
            return text_file(text=obj[name])
    raise SkipInput("missing_text", "no text/caption/messages field")


def _jsonl_records(path: Path, max_image_pixels: int) -> tuple[list[Record], list[dict]]:
    records, skipped, seen = [], [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise InputError(f"shard builder input {path} is not a UTF-8 text file ({error.reason} at byte {error.start}): "
                         "give a folder of images with same-name .txt captions, or a JSONL file of records") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        src = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError as exn:
            skipped.append({"source": src, "reason": "bad_json", "detail": str(exn)[:200]})
            continue
        key = sanitize_key(str(obj.get("key") or obj.get("id") or f"{lineno:08d}"))
        if key in seen:
            skipped.append({"source": src, "reason": "ambiguous", "detail": f"duplicate key {key!r}"})
            continue
        seen.add(key)
        image = obj.get("image") or obj.get("image_path")
        records.append(Record(key, src, _jsonl_loader(obj, path.parent / image if image else None, max_image_pixels)))
    return records, skipped


def _jsonl_loader(obj: dict, image: Path | None, max_image_pixels: int) -> Callable[[], dict[str, bytes]]:
    def load() -> dict[str, bytes]:
        files = _json_text(obj)
        if image is not None:
            if not image.is_file():
                raise SkipInput("missing_image", f"{image} does not exist")
            ext, data = image_file(image.read_bytes(), max_image_pixels)
            files[ext] = data
        elif "txt" in files:
            raise SkipInput("missing_image", "caption without an image")
        return files

    return load


def _split_sizes(n: int, maxcount: int, min_shards: int) -> list[int]:
    """Shard sizes for n samples: at most maxcount each, at least min(min_shards, n) shards, near-equal."""
    if n == 0:
        return []
    k = max(math.ceil(n / maxcount), min(min_shards, n))
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def write_records(
    records: Sequence[Record],
    output: str | os.PathLike,
    maxcount: int = 1000,
    val_fraction: float = 0.0,
    seed: int = 0,
    min_val_shards: int = 1,
    skipped: list[dict] | None = None,
    source: str = "",
) -> dict:
    """Validate, shuffle (by `seed`), split and write `records`; returns the manifest (also written to disk)."""
    if maxcount < 1 or not 0.0 <= val_fraction < 1.0:
        raise InputError(f"need maxcount >= 1 and 0 <= val_fraction < 1, got {maxcount}, {val_fraction}")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    skipped = list(skipped or [])
    good: list[tuple[Record, dict[str, bytes]]] = []
    for rec in sorted(records, key=lambda r: r.key):
        try:
            good.append((rec, rec.load()))
        except SkipInput as exn:
            skipped.append({"source": rec.source, "reason": exn.args[0], "detail": " ".join(map(str, exn.args[1:]))})
        except (OSError, ValueError) as exn:
            skipped.append({"source": rec.source, "reason": "unreadable", "detail": f"{type(exn).__name__}: {exn}"})
    random.Random(seed).shuffle(good)
    n_val = round(len(good) * val_fraction)
    if val_fraction > 0 and n_val == 0 and len(good) >= 2:
        n_val = 1
    splits = {"val": good[:n_val], "train": good[n_val:]}
    manifest: dict = {"format": FORMAT, "input": source, "seed": seed, "maxcount": maxcount,
                      "val_fraction": val_fraction, "num_samples": len(good), "splits": {}}
    written = set()
    for split in ("train", "val"):
        items, shards, start = splits[split], [], 0
        sizes = _split_sizes(len(items), maxcount, min_val_shards if split == "val" else 1)
        for i, size in enumerate(sizes):
            name = f"{split}-{i:06d}.tar"
            chunk = items[start:start + size]
            start += size
            nbytes, digest = write_tar(out / name, [(rec.key, files) for rec, files in chunk])
            shards.append({"name": name, "num_samples": len(chunk), "bytes": nbytes, "sha256": digest})
            written.add(name)
        if shards:
            pattern = f"{split}-{{000000..{len(shards) - 1:06d}}}.tar"
            manifest["splits"][split] = {"pattern": pattern, "num_samples": len(items), "shards": shards}
    for stale in out.glob("*.tar"):  # shards of an earlier, larger build would pollute the patterns
        if re.fullmatch(r"(train|val)-\d{6}\.tar", stale.name) and stale.name not in written:
            stale.unlink()
    manifest["skipped"] = sorted(skipped, key=lambda s: (s["source"], s["reason"]))
    write_manifest(out, manifest)
    return manifest


def build_shards(
    input: str | os.PathLike,  # noqa: A002 - mirrors the --input flag
    output: str | os.PathLike,
    maxcount: int = 1000,
    val_fraction: float = 0.0,
    seed: int = 0,
    min_val_shards: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> dict:
    """Build shards from a folder (`x.jpg` + `x.txt`, or `x.json` conversations) or a JSONL file.

    JSONL lines: `{"image": "rel/or/abs.jpg", "text": "caption"}` (also `caption`), or
    `{"messages": [...]}` / `{"conversations": [...]}` with an optional `image` (text-only conversations are
    allowed); optional `key`/`id`. Unusable inputs are listed in `manifest["skipped"]` with a reason, images with
    more than `max_image_pixels` pixels among them (`huge_image`: a datamodule with that limit would skip them).

    Output layout (`build_shards(..., output)`)::

        output/train-000000.tar, train-000001.tar, ...   # training split
        output/val-000000.tar, ...                       # validation split (only if val_fraction > 0)
        output/manifest.json                             # per-shard samples / bytes / sha256, skipped inputs

    Each sample is stored under a key (`<key>.jpg|png|webp` + `<key>.txt` for captions, `<key>.json` holding
    `{"messages": [...]}` for conversations), so any webdataset reader can use the tars. Tar members carry fixed
    mtime/uid/gid/mode and appear in a fixed order: the same input (and seed) gives byte-identical shards.
    """
    src = Path(input)
    if src.is_dir():
        records, skipped = _folder_records(src, max_image_pixels)
    elif src.is_file():
        records, skipped = _jsonl_records(src, max_image_pixels)
    else:
        raise FileNotFoundError(f"shard builder input {src} is neither a folder nor a JSONL file")
    if not records:  # before anything is written: an empty manifest would only fail later, at training
        reasons = sorted({item["reason"] for item in skipped})
        raise InputError(f"shard builder input {src} holds no usable sample ({len(skipped)} inputs skipped"
                         f"{': ' + ', '.join(reasons[:5]) if reasons else ''}); expected images with same-name .txt "
                         "captions (or .json conversations) in a folder, or a JSONL file of records")
    return write_records(records, output, maxcount, val_fraction, seed, min_val_shards, skipped, str(input))


def main(argv: list[str] | None = None) -> int:
    """`python -m vlm_retrofit shards --input ... --output ...`; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m vlm_retrofit shards", description=__doc__.split("\n")[0])
    p.add_argument("--input", help="a folder of images with same-name .txt captions (or .json conversations: "
                                   '{"messages": [...]}), or a JSONL file, one record per line: {"image": "a.jpg", '
                                   '"text": "caption"} ("caption" also), or {"messages": [...]} / '
                                   '{"conversations": [...]} with an optional "image" (text-only samples); '
                                   'optional "key" or "id"; image paths relative to the file')
    p.add_argument("--output", required=True, help="directory for the shards and manifest.json")
    p.add_argument("--maxcount", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--val-fraction", type=float, default=0.0, help="fraction held out as val-*.tar (default 0)")
    p.add_argument("--min-val-shards", type=int, default=1,
                   help="spread the val split over at least this many shards (>= ranks x workers)")
    p.add_argument("--seed", type=int, default=0, help="shuffle / split seed (default 0)")
    p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help="leave out (and list) images with more pixels, which a datamodule with the same "
                        f"max_image_pixels would skip at every read (default {MAX_IMAGE_PIXELS})")
    p.add_argument("--synthetic", type=int, default=None, metavar="N",
                   help="instead of --input, write N synthetic image-caption samples (no network needed)")
    args = p.parse_args(argv)
    if (args.input is None) == (args.synthetic is None):
        p.error("give --input or --synthetic N (one of them)")
    if args.synthetic is not None and args.synthetic < 1:
        p.error(f"--synthetic N writes N samples: N must be at least 1, got {args.synthetic}")
    try:
        if args.synthetic is not None:
            from .synthetic import write_synthetic_shards

            manifest = write_synthetic_shards(args.output, num_samples=args.synthetic, seed=args.seed,
                                              maxcount=args.maxcount, val_fraction=args.val_fraction,
                                              min_val_shards=args.min_val_shards)
        else:
            manifest = build_shards(args.input, args.output, args.maxcount, args.val_fraction, args.seed,
                                    args.min_val_shards, args.max_image_pixels)
    except (FileNotFoundError, InputError) as exn:
        print(f"shards refused: {exn}", file=sys.stderr)
        return 1
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_samples']} samples in {len(info['shards'])} shards "
              f"({args.output}/{info['pattern']})")
    if manifest["skipped"]:
        print(f"skipped {len(manifest['skipped'])} inputs (reasons in {args.output}/{MANIFEST})")
    return 0
