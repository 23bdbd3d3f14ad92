"""WebDatasetDataModule: bad samples skipped and counted, worker / rank splits, determinism, set-up refusals."""

import io
import itertools
import json
import logging
import re
import warnings
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image

from vlm_retrofit.datamodules import (
    DataQualityCallback,
    DataQualityError,
    ShardError,
    SkipCounter,
    WebDatasetDataModule,
    check_bad_fraction,
    manifest_urls,
    model_inputs,
    write_synthetic_shards,
    write_tar,
)

PROC = "tiny:qwen2_vl"


def _img(mode="RGB", size=(32, 24), fmt="PNG") -> bytes:
    colour = {"RGB": (200, 10, 10), "RGBA": (0, 200, 0, 128), "L": 90, "CMYK": (0, 255, 255, 0), "P": 3}[mode]
    img = Image.new(mode, size, colour)
    if mode == "P":
        img.info["transparency"] = 3
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if mode == "CMYK" else fmt, quality=90)
    return buf.getvalue()


def _good(i: int) -> dict:
    return {"png": _img(), "txt": f"good caption {i}".encode()}


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory):
    """4 shards: 13 usable samples (incl. odd modes and a text-only conversation) + one of each bad kind."""
    d = tmp_path_factory.mktemp("bad")
    good, i = [], 0

    def g(files=None):
        nonlocal i
        key = f"ok{i:03d}"
        i += 1
        good.append(key)
        return key, files or _good(i)

    talk = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}
    write_tar(d / "s0.tar", [g(), ("corrupt", {"jpg": _img(fmt="JPEG")[:200], "txt": b"cut jpeg"}), g(),
                             g({"png": _img("RGBA"), "txt": b"rgba"}), ("empty", {"png": _img(), "txt": b"  "})])
    write_tar(d / "s1.tar", [g({"png": _img("P"), "txt": b"palette"}), ("notext", {"png": _img()}), g(),
                             g({"jpg": _img("CMYK"), "txt": b"cmyk"}), ("noimage", {"txt": b"lost image"})])
    write_tar(d / "s2.tar", [g({"png": _img("L"), "txt": b"grey"}), g({"json": json.dumps(talk).encode()}),
                             ("huge", {"png": _img(size=(300, 200)), "txt": b"too big"}),
                             ("badjson", {"json": b"{not json"}), g()])
    tail = [g() for _ in range(4)]
    write_tar(d / "s3.tar", tail + [("lost1", _good(98)), ("lost2", _good(99))])
    data = (d / "s3.tar").read_bytes()
    cut = data.index(b"lost1.png") + 512 + 20  # inside lost1's image data
    (d / "s3.tar").write_bytes(data[:cut])
    expected = Counter(corrupt_image=1, empty_text=1, missing_text=1, missing_image=1, huge_image=1, bad_json=1,
                       truncated_tar=1)
    return [str(d / f"s{k}.tar") for k in range(4)], good, expected


def _dm(val, **kw):
    kw = {"batch_size": 3, "num_workers": 0, "max_image_pixels": 20_000, **kw}
    return WebDatasetDataModule(PROC, train_shards=val, val_shards=val, **kw)


def _val_keys(dm):
    """Keys in the order the validation pipeline produced them (decode stage tapped, batching untouched)."""
    ds = dm.val_dataset()
    stages = ds.pipeline[-1].__self__
    seen = []
    orig = stages.decode

    def tap(src):
        for ex in orig(src):
            seen.append(ex.key)
            yield ex

    ds.pipeline[-2] = tap
    batches = list(ds)
    return seen, batches


@pytest.mark.parametrize("batch_size", [3, 4])  # 4: the truncation is found after the last full batch
def test_bad_samples_skipped_and_counted(bad_shards, caplog, batch_size):
    urls, good, expected = bad_shards
    dm = _dm(urls, batch_size=batch_size)
    dm.setup("fit")
    with caplog.at_level(logging.WARNING, logger="vlm_retrofit.datamodules"):
        keys, batches = _val_keys(dm)
    assert sorted(keys) == sorted(good)  # every usable sample (odd modes converted, text-only kept) arrives once
    assert sum((Counter(b["skipped"]) for b in batches), Counter()) == expected
    shards = sum((Counter(b["skipped_shards"]) for b in batches), Counter())
    assert shards == {urls[0]: 2, urls[1]: 2, urls[2]: 2, urls[3]: 1}
    assert [b["num_samples"] for b in batches][:-1] == [batch_size] * (len(batches) - 1)
    lines = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(lines) == 7
    assert any("'corrupt'" in m and urls[0] in m and "corrupt_image" in m for m in lines)
    assert any(urls[3] in m and "truncated_tar" in m for m in lines)
    assert sum(b["num_samples"] for b in batches) == len(good)


