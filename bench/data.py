"""Real benchmark data from Debian packages: Tux Paint photo stamps with English captions, and Jane Austen's novels.

* Images + captions: Debian `tuxpaint-stamps-default` (GPL-2). Each stamp `X.png` has an `X.txt` whose first line is
  the English description ("A Tamworth pig."); the following lines are translations (`de.utf8=...`).
* Text: Debian `r-cran-janeaustenr` (MIT): the six novels as character vectors of lines in R's lazy-load database
  (`data/Rdata.rdb` + `Rdata.rdx`), read with PyPI `rdata`.

Everything lands in `bench/.cache/data/` (gitignored). Every function is idempotent and deterministic: downloads and
extractions happen once; splits hash stable names (stamp paths, chapter numbers), never a random state.

    python bench/data.py            # download, extract, write all shards, print counts and example captions
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
import warnings
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
from PIL import Image

BENCH = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("VLM_BENCH_DATA_CACHE", BENCH / ".cache" / "data"))
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # tuxpaint: train / val / test by hash of the stamp path

TUXPAINT_PKG = "tuxpaint-stamps-default"
AUSTEN_PKG = "r-cran-janeaustenr"
STAMPS_SUBDIR = "usr/share/tuxpaint/stamps"
AUSTEN_SUBDIR = "usr/lib/R/site-library/janeaustenr/data"
# R object name -> title, in publication order (the order of austen_texts()).
AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}

# Photo-likeness thresholds (see is_photo_like and README-data.md).
MAX_FLATNESS = 0.45      # fraction of neighbouring visible pixels with exactly equal colour; clip-art is flat
MIN_VISIBLE_PIXELS = 400  # drops 32x32-ish icons and near-invisible sprites
MIN_SIDE = 16
_INDEX_VERSION = 1        # bump when the stamp-selection rules change (invalidates the cached pair index)


def _cache(cache: str | os.PathLike | None) -> Path:
    return Path(cache) if cache is not None else CACHE


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------------
# Debian packages: apt-get download + dpkg-deb -x, once
# --------------------------------------------------------------------------------------------------------------------

def _download_deb(package: str, debs: Path) -> Path:
    """The cached `package_*.deb` (placed there by hand or by an earlier call), else `apt-get download` it."""
    found = sorted(debs.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    apt = shutil.which("apt-get")
    if apt is None:
        raise RuntimeError(
            f"bench data needs the Debian package {package!r}, but apt-get is not available. Either run on a "
            f"Debian/Ubuntu machine (apt-get + dpkg-deb), or download {package}_*.deb by hand (e.g. from "
            f"https://packages.debian.org/bookworm/all/{package}/download) into {debs}/ and rerun.")
    debs.mkdir(parents=True, exist_ok=True)
    # Root downloads would otherwise warn that the _apt sandbox user cannot write into the cache folder.
    cmd = [apt, "download", "-q", "-o", "APT::Sandbox::User=root", package]
    proc = subprocess.run(cmd, cwd=debs, capture_output=True, text=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"`apt-get download {package}` failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            f"If it says 'Unable to locate package', run `apt-get update` (as root) once and retry; offline, put "
            f"{package}_*.deb into {debs}/ by hand.")
    return found[-1]


def _extract_deb(deb: Path, dest: Path) -> None:
    """`dpkg-deb -x deb dest`; without dpkg-deb, unpack the ar archive's data.tar.{xz,gz,bz2} in Python."""
    if shutil.which("dpkg-deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True, capture_output=True)
        return
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise RuntimeError(f"{deb} is not a Debian package (ar archive)")
    pos = 8
    while pos + 60 <= len(data):
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode().strip())
        body = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise RuntimeError(f"{deb} uses zstd compression: install dpkg-deb (package dpkg) to extract it")
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                try:
                    tar.extractall(dest, filter="data")
                except TypeError:  # Python without extraction filters (< 3.11.4)
                    tar.extractall(dest)  # noqa: S202 - a Debian archive package
            return
    raise RuntimeError(f"{deb} has no data.tar member")


