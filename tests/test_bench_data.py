"""bench/data.py: the pure parts (captions, stamp selection, splits, Austen chunking) on tiny fake inputs, offline."""

import gzip
import importlib.util
import json
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

_PATH = Path(__file__).resolve().parents[1] / "bench" / "data.py"
_spec = importlib.util.spec_from_file_location("bench_data", _PATH)
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


# ------------------------------------------------------------------------------------------------ captions

def test_parse_caption_takes_the_english_first_line():
    text = "A Tamworth  pig.\nde.utf8=Ein Tamworth-Schwein.\nfr.utf8=Un cochon Tamworth.\n"
    assert bd.parse_caption(text) == "A Tamworth pig."
    assert bd.parse_caption("\ufeff  A calculator.  6x7=42\r\nach.utf8=x") == "A calculator. 6x7=42"
    toy = 'A wooden toy called a "Räuchermännchen".'
    assert bd.parse_caption(toy) == toy


@pytest.mark.parametrize("text", ["", "\n\n", "   \nA pig.", "de.utf8=Ein Schwein.\nA pig.",
                                  "pt_BR.utf8=Um porco.", "Свинья породы тамворт.", "12345"])
def test_parse_caption_rejects_missing_translated_or_non_english(text):
    assert bd.parse_caption(text) is None


def test_caption_key_merges_case_and_final_punctuation():
    assert bd.caption_key("A flower.") == bd.caption_key("a flower") == bd.caption_key("A Flower!")
    assert bd.caption_key("A flower.") != bd.caption_key("A red flower.")


# ------------------------------------------------------------------------------------------------ stamp images