def test_validation_of_shards_with_no_usable_sample_is_refused_not_empty(tmp_path, bad_shards):
    # Skips travel inside batches: a validation pass whose every sample was unusable reported nothing, and
    # `python -m vlm_retrofit validate` ended with no metrics and exit status 0.
    write_tar(tmp_path / "v0.tar", [(f"bad{i}", {"png": _img(), "txt": b"   "}) for i in range(3)])
    write_tar(tmp_path / "v1.tar", [("noimage", {"txt": b"lost image"})])
    urls, usable, _ = bad_shards
    for workers in (0, 2):
        dm = _dm([str(tmp_path / "v0.tar"), str(tmp_path / "v1.tar")], num_workers=workers)
        dm.setup("validate")
        with pytest.raises(DataQualityError, match="val_shards yielded no batch"):
            list(dm.val_dataloader())
    good = _dm(urls)
    good.setup("validate")
    assert sum(b["num_samples"] for b in good.val_dataloader()) == len(usable)  # a pass with batches is untouched


def test_fit_refuses_val_shards_without_a_usable_sample_before_its_first_step(tmp_path, capsys, monkeypatch):
    # The first validation came after an epoch of training: a run over real data trained for nothing until then.
    from vlm_retrofit.cli import main

    write_tar(tmp_path / "val.tar", [(f"bad{i}", {"png": _img(), "txt": b"   "}) for i in range(3)])
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--data.val_shards", str(tmp_path / "val.tar"), "--trainer.default_root_dir",
                 str(tmp_path / "run")]) == 1
    assert "fit stopped: val_shards yielded no batch" in capsys.readouterr().err
    assert not list((tmp_path / "run").rglob("*.ckpt"))  # no step trained, nothing saved