def ensure_deb(package: str, cache: str | os.PathLike | None = None, prune: tuple[str, ...] = ()) -> Path:
    """Download and extract a Debian package once; return the extraction root (contains `usr/...`).

    Files ending in one of `prune` are deleted after extraction (Tux Paint's sound files: ~200 MB)."""
    root = _cache(cache)
    dest = root / "pkgs" / package
    marker = dest / ".extracted.json"
    if marker.is_file():
        return dest
    deb = _download_deb(package, root / "debs")
    tmp = Path(tempfile.mkdtemp(prefix=f".{package}.", dir=root))
    try:
        _extract_deb(deb, tmp)
        for f in [f for f in tmp.rglob("*") if f.name.endswith(prune) and f.is_file()] if prune else []:
            f.unlink()
        (tmp / ".extracted.json").write_text(json.dumps({"deb": deb.name, "sha256": _sha256(deb)}) + "\n")
        if dest.exists():
            shutil.rmtree(dest)  # a partial earlier extraction without a marker
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def deb_info(package: str, cache: str | os.PathLike | None = None) -> dict:
    """`{"deb": filename, "sha256": ...}` of an already extracted package (provenance for the manifest)."""
    return json.loads((_cache(cache) / "pkgs" / package / ".extracted.json").read_text())


def ensure_tuxpaint(cache: str | os.PathLike | None = None) -> Path:
    """Download + extract `tuxpaint-stamps-default` once; return the stamps root (`.../usr/share/tuxpaint/stamps`)."""
    stamps = ensure_deb(TUXPAINT_PKG, cache, prune=(".ogg", ".wav")) / STAMPS_SUBDIR
    if not stamps.is_dir():
        raise RuntimeError(f"{TUXPAINT_PKG} extracted, but {stamps} does not exist (package layout changed?)")
    return stamps


def ensure_janeaustenr(cache: str | os.PathLike | None = None) -> Path:
    """Download + extract `r-cran-janeaustenr` once; return its `data/` folder (Rdata.rdb / Rdata.rdx)."""
    data = ensure_deb(AUSTEN_PKG, cache) / AUSTEN_SUBDIR
    if not (data / "Rdata.rdx").is_file():
        raise RuntimeError(f"{AUSTEN_PKG} extracted, but {data}/Rdata.rdx does not exist (package layout changed?)")
    return data


# --------------------------------------------------------------------------------------------------------------------
# Tux Paint stamps -> (image, caption) pairs
# --------------------------------------------------------------------------------------------------------------------

_LOCALE_LINE = re.compile(r"^[A-Za-z]{2,3}(_[A-Za-z]{2})?(@\w+)?(\.[\w-]+)?\s*=")


