"""Shard builder and synthetic data: round trip through plain webdataset, manifest, skipped inputs, determinism."""

import hashlib
import io
import json
import tarfile

import pytest
import webdataset as wds
from PIL import Image

from vlm_retrofit.datamodules import build_shards, write_synthetic_shards
from vlm_retrofit.datamodules.shards import main
from vlm_retrofit.datamodules.synthetic import COLOURS, POSITIONS, ensure_synthetic_shards, render_scene


def _jpg(colour, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _folder(tmp_path):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    good = {}
    for i in range(7):
        name = f"img.{i}" if i == 0 else f"img{i}"  # a dot in the stem must not break the webdataset key
        folder = src / "sub" if i % 3 == 0 else src
        (folder / f"{name}.jpg").write_bytes(_jpg((30 * i, 100, 200)))
        (folder / f"{name}.txt").write_text(f"  caption number {i}\n")
        good[f"caption number {i}"] = (folder / f"{name}.jpg").read_bytes()
    (src / "broken.jpg").write_bytes(b"\xff\xd8not really a jpeg")
    (src / "broken.txt").write_text("a broken image")
    (src / "empty.jpg").write_bytes(_jpg((1, 2, 3)))
    (src / "empty.txt").write_text("   \n")
    (src / "nocap.png").write_bytes(_jpg((9, 9, 9)))
    (src / "orphan.txt").write_text("caption without image")
    (src / "notes.md").write_text("listed, not packed")
    (src / "phone.heic").write_bytes(b"an image format PIL does not read here")
    (src / "phone.txt").write_text("a caption beside it")
    (src / ".DS_Store").write_bytes(b"hidden: no sample")
    return src, good


def _read_all(urls):
    return list(wds.WebDataset(urls, shardshuffle=False))


def test_folder_round_trip_and_manifest(tmp_path):
    src, good = _folder(tmp_path)
    out = tmp_path / "out"
    manifest = build_shards(src, out, maxcount=3, val_fraction=0.3, seed=1)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert train["num_samples"] + val["num_samples"] == len(good) == manifest["num_samples"]
    assert val["num_samples"] == 2 and [s["num_samples"] for s in train["shards"]] == [3, 2]
    for shard in train["shards"] + val["shards"]:
        data = (out / shard["name"]).read_bytes()
        assert len(data) == shard["bytes"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    samples = _read_all([str(out / s["name"]) for s in train["shards"] + val["shards"]])
    assert {s["txt"].decode(): s["jpg"] for s in samples} == good  # captions stripped, image bytes untouched
    assert all("." not in s["__key__"] for s in samples)
    reasons = {s["source"].rsplit("/", 1)[-1]: s["reason"] for s in manifest["skipped"]}
    assert reasons == {"broken.jpg": "corrupt_image", "empty.jpg": "empty_text", "nocap.png": "missing_text",
                       "orphan.txt": "missing_image", "notes.md": "unsupported_file", "phone.heic": "unsupported_file"}


def test_tars_are_standard_and_deterministic(tmp_path):
    src, _ = _folder(tmp_path)
    a = build_shards(src, tmp_path / "a", maxcount=4, val_fraction=0.2, seed=3)
    b = build_shards(src, tmp_path / "b", maxcount=4, val_fraction=0.2, seed=3)
    names = [s["name"] for split in a["splits"].values() for s in split["shards"]]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        with tarfile.open(tmp_path / "a" / name) as tar:
            members = tar.getmembers()
        assert members and all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.mode == 0o644
                               for m in members)
    assert a["splits"] == b["splits"]
    again = build_shards(src, tmp_path / "a", maxcount=4, val_fraction=0.2, seed=3)  # re-run in place
    assert again["splits"] == a["splits"]
    other = build_shards(src, tmp_path / "c", maxcount=4, val_fraction=0.2, seed=4)
    assert other["splits"] != a["splits"]  # the seed shuffles and splits differently


def test_rebuild_removes_stale_shards(tmp_path):
    src, _ = _folder(tmp_path)
    build_shards(src, tmp_path / "o", maxcount=1)
    build_shards(src, tmp_path / "o", maxcount=4)
    assert sorted(p.name for p in (tmp_path / "o").glob("*.tar")) == ["train-000000.tar", "train-000001.tar"]


def test_jsonl_input_with_conversations(tmp_path):
    (tmp_path / "a.jpg").write_bytes(_jpg((200, 0, 0)))
    lines = [
        {"image": "a.jpg", "text": "a red image", "key": "first.one"},
        {"image": "missing.jpg", "caption": "gone"},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                             {"from": "gpt", "value": "Red."}]},
        {"text": "caption but no image"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    manifest = build_shards(path, tmp_path / "out")
    samples = {s["__key__"]: s for s in _read_all(str(tmp_path / "out" / "train-000000.tar"))}
    assert samples["first_one"]["txt"] == b"a red image" and "jpg" in samples["first_one"]
    text_only = samples["00000003"]
    assert "jpg" not in text_only and json.loads(text_only["json"])["messages"][1]["content"] == "4"
    assert json.loads(samples["00000004"]["json"])["messages"][0]["from"] == "human"
    assert sorted(s["reason"] for s in manifest["skipped"]) == ["bad_json", "missing_image", "missing_image"]


def test_cli_main(tmp_path, capsys):
    src, good = _folder(tmp_path)
    assert main(["--input", str(src), "--output", str(tmp_path / "o"), "--maxcount", "2",
                 "--val-fraction", "0.25", "--min-val-shards", "2"]) == 0
    printed = capsys.readouterr().out
    assert "train: 5 samples in 3 shards" in printed and "val: 2 samples in 2 shards" in printed
    assert main(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "x")]) == 1
    (tmp_path / "empty").mkdir()  # before: exit 0, nothing printed, a manifest of 0 samples that fit refused later
    (tmp_path / "empty" / "lonely.txt").write_text("a caption without its image")
    capsys.readouterr()
    assert main(["--input", str(tmp_path / "empty"), "--output", str(tmp_path / "e")]) == 1
    assert "shards refused: shard builder input" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    from vlm_retrofit.cli import main as cli_main  # `python -m vlm_retrofit shards ...`

    assert cli_main(["shards", "--synthetic", "12", "--output", str(tmp_path / "syn"), "--maxcount", "5"]) == 0
    # Before: a traceback (val fraction), or exit 0 with an empty manifest (-5) or --input ignored for --synthetic.
    assert cli_main(["shards", "--synthetic", "12", "--output", str(tmp_path / "v"), "--val-fraction", "1.5"]) == 1
    assert "0 <= val_fraction < 1" in capsys.readouterr().err
    for wrong in (["--synthetic", "-5"], ["--synthetic", "5", "--input", str(src)]):
        assert cli_main(["shards", "--output", str(tmp_path / "w"), *wrong]) == 2
    assert not (tmp_path / "w").exists() and not (tmp_path / "v").exists()