def test_training_stream_delivers_every_skip_it_counts(tmp_path):
    """The training stream is cut by `with_epoch` after its last batch: no batch may be formed (and its skips
    taken) beyond it, or those skips never reach the main process."""
    write_tar(tmp_path / "half-bad.tar", [(f"s{i:03d}", _good(i) if i % 2 else
                                           {"jpg": _img(fmt="JPEG")[:200], "txt": b"cut jpeg"}) for i in range(40)])
    dm = WebDatasetDataModule(PROC, train_shards=str(tmp_path), batch_size=3, num_workers=0,
                              train_samples_per_epoch=12, shuffle_buffer=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    stages = loader.dataset.pipeline[-1].__self__
    counted = Counter()
    original = stages.counter.skip

    def skip(reason, *args, **kwargs):
        counted[reason] += 1
        original(reason, *args, **kwargs)

    stages.counter.skip = skip
    for _ in range(2):  # two epochs: each pass closes its stream after its last batch
        counted.clear()
        batches = list(loader)
        assert len(batches) == 4 and all(b["num_samples"] == 3 for b in batches)
        assert counted["corrupt_image"] >= 9  # about one corrupt sample read per good one
        assert sum((Counter(b["skipped"]) for b in batches), Counter()) == counted
        assert not stages.counter.reasons  # nothing counted and left behind

def test_two_workers_cover_val_set(bad_shards):
    urls, good, expected = bad_shards
    dm = _dm(urls, num_workers=2)
    dm.setup("validate")
    total, skipped = 0, Counter()
    for batch in dm.val_dataloader():
        total += batch["num_samples"]
        skipped.update(batch["skipped"])
    assert total == len(good) and skipped == expected


def test_two_rank_split_is_disjoint_and_complete(tmp_path, monkeypatch):
    m = write_synthetic_shards(tmp_path, num_samples=48, maxcount=6, val_fraction=0.5, min_val_shards=4)
    val = [str(tmp_path / s["name"]) for s in m["splits"]["val"]["shards"]]
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dm = _dm(val, batch_size=4)
        dm.setup("validate")
        keys, _ = _val_keys(dm)
        per_rank.append(keys)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(per_rank[0]) + len(per_rank[1]) == 24 == len(set(per_rank[0]) | set(per_rank[1]))
    monkeypatch.setenv("RANK", "0")  # 2 ranks x 4 workers need 8 shards: refused with a clear message
    with pytest.raises(ShardError, match="provide >= 8 shards"):
        _dm(val, num_workers=4).setup("fit")


def test_training_shards_split_by_rank(monkeypatch):
    from vlm_retrofit.datamodules.stream import EpochState, SplitResampledShards, WorkerSeed

    urls = [f"s{i}.tar" for i in range(6)]
    drawn = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        src = SplitResampledShards(urls, seed=5, worker_seed=WorkerSeed(EpochState()), deterministic=True)
        drawn.append({d["url"] for d, _ in zip(src, range(60))})
    assert not drawn[0] & drawn[1] and drawn[0] | drawn[1] == set(urls)
    monkeypatch.setenv("WORLD_SIZE", "8")  # fewer shards than ranks: everyone draws from all shards
    src = SplitResampledShards(urls, seed=5, worker_seed=WorkerSeed(EpochState()), deterministic=True)
    assert {d["url"] for d, _ in zip(src, range(100))} == set(urls)


def test_pipe_urls_and_unreadable_shards(tmp_path):
    m = write_synthetic_shards(tmp_path, num_samples=24, maxcount=6, val_fraction=0.5, min_val_shards=2)
    val = [f"pipe:cat {tmp_path / s['name']}" for s in m["splits"]["val"]["shards"]] + ["pipe:false"]
    dm = _dm(val, batch_size=4)
    dm.setup("fit")
    batches = list(dm.val_dataloader())
    assert sum(b["num_samples"] for b in batches) == 12
    assert sum((Counter(b["skipped"]) for b in batches), Counter()) == {"unreadable_shard": 1}


def test_setup_refuses_bad_patterns_before_loading_anything(tmp_path):
    not_a_model = "/nonexistent/processor"  # would fail if setup() got as far as loading it
    with pytest.raises(ShardError, match="matched no files"):
        WebDatasetDataModule(not_a_model, train_shards=str(tmp_path / "x-{000..009}.tar")).setup("fit")
    with pytest.raises(ShardError, match="matched no files"):
        WebDatasetDataModule(not_a_model, train_shards=str(tmp_path / "*.tar")).setup("fit")
    (tmp_path / "fake.tar").write_text("hello, I am not a tar")
    with pytest.raises(ShardError, match="not a tar file"):
        WebDatasetDataModule(not_a_model, train_shards=str(tmp_path / "fake.tar")).setup("fit")
    with pytest.raises(ShardError, match="train_shards is an empty list"):  # before: webdataset's error, late
        WebDatasetDataModule(not_a_model, train_shards=[]).setup("fit")


def _stream(dm, epochs=2):
    loader = dm.train_dataloader()
    return [[b["input_ids"].tolist() for b in loader] for _ in range(epochs)]


def test_training_stream_deterministic_per_seed(tmp_path):
    write_synthetic_shards(tmp_path, num_samples=60, maxcount=10, val_fraction=0.0)
    kw = dict(train_shards=str(tmp_path), batch_size=4, train_samples_per_epoch=24, shuffle_buffer=8)
    runs = []
    for seed, workers in ((0, 0), (0, 0), (1, 0), (0, 2), (0, 2)):
        dm = WebDatasetDataModule(PROC, seed=seed, num_workers=workers, **kw)
        dm.setup("fit")
        runs.append(_stream(dm))
    assert runs[0] == runs[1] and runs[3] == runs[4]  # same seed (and workers): same batches, epoch by epoch
    assert runs[0] != runs[2]  # another seed: another stream
    assert runs[0][0] != runs[0][1]  # a new epoch reshuffles
    assert [len(e) for e in runs[0]] == [6, 6] and [len(e) for e in runs[3]] == [6, 6]  # with_epoch per rank


def test_default_synthetic_data_and_mixed_batches(tmp_path):
    dm = WebDatasetDataModule(PROC, data_dir=str(tmp_path / "cache"), synthetic_samples=64, num_workers=0,
                              batch_size=8, text_only_fraction=0.5, train_samples_per_epoch=16)
    dm.setup("fit")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["synthetic"]["num_samples"] == 64 and dm.val_urls
    batches = list(dm.train_dataloader())
    assert len(batches) == 2
    mixed = [b for b in batches if "pixel_values" in b and (b["mm_token_type_ids"].sum(1) == 0).any()]
    assert mixed, "expected image and text-only samples in one batch"
    from vlm_retrofit.testing import tiny_vlm

    model, _ = tiny_vlm("qwen2_vl")
    batch = dict(mixed[0])
    with torch.no_grad():
        assert model(**model_inputs(batch)).logits.shape[:2] == batch["input_ids"].shape
    stamp = (tmp_path / "cache" / "manifest.json").stat().st_mtime_ns
    WebDatasetDataModule(PROC, data_dir=str(tmp_path / "cache"), synthetic_samples=64, num_workers=0,
                         text_only_fraction=0.5).setup("fit")
    assert (tmp_path / "cache" / "manifest.json").stat().st_mtime_ns == stamp  # cache reused


def test_group_by_modality_keeps_every_sample_in_single_modality_batches(tmp_path):
    kw = dict(data_dir=str(tmp_path / "cache"), synthetic_samples=96, num_workers=0, batch_size=4,
              text_only_fraction=0.5)
    mixed = WebDatasetDataModule(PROC, **kw)
    grouped = WebDatasetDataModule(PROC, group_by_modality=True, **kw)
    for dm in (mixed, grouped):
        dm.setup("fit")

    def rows(dm):  # (has image, tokens) per sample of one validation pass, and per batch whether its images vary
        out, varied = [], []
        for b in dm.val_dataloader():
            has_image = (b["mm_token_type_ids"].sum(1) > 0 if "mm_token_type_ids" in b
                         else torch.zeros(len(b["input_ids"]), dtype=torch.bool))
            varied.append(bool(has_image.any() and not has_image.all()))
            out += [(bool(h), tuple(ids[:n].tolist())) for h, ids, n in
                    zip(has_image, b["input_ids"], b["attention_mask"].sum(1))]
        return out, varied

    (mixed_rows, mixed_varied), (grouped_rows, grouped_varied) = rows(mixed), rows(grouped)
    assert any(mixed_varied) and not any(grouped_varied)
    assert sorted(grouped_rows) == sorted(mixed_rows)  # the same samples: only the batching differs


def test_bad_fraction_check_names_worst_shards():
    assert check_bad_fraction({"corrupt_image": 3}, 97, max_bad_fraction=0.05, min_samples=50) == 0.03
    assert check_bad_fraction({"corrupt_image": 30}, 10, max_bad_fraction=0.05, min_samples=50) == 0.75  # too few
    with pytest.raises(DataQualityError, match=r"a\.tar \(7 skipped\); b\.tar \(3 skipped\)"):
        check_bad_fraction({"corrupt_image": 6, "empty_text": 4}, 90, 0.05, 50, {"b.tar": 3, "a.tar": 7})


def test_skip_totals_survive_a_ddp_resume_counted_once():
    # Two ranks count their own skips. Only rank 0's checkpoint is written, and both ranks of the resumed run
    # restore it: the totals summed over ranks must come back as they were, not as rank 0's counts twice.
    ranks = [DataQualityCallback(min_samples=10**6) for _ in range(2)]
    ranks[0].tracker.update({"skipped": {"corrupt_image": 2}, "num_samples": 10})
    ranks[1].tracker.update({"skipped": {"corrupt_image": 3, "bad_json": 1}, "num_samples": 12})

    class Strategy:  # a collective sum over the callbacks of the current "ranks"
        def __init__(self, callbacks):
            self.callbacks = callbacks

        def reduce(self, values, reduce_op):
            return sum(torch.tensor([*c.tracker.totals().values(), c.tracker.num_good], dtype=torch.float64)
                       for c in self.callbacks)

    def trainers(callbacks):
        return [type("Trainer", (), {"world_size": 2, "global_rank": r, "strategy": Strategy(callbacks)})()
                for r in range(2)]

    module = type("Module", (), {"device": torch.device("cpu")})()
    before = ranks[0]._reduced(trainers(ranks)[0], module)[:2]
    assert before[0]["corrupt_image"] == 5 and before[0]["bad_json"] == 1 and before[1] == 22
    checkpoints = [{"callbacks": {c.state_key: c.state_dict()}} for c in ranks]
    for callback, trainer, checkpoint in zip(ranks, trainers(ranks), checkpoints):
        callback.on_save_checkpoint(trainer, module, checkpoint)
    written = checkpoints[0]["callbacks"][ranks[0].state_key]

    resumed = [DataQualityCallback(min_samples=10**6) for _ in range(2)]
    for callback, trainer in zip(resumed, trainers(resumed)):
        callback.load_state_dict(written)
        callback.on_fit_start(trainer, module)
    assert resumed[0]._reduced(trainers(resumed)[0], module)[:2] == before
    assert resumed[1].tracker.num_good == 0  # this rank counts its own batches from here


class _Consumer(pl.LightningModule):
    """Consumes data batches without a VLM: enough to drive the callback through a real Trainer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        assert "skipped_shards" not in batch and "input_ids" in model_inputs(batch)
        return (self.w - batch["loss_mask"].float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dm, epochs=1):
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(_Consumer(), datamodule=dm)
    return trainer


def test_counts_logged_every_epoch_and_bad_data_stops_training(bad_shards):
    urls, good, expected = bad_shards
    dm = _dm(urls, train_samples_per_epoch=6, max_bad_fraction=0.9, min_samples_for_check=1)
    trainer = _fit(dm, epochs=2)
    logged = trainer.callback_metrics
    assert {f"data/skipped/{r}" for r in expected} <= set(logged) and "data/bad_fraction" in logged
    assert sum(float(logged[f"data/skipped/{r}"]) for r in expected) > 0
    dm = _dm(urls, train_samples_per_epoch=60, max_bad_fraction=0.01, min_samples_for_check=10)
    with pytest.raises(DataQualityError, match="Worst shards: .*s[0-3]\\.tar"):
        _fit(dm)


def test_a_bad_data_stop_is_saved_and_a_run_resumed_on_repaired_shards_goes_on(bad_shards, tmp_path):
    from vlm_retrofit.training import RetrofitCheckpoint, inspect_checkpoint

    urls, _, _ = bad_shards

    def fit(train_shards, ckpt_path=None):
        quality = DataQualityCallback(max_bad_fraction=0.01, min_samples=10, check_every_n_batches=5)
        trainer = pl.Trainer(max_steps=30, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[quality, RetrofitCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        trainer.fit(_Consumer(), datamodule=_dm(train_shards, train_samples_per_epoch=60), ckpt_path=ckpt_path)
        return trainer, quality

    # Before: the stop raised at the start of a batch, unsaved: every step since the last periodic save was lost.
    with pytest.raises(DataQualityError, match=r"Training stopped at step 5; saved there as .*last\.ckpt"):
        fit(urls)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert inspect_checkpoint(last)["global_step"] == 5
    skipped = torch.load(last, weights_only=True)["callbacks"]["DataQualityCallback"]["tracker"]["skipped"]
    assert sum(skipped.values()) > 0
    repaired = tmp_path / "repaired.tar"
    write_tar(repaired, [(f"fixed{i:03d}", _good(i)) for i in range(12)])
    # Before: a resumed run was judged on the run's totals, the old shards' bad samples included, and stopped again at
    # its first check whatever its shards were now.
    trainer, quality = fit([str(repaired)], ckpt_path=str(last))
    assert trainer.global_step == 30
    assert quality.tracker.totals() == {**quality.tracker.totals(), **skipped}  # the run's totals keep the old skips


def test_the_command_line_says_a_bad_data_stop_was_saved(bad_shards, tmp_path, capsys):
    from vlm_retrofit.cli import main

    urls, _, _ = bad_shards
    root = tmp_path / "run"
    assert main(["fit", "--data.init_args.train_shards", json.dumps(urls), "--data.init_args.val_shards",
                 json.dumps(urls), "--data.init_args.max_image_pixels", "20000", "--data.init_args.num_workers", "0",
                 "--data.init_args.batch_size", "3", "--data.init_args.train_samples_per_epoch", "12",
                 "--data.init_args.max_bad_fraction", "0.01", "--data.init_args.min_samples_for_check", "6",
                 "--trainer.max_steps", "20", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
                 "false", "--trainer.default_root_dir", str(root)]) == 1
    # Before: "fit refused: ..." (as if nothing had run) and no checkpoint of the steps trained.
    err = capsys.readouterr().err
    assert re.search(r"fit stopped: \d+ of \d+ training samples .* were unusable.*Training stopped at step 4; saved "
                     r"there as .*last\.ckpt", err) and "Traceback" not in err


def _two_sources(tmp_path, per_shard=20):
    """Sources a and b, two shards of `per_shard` captioned images each; keys say the source."""
    for name in "ab":
        (tmp_path / name).mkdir()
        for s in range(2):
            write_tar(tmp_path / name / f"{s}.tar",
                      [(f"{name}{s}_{i:03d}", _good(i)) for i in range(per_shard)])
    return [str(tmp_path / "a"), str(tmp_path / "b")]


def _train_keys(dm):
    """(key, source) of every sample of one training epoch in stream order, and the epoch's batches."""
    ds = dm.train_dataset()
    orig = ds.pipeline[-2]  # the decode stage
    seen = []

    def tap(src):
        for ex in orig(src):
            seen.append((ex.key, ex.extra.get("source")))
            yield ex

    ds.pipeline[-2] = tap
    batches = list(ds)
    return seen, batches


def _longest_run(labels):
    return max(len(list(g)) for _, g in itertools.groupby(labels))


@pytest.mark.parametrize("weights, share", [([1, 1], 0.5), ([3, 1], 0.75)])
def test_weighted_sources_are_mixed_per_sample_in_their_proportions(tmp_path, weights, share):
    sources = _two_sources(tmp_path)
    kw = dict(train_shards=sources, num_workers=0, batch_size=4, train_samples_per_epoch=400, shuffle_buffer=0)
    dm = WebDatasetDataModule(PROC, train_weights=weights, **kw)
    dm.setup("fit")
    seen, batches = _train_keys(dm)
    assert len(seen) == 400 and all(key[0] == "ab"[source] for key, source in seen)
    counted = Counter()
    for b in batches:
        counted.update(b["source_samples"])
        assert sum(b["source_samples"].values()) == b["num_samples"]
    assert counted == Counter(source for _, source in seen)
    assert abs(counted[0] / 400 - share) < 0.07
    if share == 0.5:  # (at 3:1, a run of 20 of the first source is no rarity)
        assert _longest_run([s for _, s in seen]) < 20  # shorter than one shard: not read shard by shard
    pooled = WebDatasetDataModule(PROC, **kw)  # the same entries pooled: whole shards, one after the other
    pooled.setup("fit")
    pooled_keys, pooled_batches = _train_keys(pooled)
    assert _longest_run([key[0] for key, _ in pooled_keys]) >= 20 and "source_samples" not in pooled_batches[0]


def test_weighted_stream_is_deterministic_per_seed(tmp_path):
    sources = _two_sources(tmp_path, per_shard=6)
    kw = dict(train_shards=sources, train_weights=[2, 1], batch_size=4, train_samples_per_epoch=24, shuffle_buffer=8)
    runs = []
    for seed, workers in ((0, 0), (0, 0), (1, 0), (0, 2), (0, 2)):
        dm = WebDatasetDataModule(PROC, seed=seed, num_workers=workers, **kw)
        dm.setup("fit")
        runs.append(_stream(dm))
    assert runs[0] == runs[1] and runs[3] == runs[4] and runs[0] != runs[2] and runs[0][0] != runs[0][1]
    assert [len(e) for e in runs[0]] == [6, 6] and [len(e) for e in runs[3]] == [6, 6]


def test_weighted_sources_logged_and_bad_weights_refused(tmp_path):
    sources = _two_sources(tmp_path, per_shard=6)
    dm = WebDatasetDataModule(PROC, train_shards=sources, train_weights=[1, 3], num_workers=0, batch_size=4,
                              train_samples_per_epoch=40)
    logged = _fit(dm).callback_metrics
    assert float(logged["data/source_share/0"]) + float(logged["data/source_share/1"]) == pytest.approx(1.0)
    assert 0.05 < float(logged["data/source_share/0"]) < 0.5
    for weights, match in (([1], "1 weights for 2 train_shards entries"), ([1, 0], r"\[0\] are not finite"),
                           ([1, float("nan")], "are not finite numbers > 0")):
        with pytest.raises(ShardError, match=match):
            WebDatasetDataModule(PROC, train_shards=sources, train_weights=weights).setup("fit")
    with pytest.raises(ShardError, match="train_weights needs a train_shards list"):
        WebDatasetDataModule(PROC, data_dir=str(tmp_path / "syn"), train_weights=[1]).setup("fit")


def test_weighted_sources_split_by_rank_and_count_what_collate_rejects(tmp_path, monkeypatch):
    from vlm_retrofit.datamodules.stream import MixedSources

    sources = _two_sources(tmp_path, per_shard=4)
    for name in "ab":  # two more shards each: a rank's share of a source is then 2 of its 4 shards
        for s in (2, 3):
            write_tar(tmp_path / name / f"{s}.tar", [(f"{name}{s}_{i:03d}", _good(i)) for i in range(4)])
    dm = WebDatasetDataModule(PROC, train_shards=sources, train_weights=[1, 1], num_workers=0)
    dm.setup("fit")
    drawn = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        samples = itertools.islice(iter(MixedSources(dm.train_sources, [1, 1], dm._stages(4, True))), 200)
        drawn.append({(sample["__source__"], sample["__url__"]) for sample in samples})
    assert not drawn[0] & drawn[1] and {u for _, u in drawn[0] | drawn[1]} == set(dm.train_urls)
    assert all(url.startswith(sources[i]) for i, url in drawn[0] | drawn[1])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    long = " ".join(["word"] * 200)  # a prompt longer than max_length: rejected by collate as too_long
    write_tar(tmp_path / "b" / "0.tar", [(f"b0_{i:03d}", {"png": _img(), "json": json.dumps(
        {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]}).encode()})
        for i in range(4)])
    dm = WebDatasetDataModule(PROC, train_shards=sources, train_weights=[1, 1], num_workers=0, batch_size=4,
                              max_length=64, train_samples_per_epoch=80, shuffle_buffer=0)
    dm.setup("fit")
    seen, batches = _train_keys(dm)
    too_long = sum(b["skipped"].get("too_long", 0) for b in batches)
    assert too_long > 0 and all(sum(b["source_samples"].values()) == b["num_samples"] for b in batches)
    counted = Counter()
    for b in batches:
        counted.update(b["source_samples"])
    assert counted[1] == sum(1 for _, source in seen if source == 1) - too_long