def is_english(text: str) -> bool:
    """Heuristic: at least 90% of the letters are ASCII (captions may contain 'Räuchermännchen', translations not)."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= 0.9 * len(letters)


def parse_caption(text: str) -> str | None:
    """The English caption of a stamp's `.txt`: its first line, NFC-normalised, whitespace collapsed.

    `None` when the first line is empty, a translation (`xx.utf8=...`) or not English.
    """
    text = text.lstrip("\ufeff")
    first = text.splitlines()[0] if text.strip() else ""
    if _LOCALE_LINE.match(first):
        return None
    caption = re.sub(r"\s+", " ", unicodedata.normalize("NFC", first)).strip()
    return caption if caption and is_english(caption) else None


def caption_key(caption: str) -> str:
    """Duplicate detection: case-folded, final punctuation dropped ('A flower.' == 'a flower')."""
    return caption.casefold().rstrip(" .!?…")


def image_stats(img: Image.Image) -> dict:
    """Size, visible pixels (alpha >= 128) and flatness of a stamp image.

    Flatness = the fraction of horizontally or vertically neighbouring visible pixel pairs whose RGB is exactly
    equal. Photographs (even palette-quantised ones) score ~0-0.3; clip-art, glyphs, flags and road signs 0.5-1.
    """
    rgba = np.asarray(img.convert("RGBA"), dtype=np.int16)
    vis = rgba[..., 3] >= 128
    rgb = rgba[..., :3]
    pairs = equal = 0
    for a, b, va, vb in ((rgb[:, 1:], rgb[:, :-1], vis[:, 1:], vis[:, :-1]),
                         (rgb[1:], rgb[:-1], vis[1:], vis[:-1])):
        both = va & vb
        pairs += int(both.sum())
        equal += int((both & (a == b).all(-1)).sum())
    return {"width": img.width, "height": img.height, "visible": int(vis.sum()),
            "flatness": equal / pairs if pairs else 1.0}


def is_photo_like(stats: dict) -> str | None:
    """`None` if the image statistics look like a photo cut-out, else the reason it does not."""
    if min(stats["width"], stats["height"]) < MIN_SIDE or stats["visible"] < MIN_VISIBLE_PIXELS:
        return "too_small"
    if stats["flatness"] > MAX_FLATNESS:
        return "flat_clipart"
    return None


def _dat_flags(stem: Path) -> set[str]:
    dat = stem.with_suffix(".dat")
    return set(dat.read_text(errors="replace").split()) if dat.is_file() else set()


class Stamp(NamedTuple):
    rel: str        # stamp path relative to the stamps root, without extension ("animals/mammals/badger")
    png: Path       # the original (RGBA) stamp image
    caption: str


def scan_stamps(root: str | os.PathLike) -> tuple[list[Stamp], Counter]:
    """Select photo-like stamps with an English caption under a Tux Paint stamps root; one stamp per caption.

    A stamp is a `X.txt` (caption, first line) next to `X.png`. Dropped, with the reason counted:
    `no_caption` (first line empty / not English), `no_png` (SVG-only or no image), `vector_art` (an `X.svg` exists:
    the PNG is a rendering of vector clip-art), `cartoon` (in a `cartoon/` folder: Tux Paint's marker for drawn
    art), `colorable` (`X.dat` says `colorable`: a one-colour mask painted in the user's colour), `too_small`,
    `flat_clipart` (see image_stats), `unreadable`, `duplicate_caption` (same caption_key as a kept stamp: keep the
    one with the most visible pixels, ties by path). Pre-mirrored `X_mirror.png` files have no `.txt`: ignored.
    """
    root = Path(root)
    drops: Counter = Counter()
    cands: list[tuple[Stamp, int]] = []
    for txt in sorted(root.rglob("*.txt")):
        stem = txt.with_suffix("")
        rel = stem.relative_to(root).as_posix()
        caption = parse_caption(txt.read_text(encoding="utf-8", errors="replace"))
        png = stem.with_suffix(".png")
        if caption is None:
            reason = "no_caption"
        elif not png.is_file():
            reason = "no_png"
        elif stem.with_suffix(".svg").is_file():
            reason = "vector_art"
        elif "cartoon" in Path(rel).parts:
            reason = "cartoon"
        elif "colorable" in _dat_flags(stem):
            reason = "colorable"
        else:
            try:
                with Image.open(png) as img:
                    stats = image_stats(img)
                reason = is_photo_like(stats)
            except (OSError, ValueError):
                reason = "unreadable"
        if reason:
            drops[reason] += 1
        else:
            cands.append((Stamp(rel, png, caption), stats["visible"]))
    best: dict[str, tuple[Stamp, int]] = {}
    for stamp, visible in cands:
        k = caption_key(stamp.caption)
        if k not in best or visible > best[k][1]:  # cands are path-sorted, so ties keep the first path
            best[k] = (stamp, visible)
    drops["duplicate_caption"] += len(cands) - len(best)
    return sorted((s for s, _ in best.values()), key=lambda s: s.rel), drops


def split_of(name: str, fractions: tuple[float, float, float] = SPLIT_FRACTIONS) -> str:
    """"train" / "val" / "test" from the SHA-256 of a stable name: independent of what else is in the package."""
    u = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2 ** 64
    return "train" if u < fractions[0] else "val" if u < fractions[0] + fractions[1] else "test"


def export_rgb(src: Path, dst: Path) -> Path:
    """The stamp composited onto white as an RGB PNG at `dst` (written once)."""
    if not dst.is_file():
        from vlm_retrofit.datamodules.samples import to_rgb

        with Image.open(src) as img:
            img.load()
            buf = io.BytesIO()
            to_rgb(img).save(buf, format="PNG", optimize=False)
        _atomic_write(dst, buf.getvalue())
    return dst


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


@functools.lru_cache(maxsize=4)
def _tuxpaint_index(cache: Path) -> tuple[tuple[str, str, str], ...]:
    """(rel, exported image path, caption) for every kept stamp; cached on disk per package build + rule version."""
    stamps_root = ensure_tuxpaint(cache)
    info = deb_info(TUXPAINT_PKG, cache)
    index_path = cache / "tuxpaint" / "pairs.json"
    if index_path.is_file():
        idx = json.loads(index_path.read_text())
        if idx.get("sha256") == info["sha256"] and idx.get("version") == _INDEX_VERSION and all(
                (cache / p).is_file() for _, p, _ in idx["pairs"]):
            return tuple(tuple(p) for p in idx["pairs"])
    stamps, drops = scan_stamps(stamps_root)
    shutil.rmtree(cache / "tuxpaint" / "images", ignore_errors=True)  # exports of another package build / rules
    pairs = []
    for s in stamps:
        rel_img = f"tuxpaint/images/{s.rel}.png"
        export_rgb(s.png, cache / rel_img)
        pairs.append((s.rel, rel_img, s.caption))
    total = sum(1 for _ in stamps_root.rglob("*.txt"))
    idx = {"version": _INDEX_VERSION, "deb": info["deb"], "sha256": info["sha256"], "stamps_with_txt": total,
           "dropped": dict(sorted(drops.items())), "pairs": pairs}
    _atomic_write(index_path, (json.dumps(idx, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
    return tuple(tuple(p) for p in pairs)


def tuxpaint_stats(cache: str | os.PathLike | None = None) -> dict:
    """How many stamps the package has and why those not in tuxpaint_pairs() were dropped."""
    root = _cache(cache)
    _tuxpaint_index(root)
    idx = json.loads((root / "tuxpaint" / "pairs.json").read_text())
    return {"deb": idx["deb"], "stamps_with_txt": idx["stamps_with_txt"], "pairs": len(idx["pairs"]),
            "dropped": idx["dropped"]}


def tuxpaint_pairs(cache: str | os.PathLike | None = None) -> list[tuple[Path, str]]:
    """Every photo-like stamp with an English caption: (RGB PNG composited on white, caption), sorted by stamp path."""
    root = _cache(cache)
    return [(root / img, cap) for _, img, cap in _tuxpaint_index(root)]


def tuxpaint_split(split: str, cache: str | os.PathLike | None = None) -> list[tuple[Path, str]]:
    """The `split` ("train" 80% / "val" 10% / "test" 10%) of tuxpaint_pairs(), by a hash of the stamp path.

    The test split is for final numbers only: never tune on it."""
    _check_split(split)
    root = _cache(cache)
    return [(root / img, cap) for rel, img, cap in _tuxpaint_index(root) if split_of(rel) == split]


# --------------------------------------------------------------------------------------------------------------------
# Jane Austen
# --------------------------------------------------------------------------------------------------------------------

def read_rdb(data_dir: str | os.PathLike) -> dict[str, object]:
    """All objects of an R lazy-load database (`Rdata.rdx` index + `Rdata.rdb`), converted with `rdata`.

    The `.rdx` is a gzipped serialised list whose `variables` maps each name to (offset, length) in the `.rdb`;
    each `.rdb` entry is a 4-byte big-endian length followed by a zlib-compressed serialised R object.
    """
    import rdata

    data_dir = Path(data_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()), extension=".rds"))
        db = (data_dir / "Rdata.rdb").read_bytes()
        out = {}
        for name, (off, length) in index["variables"].items():
            blob = zlib.decompress(db[int(off) + 4:int(off) + int(length)])
            out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(blob, extension=".rds"))
    return out


@functools.lru_cache(maxsize=4)
def _austen_lines(cache: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    objs = read_rdb(ensure_janeaustenr(cache))
    missing = [k for k in AUSTEN_TITLES if k not in objs]
    if missing:
        raise RuntimeError(f"{AUSTEN_PKG}: novels {missing} not in the R data (has {sorted(objs)})")
    return tuple((title, tuple("" if x is None else str(x) for x in objs[key]))
                 for key, title in AUSTEN_TITLES.items())


def austen_texts(cache: str | os.PathLike | None = None) -> dict[str, str]:
    """The six novels, title -> full text (lines joined by newlines, as in the package), in publication order."""
    return {title: "\n".join(lines) for title, lines in _austen_lines(_cache(cache))}


_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)
_END = re.compile(r"^\s*(the end|finis|a note on the text)\s*$", re.IGNORECASE)
_DROP = re.compile(r"^\s*volume\s+[ivx0-9]+\.?\s*$", re.IGNORECASE)


def split_chapters(lines: Iterable[str]) -> list[list[str]]:
    """The lines of each chapter (heading excluded). Front matter before the first `CHAPTER` heading and everything
    from an end marker (`THE END`, `FINIS`, `A NOTE ON THE TEXT`) on are dropped, as are `VOLUME II` headings."""
    chapters: list[list[str]] = []
    for line in lines:
        if _END.match(line):
            break
        if _CHAPTER.match(line):
            chapters.append([])
        elif chapters and not _DROP.match(line):
            chapters[-1].append(line)
    return chapters


def paragraphs(lines: Iterable[str]) -> list[str]:
    """Blank-line separated paragraphs, each on one line; whitespace collapsed; `_emphasis_` underscores removed."""
    paras, cur = [], []
    for line in list(lines) + [""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            text = re.sub(r"\s+", " ", " ".join(cur).replace("_", "")).strip()
            if text:
                paras.append(text)
            cur = []
    return paras


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)]*\s+")
_ABBREV = re.compile(r"(?:^|[\s(\"'])(?:Mr|Mrs|Messrs|Dr|St|Col|Capt|Rev|Esq|Gen|Lt|Sgt|No|Vol|[A-Z])\.\s+$")


def sentences(text: str) -> list[str]:
    """A simple sentence split (after . ! ? and closing quotes); good enough for chunk boundaries."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        if _ABBREV.search(text[start:m.end()]):  # "Mr. Knightley", "F. C. Weston": not a sentence end
            continue
        out.append(text[start:m.end()].strip())
        start = m.end()
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def chunk_paragraphs(paras: Iterable[str], words: int = 150) -> list[str]:
    """Greedily pack consecutive paragraphs into chunks of at most `words` words (paragraphs joined by a blank line).

    A paragraph longer than `words` is cut at sentence ends, a sentence longer than `words` at clause ends
    (`;`, `:`, `,`, `--`), a clause longer than `words` after every `words` words: no chunk exceeds `words`."""
    if words < 1:
        raise ValueError(f"words must be >= 1, got {words}")
    pieces: list[str] = []
    for p in paras:
        pieces.extend(_pack(p, words, (sentences, _clauses, _word_runs)))
    chunks, cur, n = [], [], 0
    for piece in pieces:
        k = len(piece.split())
        if cur and n + k > words:
            chunks.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(piece)
        n += k
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def _clauses(text: str) -> list[str]:
    return [c for c in re.split(r"(?<=[;:,])\s+|(?<=--)(?=\S)", text) if c.strip()]


def _word_runs(text: str) -> list[str]:
    return text.split()  # single words: _pack re-joins them into runs of at most `words`


def _pack(text: str, words: int, splitters: tuple) -> list[str]:
    """`text` as pieces of at most `words` words: split with the first splitter, recursing with the next ones on
    parts that are still too long, then greedily re-joined."""
    if len(text.split()) <= words or not splitters:
        return [text]
    parts = [q for part in splitters[0](text) for q in _pack(part, words, splitters[1:])]
    out: list[str] = []
    for part in parts:
        if out and len(out[-1].split()) + len(part.split()) <= words:
            out[-1] = f"{out[-1]} {part}" if not out[-1].endswith("--") else out[-1] + part
        else:
            out.append(part)
    return out


def chapter_splits(n_chapters: int, held_out: float = 0.1) -> list[str]:
    """Split label of each chapter of a book: the last ceil(10%) chapters are "test", the ceil(10%) before them
    "val", the rest "train" (each at least one chapter once the book has three)."""
    k = max(1, math.ceil(n_chapters * held_out - 1e-9)) if n_chapters >= 3 else 0
    labels = ["train"] * n_chapters
    for i in range(n_chapters - 2 * k, n_chapters - k):
        labels[i] = "val"
    for i in range(n_chapters - k, n_chapters):
        labels[i] = "test"
    return labels


class AustenChunk(NamedTuple):
    book: str
    chapter: int   # 1-based, counted through the whole book (Emma's volumes continue the count)
    split: str
    text: str


def austen_chunks_from_lines(books: dict[str, list[str]], words: int = 150) -> list[AustenChunk]:
    """Chunks of every book (title -> lines) with their chapter split; chunks never cross chapters."""
    out = []
    for title, lines in books.items():
        chapters = split_chapters(lines)
        for i, (lines_, split) in enumerate(zip(chapters, chapter_splits(len(chapters))), 1):
            out.extend(AustenChunk(title, i, split, c) for c in chunk_paragraphs(paragraphs(lines_), words))
    return out


def austen_chunks(words: int = 150, cache: str | os.PathLike | None = None) -> list[AustenChunk]:
    """All chunks of the six novels, in book then text order, each labelled with its split."""
    return austen_chunks_from_lines({t: list(ls) for t, ls in _austen_lines(_cache(cache))}, words)


def austen_split(split: str, words: int = 150, cache: str | os.PathLike | None = None) -> list[str]:
    """Passages of at most `words` words (whole paragraphs where possible) from the `split` chapters of all six
    novels: "test" = the last 10% of the chapters of each book, "val" = the 10% before them, "train" = the rest."""
    _check_split(split)
    return [c.text for c in austen_chunks(words, cache) if c.split == split]


def continuation_messages(title: str, text: str, prompt_fraction: float = 1 / 3) -> list[dict]:
    """A text-only conversation: the user quotes the start of a passage and asks for more; the assistant continues.

    The cut is at the sentence end nearest to `prompt_fraction` of the words (at least one sentence each side),
    falling back to a word boundary for single-sentence passages."""
    sents = [s for p in text.split("\n\n") for s in (sentences(p) or [p])]
    # sentence ends in word offsets, remembering paragraph breaks so the two halves keep their layout
    if len(sents) >= 2:
        counts = np.cumsum([len(s.split()) for s in sents])
        target = prompt_fraction * counts[-1]
        cut = int(np.argmin(np.abs(counts[:-1] - target))) + 1
        head_words = int(counts[cut - 1])
    else:
        head_words = max(1, round(prompt_fraction * len(text.split())))
    head, tail = _cut_words(text, head_words)
    if not tail:  # a one-word passage
        head, tail = "", text
    return [{"role": "user", "content": f"Continue this passage from {title} by Jane Austen:\n\n{head}"},
            {"role": "assistant", "content": tail}]


def _cut_words(text: str, n: int) -> tuple[str, str]:
    """Split `text` after its n-th word, keeping paragraph breaks on both sides."""
    matches = list(re.finditer(r"\S+", text))
    if n >= len(matches):
        return text.strip(), ""
    pos = matches[n - 1].end()
    return text[:pos].strip(), text[pos:].strip()


# --------------------------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------------------------

def _key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name.replace("/", "__"))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode())