def _photo(size=(60, 50), seed=0, alpha=True) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    a = np.full((size[1], size[0], 1), 255, np.uint8)
    if alpha:
        a[:, : size[0] // 4] = 0  # a transparent margin, as in the cut-outs
    return Image.fromarray(np.concatenate([rgb, a], -1), "RGBA")


def _clipart(size=(60, 50)) -> Image.Image:
    img = Image.new("RGBA", size, (0, 0, 0, 0))
    img.paste((255, 0, 0, 255), (5, 5, size[0] - 5, size[1] - 5))
    return img


def test_image_stats_separate_photos_from_flat_clipart_and_icons():
    photo, flat = bd.image_stats(_photo()), bd.image_stats(_clipart())
    assert photo["flatness"] < 0.05 and flat["flatness"] > 0.95
    assert photo["visible"] == 60 * 50 - 15 * 50
    assert bd.is_photo_like(photo) is None
    assert bd.is_photo_like(flat) == "flat_clipart"
    assert bd.is_photo_like(bd.image_stats(_photo((12, 12), alpha=False))) == "too_small"
    assert bd.is_photo_like(bd.image_stats(Image.new("RGBA", (100, 100)))) == "too_small"  # fully transparent


def _stamp(root: Path, rel: str, caption: str | None, image: Image.Image | None = None, svg=False, dat=None):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if caption is not None:
        path.with_suffix(".txt").write_text(f"{caption}\nde.utf8=Übersetzung.\n", encoding="utf-8")
    if image is not None:
        image.save(path.with_suffix(".png"))
    if svg:
        path.with_suffix(".svg").write_text("<svg/>")
    if dat is not None:
        path.with_suffix(".dat").write_text(dat)


def test_scan_stamps_keeps_one_photo_per_caption_and_counts_drops(tmp_path):
    _stamp(tmp_path, "animals/pig", "A Tamworth pig.", _photo(seed=1))
    _stamp(tmp_path, "animals/pig_mirror", None, _photo(seed=1))             # pre-mirrored variant, no .txt
    _stamp(tmp_path, "plants/flower1", "A flower.", _photo((40, 40), seed=2))
    _stamp(tmp_path, "plants/flower2", "a flower", _photo((80, 80), seed=3))  # same caption, larger: kept
    _stamp(tmp_path, "animals/cartoon/ant", "An ant.", _photo(seed=4))
    _stamp(tmp_path, "food/banana", "A banana.", _photo(seed=5), svg=True)
    _stamp(tmp_path, "food/apple", "An apple.", None, svg=True)               # SVG only
    _stamp(tmp_path, "symbols/a", "The letter a.", _photo(seed=6), dat="colorable\n")
    _stamp(tmp_path, "town/flag", "A red flag.", _clipart())
    _stamp(tmp_path, "town/sign", "de.utf8=Ein Schild.", _photo(seed=7))
    _stamp(tmp_path, "town/tiny", "A tiny thing.", _photo((10, 10), seed=8))
    (tmp_path / "town" / "broken.png").write_bytes(b"not a png")
    (tmp_path / "town" / "broken.txt").write_text("A broken image.")

    stamps, drops = bd.scan_stamps(tmp_path)
    assert [(s.rel, s.caption) for s in stamps] == [("animals/pig", "A Tamworth pig."),
                                                    ("plants/flower2", "a flower")]
    assert all(s.png.is_file() for s in stamps)
    assert drops == Counter(cartoon=1, vector_art=1, no_png=1, colorable=1, flat_clipart=1, no_caption=1,
                            too_small=1, unreadable=1, duplicate_caption=1)
    assert bd.scan_stamps(tmp_path) == (stamps, drops)  # deterministic


def test_split_of_is_stable_and_roughly_80_10_10():
    names = [f"animals/stamp{i}" for i in range(4000)]
    first = [bd.split_of(n) for n in names]
    assert first == [bd.split_of(n) for n in reversed(names)][::-1]  # a function of the name alone
    c = Counter(first)
    assert set(c) == {"train", "val", "test"}
    assert abs(c["train"] / 4000 - 0.8) < 0.03 and abs(c["val"] / 4000 - 0.1) < 0.02
    assert bd.split_of("animals/pig") == bd.split_of("animals/pig")
    with pytest.raises(ValueError):
        bd._check_split("dev")


def test_export_rgb_composites_onto_white_once(tmp_path):
    src, dst = tmp_path / "s.png", tmp_path / "out" / "s.png"
    img = Image.new("RGBA", (4, 2), (0, 0, 0, 0))
    img.putpixel((0, 0), (10, 20, 30, 255))
    img.save(src)
    bd.export_rgb(src, dst)
    with Image.open(dst) as out:
        assert out.mode == "RGB"
        assert out.getpixel((0, 0)) == (10, 20, 30) and out.getpixel((3, 1)) == (255, 255, 255)
    before = dst.stat().st_mtime_ns
    bd.export_rgb(src, dst)
    assert dst.stat().st_mtime_ns == before


# ------------------------------------------------------------------------------------------------ Austen

BOOK = """TITLE

By Someone

VOLUME I

CHAPTER I

It is a truth universally acknowledged, that a single man in
possession of a good fortune, must be in want of a _wife_.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that
Netherfield Park is let at last?"

VOLUME II

Chapter 2

Mr. Bennet was among the earliest of those who waited on Mr. Bingley.

CHAPTER III

Third chapter text.

THE END

A note that is not part of the novel.
"""


def test_split_chapters_drops_front_matter_volume_headings_and_back_matter():
    chapters = bd.split_chapters(BOOK.splitlines())
    assert len(chapters) == 3
    assert not any("VOLUME" in line or "CHAPTER" in line or "TITLE" in line for ch in chapters for line in ch)
    assert chapters[2] == ["", "Third chapter text.", ""]


def test_paragraphs_join_lines_and_strip_emphasis():
    paras = bd.paragraphs(bd.split_chapters(BOOK.splitlines())[0])
    assert paras == ["It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                     "must be in want of a wife.",
                     '"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park '
                     'is let at last?"']


def test_sentences_do_not_split_after_titles_or_initials():
    assert bd.sentences('Poor Mr. Woodhouse! "Yes," said F. C. Weston. Is it? "Quite."  Done.') == [
        "Poor Mr. Woodhouse!", '"Yes," said F. C. Weston.', "Is it?", '"Quite."', "Done."]


def test_chunk_paragraphs_packs_whole_paragraphs_and_never_exceeds_the_limit():
    paras = ["one two three.", "four five.", "six seven eight nine ten."]
    assert bd.chunk_paragraphs(paras, words=5) == ["one two three.\n\nfour five.", "six seven eight nine ten."]
    long = "A b c d. E f g, h i j k l; m n o p q r s t u v w x y z."  # 26 words, one long sentence
    chunks = bd.chunk_paragraphs([long], words=6)
    assert all(len(c.split()) <= 6 for c in chunks)
    assert " ".join(chunks).split() == long.split()  # nothing lost or reordered
    with pytest.raises(ValueError):
        bd.chunk_paragraphs(paras, words=0)


@pytest.mark.parametrize("n,expected", [(1, ["train"]), (2, ["train"] * 2),
                                        (3, ["train", "val", "test"]),
                                        (10, ["train"] * 8 + ["val", "test"]),
                                        (24, ["train"] * 18 + ["val"] * 3 + ["test"] * 3),
                                        (61, ["train"] * 47 + ["val"] * 7 + ["test"] * 7)])
def test_chapter_splits_hold_out_the_last_chapters(n, expected):
    assert bd.chapter_splits(n) == expected


def test_austen_chunks_hold_out_whole_final_chapters():
    lines = []
    for i in range(1, 21):
        lines += [f"CHAPTER {i}", ""] + [f"Chapter {i} paragraph {j} says something." for j in range(3)] + [""]
    chunks = bd.austen_chunks_from_lines({"Book": lines}, words=12)
    by_split = {s: {c.chapter for c in chunks if c.split == s} for s in bd.SPLITS}
    assert by_split == {"train": set(range(1, 17)), "val": {17, 18}, "test": {19, 20}}
    assert all(f"Chapter {c.chapter} " in c.text for c in chunks)  # chunks never cross chapters
    assert bd.austen_chunks_from_lines({"Book": lines}, words=12) == chunks


def test_continuation_messages_cut_at_a_sentence_end():
    text = "First sentence here. Second one is here.\n\nThird sentence follows. Fourth ends it."
    user, assistant = bd.continuation_messages("Emma", text)
    assert user["role"] == "user" and assistant["role"] == "assistant"
    assert user["content"] == "Continue this passage from Emma by Jane Austen:\n\nFirst sentence here."
    assert assistant["content"] == "Second one is here.\n\nThird sentence follows. Fourth ends it."
    one = bd.continuation_messages("Emma", "Just one long sentence without any end at all")
    assert one[0]["content"].endswith("Just one long") and one[1]["content"] == "sentence without any end at all"


def test_read_rdb_reads_an_r_lazy_load_database(tmp_path):
    rdata = pytest.importorskip("rdata")
    from rdata.conversion import convert_python_to_r_data
    from rdata.unparser import unparse_data

    db, variables = b"", {}
    for name, lines in {"emma": ["EMMA", "", "CHAPTER I", "Text."], "persuasion": ["Chapter 1", "More."]}.items():
        raw = unparse_data(convert_python_to_r_data(np.array(lines), file_type="rds"))
        blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
        variables[name] = np.array([len(db), len(blob)], dtype=np.int32)
        db += blob
    index = {"variables": variables, "references": {}, "compressed": np.array([True])}
    (tmp_path / "Rdata.rdb").write_bytes(db)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(unparse_data(convert_python_to_r_data(index))))
    out = bd.read_rdb(tmp_path)
    assert list(out["emma"]) == ["EMMA", "", "CHAPTER I", "Text."]
    assert list(out["persuasion"]) == ["Chapter 1", "More."]
    assert rdata is not None