def test_a_source_without_usable_samples_stops_with_its_name(tmp_path):
    sources = _two_sources(tmp_path, per_shard=4)
    (tmp_path / "empty").mkdir()
    write_tar(tmp_path / "empty" / "0.tar", [])
    dm = WebDatasetDataModule(PROC, train_shards=[sources[0], str(tmp_path / "empty")], train_weights=[1, 1],
                              num_workers=0, batch_size=2, train_samples_per_epoch=40)
    dm.setup("fit")
    with pytest.raises(ShardError, match=r"train_shards entry 1 .*empty.* without one usable sample"):
        list(dm.train_dataloader())


def test_pooled_shards_without_usable_samples_stop_instead_of_spinning(tmp_path):
    (tmp_path / "empty").mkdir()
    for i in range(3):  # readable tars without one sample (unreadable ones are refused before training)
        write_tar(tmp_path / "empty" / f"{i}.tar", [])
    dm = WebDatasetDataModule(PROC, train_shards=str(tmp_path / "empty" / "{0..2}.tar"), num_workers=0, batch_size=2,
                              train_samples_per_epoch=40)
    dm.setup("fit")
    with pytest.raises(ShardError, match=r"^train_shards \(.*0\.tar.*3 shards\): 40 shards read in a row"):
        list(dm.train_dataloader())