def test_synthetic_captions_describe_the_image():
    import random

    rng = random.Random(0)
    for _ in range(30):
        img, caption = render_scene(rng, 96)
        count = {"One": 1, "Two": 2, "Three": 3}[caption.split()[0]]
        described = caption.split(": ", 1)[1].rstrip(".").replace(" and ", ", ").split(", ")
        assert len(described) == count
        for part in described:  # "a red circle at the top left": the cell centre has that colour
            _, colour, shape, *where = part.split()
            pos = " ".join(where[2:]) if where[0] == "at" else "centre"
            cell = POSITIONS.index(pos)
            cx, cy = int((cell % 3 + 0.5) * 32), int((cell // 3 + 0.5) * 32 + (6 if shape == "triangle" else 0))
            assert img.getpixel((cx, cy)) == COLOURS[colour], (caption, part)


def test_synthetic_shards_deterministic_and_cached(tmp_path):
    a = write_synthetic_shards(tmp_path / "a", num_samples=40, maxcount=8, val_fraction=0.2, min_val_shards=4,
                               text_only_fraction=0.25)
    b = write_synthetic_shards(tmp_path / "b", num_samples=40, maxcount=8, val_fraction=0.2, min_val_shards=4,
                               text_only_fraction=0.25)
    assert a["splits"] == b["splits"] and len(a["splits"]["val"]["shards"]) == 4
    samples = _read_all(str(tmp_path / "a" / "train-{000000..000003}.tar"))
    assert len(samples) == 32 and any("json" in s for s in samples) and any("png" in s for s in samples)
    kw = dict(num_samples=40, maxcount=8, val_fraction=0.2, min_val_shards=4, text_only_fraction=0.25)
    stamp = (tmp_path / "a" / "manifest.json").stat().st_mtime_ns
    assert ensure_synthetic_shards(tmp_path / "a", **kw) == a  # reused, not rewritten
    assert (tmp_path / "a" / "manifest.json").stat().st_mtime_ns == stamp
    (tmp_path / "a" / "train-000000.tar").write_bytes(b"damaged")
    assert ensure_synthetic_shards(tmp_path / "a", **kw)["splits"] == a["splits"]  # rewritten
    assert (tmp_path / "a" / "train-000000.tar").stat().st_size == a["splits"]["train"]["shards"][0]["bytes"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        write_synthetic_shards(tmp_path, num_samples=4, maxcount=0)


def test_names_that_share_a_key_binary_input_and_oversize_images_are_refused_or_listed(tmp_path):
    # Before: "photo.1" and "photo_1" both became key photo_1 and the reader lost one sample uncounted; a binary file
    # given as JSONL crashed with a UnicodeDecodeError; an image training always skips was packed anyway.
    from vlm_retrofit.errors import InputError

    src = tmp_path / "in"
    src.mkdir()
    for name in ("photo.1", "photo_1", "fine", "large"):
        (src / f"{name}.jpg").write_bytes(_jpg((10, 20, 30), size=(40, 40) if name != "large" else (60, 60)))
        (src / f"{name}.txt").write_text(f"caption of {name}")
    manifest = build_shards(src, tmp_path / "out", val_fraction=0.0, max_image_pixels=50 * 50)
    reasons = {s["source"].rsplit("/", 1)[-1]: (s["reason"], s["detail"]) for s in manifest["skipped"]}
    assert manifest["num_samples"] == 1 and set(reasons) == {"photo.1.jpg", "photo_1.jpg", "large.jpg"}
    assert reasons["photo.1.jpg"][0] == "ambiguous" and "become key 'photo_1'" in reasons["photo.1.jpg"][1]
    assert reasons["large.jpg"][0] == "huge_image" and "60x60" in reasons["large.jpg"][1]
    with pytest.raises(InputError, match=r"fine.jpg is not a UTF-8 text file.*a JSONL file of records"):
        build_shards(src / "fine.jpg", tmp_path / "out2")
    # The default keeps what the datamodule's default reads; the command line sets the limit as the datamodule does.
    assert build_shards(src, tmp_path / "out3")["num_samples"] == 2
    assert main(["--input", str(src), "--output", str(tmp_path / "out4"), "--max-image-pixels", "2500"]) == 0
    assert json.loads((tmp_path / "out4" / "manifest.json").read_text())["num_samples"] == 1