def test_ensure_deb_uses_a_cached_deb_without_network(tmp_path, monkeypatch):
    """A .deb placed in the cache is extracted once (here by the pure-Python fallback, no dpkg-deb)."""
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        payload = b"A pig.\n"
        info = tarfile.TarInfo("./usr/share/tuxpaint/stamps/pig.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
        info = tarfile.TarInfo("./usr/share/tuxpaint/stamps/pig.ogg")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    members = [("debian-binary", b"2.0\n"), ("data.tar.gz", data.getvalue())]
    ar = b"!<arch>\n" + b"".join(
        f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body + b"\n" * (len(body) % 2)
        for name, body in members)
    debs = tmp_path / "debs"
    debs.mkdir()
    (debs / f"{bd.TUXPAINT_PKG}_1.0_all.deb").write_bytes(ar)
    monkeypatch.setattr(bd.shutil, "which", lambda name: None)  # no apt-get, no dpkg-deb
    root = bd.ensure_tuxpaint(tmp_path)
    assert (root / "pig.txt").read_text() == "A pig.\n" and not (root / "pig.ogg").exists()
    assert bd.deb_info(bd.TUXPAINT_PKG, tmp_path)["deb"] == f"{bd.TUXPAINT_PKG}_1.0_all.deb"
    assert bd.ensure_tuxpaint(tmp_path) == root
    json.loads((root.parents[3] / ".extracted.json").read_text())


def test_missing_apt_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(bd.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get is not available"):
        bd.ensure_janeaustenr(tmp_path)