def test_a_list_of_shard_builder_folders_trains_on_their_train_splits_and_validates_on_their_val_splits(tmp_path):
    for name in "ab":
        write_synthetic_shards(tmp_path / name, num_samples=40, maxcount=5, val_fraction=0.25, seed=ord(name))
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    for weights in (None, [1, 1]):
        dm = WebDatasetDataModule(PROC, train_shards=folders, train_weights=weights, num_workers=0)
        dm.setup("fit")
        assert dm.train_urls == manifest_urls(folders[0], "train") + manifest_urls(folders[1], "train")
        assert dm.val_urls == manifest_urls(folders[0], "val") + manifest_urls(folders[1], "val") and dm.val_urls


def test_shards_of_only_unusable_samples_stop_training_by_name_and_log_a_bounded_number_of_lines(
        tmp_path, caplog, monkeypatch):
    # Before: the training stream resampled them forever without forming a batch (the bad-fraction check runs on
    # batches), writing a log line per skip: a gigabyte in minutes, and the process never yielded to SIGTERM.
    write_tar(tmp_path / "bad.tar", [(f"b{i:02d}", {"png": b"garbage", "txt": b"a caption"}) for i in range(30)])
    monkeypatch.setattr(SkipCounter, "no_batch_limit", 200)
    monkeypatch.setattr(SkipCounter, "log_every", 100)
    dm = WebDatasetDataModule(PROC, train_shards=str(tmp_path / "bad.tar"), num_workers=0, batch_size=2,
                              train_samples_per_epoch=40)
    dm.setup("fit")
    with caplog.at_level("WARNING", logger="vlm_retrofit.datamodules"):
        with pytest.raises(DataQualityError, match=r"first 200 samples read were all unusable .*corrupt_image.*bad\.tar"):
            list(dm.train_dataloader())
    lines = [r for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(lines) == SkipCounter.logged_per_reason + 2  # then the 100th and the 200th
    assert "further ones are counted" in lines[-1].getMessage()


def test_a_resume_with_another_batch_size_or_worker_count_says_the_epoch_continues_on_another_stream(tmp_path):
    # Before: the saved position (a count of batches) was replayed at the new size without a word, and the resumed
    # epoch silently read another number of samples than an uninterrupted one.
    write_synthetic_shards(tmp_path, num_samples=24, maxcount=8, val_fraction=0.0)
    dm = WebDatasetDataModule(PROC, train_shards=str(tmp_path), num_workers=0, batch_size=4, train_samples_per_epoch=40)
    dm.setup("fit")
    loader = dm.train_dataloader()
    saved = loader.state_dict()
    assert saved["batch_size"] == 4 and saved["num_workers"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.load_state_dict(saved)  # the same layout: silent
    with pytest.warns(UserWarning, match=r"batch_size 8 -> 4: .*Keep batch_size, num_workers"):
        loader.load_state_dict({**saved, "batch_size": 8})


@pytest.mark.parametrize("where", ["at a member boundary", "inside a header"])
def test_a_shard_cut_between_samples_is_counted_as_truncated(tmp_path, where):
    # tarfile ends quietly at a header that is missing or cut short: the lost rest of the shard went uncounted.
    import tarfile

    from vlm_retrofit.datamodules.stream import read_shards

    write_tar(tmp_path / "whole.tar", [(f"k{i:02d}", _good(i)) for i in range(8)])
    data = (tmp_path / "whole.tar").read_bytes()
    with tarfile.open(tmp_path / "whole.tar") as tar:
        fifth = [m for m in tar.getmembers()][8]  # the first file of sample k04
    cut = fifth.offset + (0 if where == "at a member boundary" else 100)
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    # The sample read last before the cut may be incomplete (a file of it may be lost): it goes with the rest.
    for name, samples, skipped in (("whole.tar", 8, {}), ("cut.tar", 3, {"truncated_tar": 1})):
        counter = SkipCounter()
        assert len(list(read_shards([{"url": str(tmp_path / name)}], counter))) == samples
        assert counter.take()[0] == skipped, name


def test_validation_counts_the_samples_it_leaves_out_and_says_so(bad_shards, tmp_path):
    # Before: only training batches' skips were summed; a validation pass over mostly corrupt shards reported its
    # KL on the usable rest with no count anywhere.
    import csv

    from vlm_retrofit.cli import main

    urls, good, expected = bad_shards
    root = tmp_path / "run"
    with pytest.warns(UserWarning, match=rf"val: {sum(expected.values())} of {sum(expected.values()) + len(good)} "
                                         r"samples were unusable and left out of this pass's metrics \[bad_json=1, "):
        assert main(["validate", "--data.init_args.train_shards", json.dumps(urls), "--data.init_args.val_shards",
                     json.dumps(urls), "--data.init_args.max_image_pixels", "20000", "--data.init_args.num_workers",
                     "0", "--data.init_args.batch_size", "3", "--trainer.enable_progress_bar", "false",
                     "--trainer.limit_val_batches", "1.0", "--trainer.default_root_dir", str(root)]) == 0
    with open(root / "logs" / "version_0" / "metrics.csv") as handle:
        row = next(csv.DictReader(handle))
    assert {r: int(float(row[f"val/data/skipped/{r}"])) for r in expected} == dict(expected)
    assert int(float(row["val/data/samples"])) == len(good)


def test_a_data_refusal_raised_in_a_dataloader_worker_is_said_in_one_line():
    # Before: DataQualityError was no InputError (a traceback), and torch's re-raise from a worker carried the
    # worker's whole traceback in its message.
    from torch._utils import ExceptionWrapper

    from vlm_retrofit.cli import input_error, refusal_text

    try:
        raise DataQualityError("the first 1000 samples read were all unusable")
    except DataQualityError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataQualityError) as caught:
        wrapped.reraise()
    assert "Original Traceback" in str(caught.value)
    assert refusal_text(input_error(caught.value)) == "the first 1000 samples read were all unusable"
    assert isinstance(caught.value, RuntimeError)  # as before, for code that catches it so


def test_a_folder_of_raw_images_given_as_shards_points_to_the_shard_builder(tmp_path):
    from vlm_retrofit.datamodules.webdataset import resolve_shards

    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match=r"contains no \.tar shards$"):
        resolve_shards(str(tmp_path / "empty"), "train_shards")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"")
    with pytest.raises(ShardError, match=r"holds files, not shards.*python -m vlm_retrofit shards --input"):
        resolve_shards(str(tmp_path / "images"), "train_shards")