def _build(jsonl: Path, out: Path, n: int, maxcount: int, min_shards: int, seed: int) -> dict:
    from vlm_retrofit.datamodules.shards import build_shards

    # Each split is its own shard folder (the builder names its shards train-NNNNNN.tar). Evaluation folders are
    # spread over >= min_shards shards so that ranks x workers readers all get one.
    per_shard = max(1, min(maxcount, -(-n // max(1, min_shards))))
    if out.exists():
        for stale in out.glob("*.tar"):
            stale.unlink()
    manifest = build_shards(jsonl, out, maxcount=per_shard, val_fraction=0.0, seed=seed)
    info = manifest["splits"].get("train", {"num_samples": 0, "shards": []})
    if manifest["skipped"]:
        raise RuntimeError(f"shard builder skipped inputs for {out}: {manifest['skipped'][:3]}")
    return {"dir": str(out), "num_samples": info["num_samples"], "shards": len(info["shards"])}


def write_bench_shards(out_dir: str | os.PathLike | None = None, maxcount: int = 200, words: int = 150,
                       eval_shards: int = 4, seed: int = 0, force: bool = False,
                       cache: str | os.PathLike | None = None) -> dict:
    """Write the benchmark's WebDataset shard folders and return (and save) a manifest.

    Under `out_dir` (default `bench/.cache/data/shards`):

    * `captions-{train,val,test}/`: Tux Paint photo + caption (`key.png` + `key.txt`);
    * `austen-{train,val}/`: text-only conversations (`key.json`: user quotes the start of a passage, the
      assistant continues it);
    * `austen-test.txt`: the held-out passages, separated by blank lines, for perplexity;
    * `bench_data.json`: this manifest (counts, paths, sources).

    Point `WebDatasetDataModule(train_shards=..., val_shards=...)` at a folder. Val/test folders hold at least
    `eval_shards` shards. Rebuilt only when the parameters or the source packages change (or `force`).
    """
    root = _cache(cache)
    out = Path(out_dir) if out_dir is not None else root / "shards"
    manifest_path = out / "bench_data.json"
    params = {"maxcount": maxcount, "words": words, "eval_shards": eval_shards, "seed": seed,
              "index_version": _INDEX_VERSION}
    ensure_tuxpaint(root)
    ensure_janeaustenr(root)
    sources = {TUXPAINT_PKG: deb_info(TUXPAINT_PKG, root), AUSTEN_PKG: deb_info(AUSTEN_PKG, root)}
    if manifest_path.is_file() and not force:
        old = json.loads(manifest_path.read_text())
        paths = [Path(v["dir"]) for v in old.get("shards", {}).values()]
        if (old.get("params") == params and old.get("sources") == sources and all(p.is_dir() for p in paths)
                and Path(old["austen_test"]["path"]).is_file()):
            return old
    t0 = time.perf_counter()
    inputs = out / "_inputs"
    manifest: dict = {"params": params, "sources": sources, "shards": {}, "root": str(out)}

    for split in SPLITS:
        pairs = tuxpaint_split(split, root)
        rows = [{"key": _key(Path(img).relative_to(root / "tuxpaint" / "images").with_suffix("").as_posix()),
                 "image": str(img), "text": cap} for img, cap in pairs]
        _write_jsonl(inputs / f"captions-{split}.jsonl", rows)
        manifest["shards"][f"captions-{split}"] = _build(inputs / f"captions-{split}.jsonl", out / f"captions-{split}",
                                                          len(rows), maxcount, 1 if split == "train" else eval_shards,
                                                          seed)
    chunks = austen_chunks(words, root)
    per_book: dict = {}
    for split in ("train", "val"):
        rows = []
        for i, c in enumerate(x for x in chunks if x.split == split):
            slug = next(k for k, t in AUSTEN_TITLES.items() if t == c.book)
            rows.append({"key": f"austen_{slug}_ch{c.chapter:03d}_{i:05d}",
                         "messages": continuation_messages(c.book, c.text)})
        _write_jsonl(inputs / f"austen-{split}.jsonl", rows)
        manifest["shards"][f"austen-{split}"] = _build(inputs / f"austen-{split}.jsonl", out / f"austen-{split}",
                                                        len(rows), maxcount, 1 if split == "train" else eval_shards,
                                                        seed)
    test_text = "\n\n".join(c.text for c in chunks if c.split == "test") + "\n"
    _atomic_write(out / "austen-test.txt", test_text.encode("utf-8"))
    for c in chunks:
        b = per_book.setdefault(c.book, {s: {"chapters": set(), "chunks": 0, "chars": 0} for s in SPLITS})[c.split]
        b["chapters"].add(c.chapter)
        b["chunks"] += 1
        b["chars"] += len(c.text)
    for book in per_book.values():
        for s in book.values():
            s["chapters"] = [min(s["chapters"]), max(s["chapters"])] if s["chapters"] else []
    manifest["austen"] = {s: {"chunks": sum(c.split == s for c in chunks),
                              "chars": sum(len(c.text) for c in chunks if c.split == s),
                              "words": sum(len(c.text.split()) for c in chunks if c.split == s)} for s in SPLITS}
    manifest["austen_books"] = per_book
    manifest["austen_test"] = {"path": str(out / "austen-test.txt"), "chunks": manifest["austen"]["test"]["chunks"],
                               "chars": len(test_text)}
    manifest["tuxpaint"] = tuxpaint_stats(root)
    manifest["build_seconds"] = round(time.perf_counter() - t0, 2)
    _atomic_write(manifest_path, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="shard folder (default bench/.cache/data/shards)")
    p.add_argument("--maxcount", type=int, default=200, help="samples per shard (default 200)")
    p.add_argument("--words", type=int, default=150, help="Austen passage length in words (default 150)")
    p.add_argument("--force", action="store_true", help="rebuild the shards even if up to date")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    m = write_bench_shards(args.out, maxcount=args.maxcount, words=args.words, force=args.force)
    tp = m["tuxpaint"]
    print(f"tuxpaint ({tp['deb']}): {tp['pairs']} photo-caption pairs of {tp['stamps_with_txt']} captioned stamps; "
          f"dropped {tp['dropped']}")
    for name, info in m["shards"].items():
        print(f"  {name:15s} {info['num_samples']:5d} samples in {info['shards']} shards  {info['dir']}")
    for split, a in m["austen"].items():
        print(f"  austen {split:5s}  {a['chunks']:5d} passages, {a['words']:7d} words, {a['chars']:8d} chars")
    print(f"  austen-test.txt  {m['austen_test']['path']}")
    print("example captions:")
    train = tuxpaint_split("train")
    for img, cap in train[::max(1, len(train) // 3)][:3]:
        print(f"  {cap!r}  <- {img}")
    print(f"built in {m['build_seconds']} s (this call {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