def test_a_single_process_checkpoint_resumed_under_ddp_counts_its_totals_once():
    # A world-size-1 save wrote no "run totals" flag, so both ranks of a resumed DDP run kept rank 0's restored
    # counts and the reduction added them twice (data/samples 24 where 18 were read).
    single = DataQualityCallback(min_samples=10**6)
    single.tracker.update({"skipped": {"corrupt_image": 2}, "num_samples": 10})
    checkpoint = {"callbacks": {single.state_key: single.state_dict()}}
    one = type("Trainer", (), {"world_size": 1, "global_rank": 0})()
    single.on_save_checkpoint(one, None, checkpoint)
    for rank in (0, 1):
        resumed = DataQualityCallback(min_samples=10**6)
        resumed.load_state_dict(checkpoint["callbacks"][single.state_key])
        resumed.on_fit_start(type("Trainer", (), {"world_size": 2, "global_rank": rank})(), None)
        assert resumed.tracker.num_good == (10 if rank == 0 else 0)


def test_a_resume_with_another_number_of_processes_is_warned_about():
    from vlm_retrofit.datamodules.stream import EpochLoader

    loader = EpochLoader([], batch_size=None, samples_per_batch=2)
    saved = {**loader.state_dict(), "world_size": 2}
    with pytest.warns(UserWarning, match=r"world_size 2 -> 1.*number of processes"):
        loader.load_state_dict(saved)
