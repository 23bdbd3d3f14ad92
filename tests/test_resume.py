"""Trainable-only checkpoints, resume continuity, killed runs, and refusal of a checkpoint for another base."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from vlm_retrofit.cli import main
from vlm_retrofit.datamodules import write_synthetic_shards
from vlm_retrofit.routing import AdapterMismatchError
from vlm_retrofit.training import CHECKPOINT_KEY, RetrofitModule, inspect_checkpoint

N = 4  # steps per half; = batches per epoch of the fixed data, so both halves see the same batches


FIXED_DATA = ["--data", "vlm_retrofit.training.FixedBatchDataModule", "--data.num_batches", str(N),
              "--data.val_batches", "0", "--data.batch_size", "2"]


def _args(run_dir, *extra, steps=2 * N, backbone="tiny:qwen2_vl", every=2, data=FIXED_DATA):
    return [
        "fit",
        "--model.backbone", backbone,
        "--model.max_drop_rate", "0.5",
        "--model.drop_warmup_steps", "3",
        "--model.router.skip_gate", "true",
        "--model.compute_target", "0.6",
        "--model.total_steps", str(2 * N),  # the same LR schedule in every run
        "--model.warmup_steps", "2",
        *data,
        "--trainer.max_steps", str(steps),
        "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.callbacks.every_n_train_steps", str(every),
        *extra,
    ]


def _fit(run_dir, *extra, **kw):
    return main(_args(run_dir, *extra, **kw))


@pytest.fixture
def count_steps(monkeypatch):
    """Counts training steps actually run (a resume that silently started over would run all of them)."""
    calls = []
    original = RetrofitModule.training_step

    def counted(self, batch, batch_idx):
        calls.append(self.global_step)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(RetrofitModule, "training_step", counted)
    return calls


def _routers(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _assert_resumes_like_straight(tmp_path, name, count_steps):
    """Run `name` stopped after step 4; resuming it runs steps 4..7 and ends where the straight run ended."""
    assert inspect_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt")["global_step"] == 4
    count_steps.clear()
    assert _fit(tmp_path / name, "--ckpt_path", "last") == 0
    assert count_steps == [4, 5, 6, 7]
    straight = _routers(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = _routers(tmp_path / name / "checkpoints" / "last.ckpt")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-5, rtol=0)


def test_checkpoint_holds_only_the_trainable_state(tmp_path):
    assert _fit(tmp_path, steps=2) == 0
    path = tmp_path / "checkpoints" / "last.ckpt"
    info = inspect_checkpoint(path)
    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True})
    assert set(info["tensors"]) == module.trainable_keys() == set(info["trainable_keys"])
    assert all(k.startswith(("adapter.routers.", "adapter.gates.")) for k in info["tensors"])
    assert info["parameters"] == sum(p.numel() for p in module.parameters() if p.requires_grad) < 2000
    assert info["file_bytes"] < 64 * 1024  # kilobytes: no backbone weights
    assert info["base_fingerprint"] == module.adapter.fingerprint
    assert info["router_config"]["skip_gate"] is True and info["global_step"] == 2
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_states"] and checkpoint["lr_schedulers"] and checkpoint["loops"]
    assert checkpoint["hyper_parameters"]["backbone"] == "tiny:qwen2_vl"
    # It loads back into a fresh module (weights from the backbone id, routers from the checkpoint).
    restored = RetrofitModule.load_from_checkpoint(path)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(restored.state_dict()[key], value)


def test_resume_continues_exactly(tmp_path, count_steps):
    """N steps, then resume for N more == 2N straight (deterministic data, skip masks seeded per step)."""
    assert _fit(tmp_path / "straight") == 0
    assert _fit(tmp_path / "halves", steps=N) == 0
    assert inspect_checkpoint(tmp_path / "halves" / "checkpoints" / "last.ckpt")["global_step"] == N
    count_steps.clear()
    assert _fit(tmp_path / "halves", "--ckpt_path", "last") == 0
    assert count_steps == list(range(N, 2 * N))  # it continued from step N
    straight = _routers(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = _routers(tmp_path / "halves" / "checkpoints" / "last.ckpt")
    assert inspect_checkpoint(tmp_path / "halves" / "checkpoints" / "last.ckpt")["global_step"] == 2 * N
    init = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True}).trainable_state_dict()
    assert any((straight[k] - init[k]).abs().max() > 1e-4 for k in init)  # training really moved them
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-5, rtol=0)


def _stopped_at_half_an_epoch_resumes_like_straight(tmp_path, count_steps, *options):
    """Straight 2N steps, and a run stopped after N / 2 then resumed, with `options` alike: the same routers."""
    assert _fit(tmp_path / "straight", *options) == 0
    assert _fit(tmp_path / "stopped", *options, steps=N // 2) == 0
    count_steps.clear()
    assert _fit(tmp_path / "stopped", *options, "--ckpt_path", "last") == 0
    assert count_steps == list(range(N // 2, 2 * N))
    straight = _routers(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = _routers(tmp_path / "stopped" / "checkpoints" / "last.ckpt")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-5, rtol=0)


def test_a_run_resumed_mid_epoch_on_fixed_batches_continues_the_epoch(tmp_path, count_steps):
    # The fixed batches' plain loader started the epoch again at batch 0: steps 2 and 3 trained on batches 0 and 1.
    _stopped_at_half_an_epoch_resumes_like_straight(tmp_path, count_steps)


def test_a_run_resumed_at_the_end_of_a_limited_epoch_starts_the_next_one_whole(tmp_path, count_steps):
    # With limit_train_batches an epoch ends before the loader's last batch: the resumed run took its batches so far
    # for a position inside the epoch and dropped the next epoch's first ones.
    _stopped_at_half_an_epoch_resumes_like_straight(tmp_path, count_steps, "--trainer.limit_train_batches", str(N // 2))


def test_the_micro_batches_of_one_step_draw_their_own_masks(tmp_path, monkeypatch):
    """Under gradient accumulation every training batch gets its own removal and skip-mask seed."""
    seeds = []
    original = RetrofitModule.compute_loss

    def recorded(self, batch, *, drop_rate, seed, **kw):
        seeds.append((self.global_step, seed))
        return original(self, batch, drop_rate=drop_rate, seed=seed, **kw)

    monkeypatch.setattr(RetrofitModule, "compute_loss", recorded)
    assert _fit(tmp_path / "accumulated", "--trainer.accumulate_grad_batches", "2", steps=2) == 0
    assert [step for step, _ in seeds] == [0, 0, 1, 1]
    assert len({seed for _, seed in seeds}) == 4
    seeds.clear()
    assert _fit(tmp_path / "plain", steps=2) == 0  # without accumulation: one seed per optimizer step, as before
    module = RetrofitModule(backbone="tiny:qwen2_vl")
    assert [seed for _, seed in seeds] == [module._step_seed(0, 0), module._step_seed(1, 0)]


@pytest.mark.parametrize("epoch_batches, workers, weighted", [(2 * N, 0, False), (N, 0, False), (N // 2, 1, False),
                                                               (N // 2, 1, True)],
                         ids=["mid-epoch", "on-an-epoch-end", "persistent-worker", "weighted-sources"])
def test_a_resumed_run_reads_the_stream_an_uninterrupted_one_would(tmp_path, monkeypatch, epoch_batches, workers,
                                                                   weighted):
    """WebDataset shards: the resumed half trains on the batches the straight run's second half trained on."""
    seen = []
    original = RetrofitModule.training_step

    def recorded(self, batch, batch_idx):
        seen.append((self.global_step, hash(batch["input_ids"].numpy().tobytes())))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(RetrofitModule, "training_step", recorded)
    source = ["--data.data_dir", str(tmp_path / "shards")]
    if weighted:  # two sources drawn per sample, 3:1
        for name in "ab":
            write_synthetic_shards(tmp_path / name, num_samples=24, maxcount=6, val_fraction=0.0, seed=ord(name))
        source = ["--data.train_shards", json.dumps([str(tmp_path / "a"), str(tmp_path / "b")]),
                  "--data.train_weights", "[3, 1]"]
    stream = ["--data", "vlm_retrofit.datamodules.WebDatasetDataModule", *source,
              "--data.num_workers", str(workers), "--data.persistent_workers", str(workers > 0).lower(),
              "--data.batch_size", "2", "--data.train_samples_per_epoch", str(2 * epoch_batches),
              "--trainer.limit_val_batches", "0"]
    assert _fit(tmp_path / "straight", data=stream) == 0
    straight = dict(seen)
    seen.clear()
    assert _fit(tmp_path / "halves", steps=N, data=stream) == 0
    seen.clear()
    assert _fit(tmp_path / "halves", "--ckpt_path", "last", data=stream) == 0
    assert [step for step, _ in seen] == list(range(N, 2 * N))
    assert dict(seen) == {step: straight[step] for step in range(N, 2 * N)}
    assert len(set(straight.values())) == 2 * N  # distinct batches: a replay from the top could not pass


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, monkeypatch, count_steps):
    assert _fit(tmp_path / "straight") == 0

    def crash(self, outputs, batch, batch_idx):
        if self.global_step == 5:
            raise RuntimeError("simulated crash")

    with monkeypatch.context() as patch:
        patch.setattr(RetrofitModule, "on_train_batch_end", crash, raising=False)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(tmp_path / "crashed")
    _assert_resumes_like_straight(tmp_path, "crashed", count_steps)


def test_a_sigtermed_run_saves_the_step_it_stopped_at_and_resumes_exactly(tmp_path, monkeypatch, count_steps):
    # Before: a pre-empted job (SIGTERM) stopped without a checkpoint and lost every step since the periodic one
    # (here: all of them), and exited 0.
    assert _fit(tmp_path / "straight") == 0

    def sigterm(self, batch, batch_idx):
        if self.global_step == 3:  # as the signal handler does; Lightning stops at the end of this step
            self.trainer._signal_connector.received_sigterm = True

    with monkeypatch.context() as patch:
        patch.setattr(RetrofitModule, "on_train_batch_start", sigterm, raising=False)
        with pytest.warns(UserWarning, match="stopped by SIGTERM at step 4: saved .*last.ckpt"):
            assert _fit(tmp_path / "stopped", every=8) == 128 + 15
    _assert_resumes_like_straight(tmp_path, "stopped", count_steps)


@pytest.fixture
def sigint_as_at_a_terminal():
    """Python's Ctrl-C handler, as an interactive shell starts it: a job launched in the background by a
    non-interactive shell starts with SIGINT ignored, which the run rightly leaves alone (and the Ctrl-C tests then
    ran to the end)."""
    with _sigint_handled_by(signal.default_int_handler):
        yield


@contextlib.contextmanager
def _sigint_handled_by(handler):
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_at(step):
    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == step:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: the handler runs in the middle of this step
    return on_train_batch_start


def test_a_run_stopped_by_ctrl_c_saves_the_step_it_stopped_at_and_resumes_exactly(tmp_path, monkeypatch, count_steps,
                                                                                  sigint_as_at_a_terminal):
    # Before: Ctrl-C struck inside a step; Lightning stopped there and saved nothing since the periodic checkpoint.
    assert _fit(tmp_path / "straight") == 0
    with monkeypatch.context() as patch:
        patch.setattr(RetrofitModule, "on_train_batch_start", _ctrl_c_at(3), raising=False)
        with pytest.warns(UserWarning, match="stopped by Ctrl-C at step 4: saved .*last.ckpt"):  # before min_steps
            assert _fit(tmp_path / "stopped", "--trainer.min_steps", str(2 * N), every=8) == 128 + 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back after the run
    assert not (tmp_path / "stopped" / "adapter").exists()  # a partly trained adapter is not exported
    _assert_resumes_like_straight(tmp_path, "stopped", count_steps)


def test_a_run_started_with_sigint_ignored_leaves_it_ignored(tmp_path, monkeypatch):
    # A background job of a non-interactive shell: Python itself leaves SIGINT ignored there, and so does the run.
    with _sigint_handled_by(signal.SIG_IGN), monkeypatch.context() as patch:
        patch.setattr(RetrofitModule, "on_train_batch_start", _ctrl_c_at(1), raising=False)
        assert _fit(tmp_path, steps=3) == 0  # the signal changed nothing: all steps ran, adapter exported
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert inspect_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert (tmp_path / "adapter").exists()


CTRL_C_SCRIPT = """
import os, signal, sys
from vlm_retrofit.cli import main
from vlm_retrofit.training import RetrofitModule

signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from an interactive shell, whoever ran us

def ctrl_c(self, batch, batch_idx):
    if self.global_step == 2:
        os.killpg(0, signal.SIGINT)  # as a terminal does: to every process of the group, data workers included

RetrofitModule.on_train_batch_start = ctrl_c
sys.exit(main(["fit", "--trainer.max_steps", "8", "--trainer.limit_val_batches", "0",
               "--trainer.enable_progress_bar", "false", "--data.num_workers", "1"]))
"""


def test_ctrl_c_at_a_terminal_leaves_the_data_workers_to_the_run(tmp_path):
    # A worker took the Ctrl-C too: it ran the main process's handler (a second "stopping" line), or, started
    # otherwise than by fork, died under the step the main process was finishing.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CTRL_C_SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env, start_new_session=True)  # its own group: the signal stays in it
    assert result.returncode == 128 + 2, result.stderr[-2000:]
    assert result.stderr.count("Ctrl-C: stopping at the end of this step") == 1, result.stderr[-2000:]
    assert "stopped by Ctrl-C at step 3" in result.stderr
    assert inspect_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt")["global_step"] == 3


def test_checkpoint_for_another_base_is_refused(tmp_path, capsys):
    assert _fit(tmp_path, steps=2) == 0
    assert _fit(tmp_path, "--ckpt_path", "last", backbone="tiny:llava") == 1  # one line, no traceback
    assert re.search(r"fit refused: .*different base model \(qwen2_vl.*\(llava", capsys.readouterr().err)
    # Same family, different depth: refused by the fingerprint too (directly through the hook).
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    deeper = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True},
                            backbone_kwargs={"num_hidden_layers": 6})
    with pytest.raises(AdapterMismatchError, match="4 layers.*6 layers"):
        deeper.on_load_checkpoint(checkpoint)


def test_a_checkpoint_of_another_block_layout_is_refused_on_resume(tmp_path):
    # Trained where the backbone was registered with other never-skip layers: its router tensors have the same names,
    # so the resume was taken and the routers skipped blocks they were trained never to skip.
    assert _fit(tmp_path, steps=2) == 0
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True})
    module.on_load_checkpoint(checkpoint)
    checkpoint[CHECKPOINT_KEY]["layout"]["skippable_blocks"] = [1]
    with pytest.raises(AdapterMismatchError, match=r"skippable_blocks: saved \[1\] vs now \[1, 2\]"):
        module.on_load_checkpoint(checkpoint)


def test_missing_trainable_key_fails_loudly(tmp_path):
    assert _fit(tmp_path, steps=2) == 0
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True})
    module.on_load_checkpoint(checkpoint)  # complete: accepted
    del checkpoint["state_dict"]["adapter.routers.2.query"]
    with pytest.raises(AdapterMismatchError, match=r"missing \['adapter.routers.2.query'\]"):
        module.on_load_checkpoint(checkpoint)
    no_gates = RetrofitModule(backbone="tiny:qwen2_vl")  # the gates in the checkpoint are unexpected here
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    with pytest.raises(AdapterMismatchError, match="unexpected.*adapter.gates"):
        no_gates.on_load_checkpoint(checkpoint)
    del checkpoint[CHECKPOINT_KEY]
    with pytest.raises(AdapterMismatchError, match="not written by"):
        module.on_load_checkpoint(checkpoint)


KILL_SCRIPT = """
import os, signal, sys
from vlm_retrofit.cli import main
from vlm_retrofit.training import RetrofitModule

def die(self, outputs, batch, batch_idx):
    if self.global_step == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # no teardown, no exception handling: a real kill

RetrofitModule.on_train_batch_end = die
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_sigkilled_process_resumes_from_its_last_checkpoint(tmp_path, count_steps):
    assert _fit(tmp_path / "straight") == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *_args(tmp_path / "killed")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    _assert_resumes_like_straight(tmp_path, "killed", count_steps)


def test_a_run_given_another_root_keeps_its_checkpoints_there_and_resumes_from_them(tmp_path, count_steps):
    # The shipped configs once named their checkpoint folder outright: a run given another default_root_dir wrote
    # (and `--ckpt_path last` resumed) the other run's last.ckpt.
    from conftest import fit_config

    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "2")
    other = ("--trainer.default_root_dir", "runs/other")
    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "3", *other)
    assert inspect_checkpoint(tmp_path / "runs" / "tiny-llava-lora" / "checkpoints" / "last.ckpt")["global_step"] == 2
    assert inspect_checkpoint(tmp_path / "runs" / "other" / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert (tmp_path / "runs" / "other" / "adapter").is_dir()
    # Its logs (and the config Lightning saves beside them) follow it too; they went to the config's folder.
    assert (tmp_path / "runs" / "other" / "logs" / "version_0" / "metrics.csv").is_file()
    assert (tmp_path / "runs" / "other" / "logs" / "version_0" / "config.yaml").is_file()
    assert [p.name for p in (tmp_path / "runs" / "tiny-llava-lora" / "logs").iterdir()] == ["version_0"]
    count_steps.clear()  # the config logs to a CSV logger: Lightning alone would look for `last` in its version folder
    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "5", *other, "--ckpt_path", "last")
    assert count_steps == [3, 4]


def test_a_resume_that_changes_what_the_trained_lora_or_removal_means_is_refused(tmp_path, capsys):
    # Before: lora_alpha (the LoRA update's scale) and an explicit removal order were taken silently on resume; the
    # order was then ignored for the checkpoint's.
    from conftest import fit_config

    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "2")
    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "4", "--model.lora.lora_alpha", "32",
               "--ckpt_path", "last", status=1)
    assert re.search(r"lora_alpha 8 -> 32", capsys.readouterr().err)
    fit_config(tmp_path, "tiny-prune-heal.yaml", "--trainer.max_steps", "2")
    for changed, refusal in ((("--model.removal_order", "span"), "ranked its removal order by 'joint' .* says 'span'"),
                             (("--model.replace_removed", "true"), "without a linear replacement .* asks for one")):
        fit_config(tmp_path, "tiny-prune-heal.yaml", "--trainer.max_steps", "4", *changed, "--ckpt_path", "last",
                   status=1)
        assert re.search(refusal, capsys.readouterr().err)
    order = inspect_checkpoint(tmp_path / "runs" / "tiny-prune-heal" / "checkpoints" / "last.ckpt")["removal_order"]
    other = list(reversed(order))
    fit_config(tmp_path, "tiny-prune-heal.yaml", "--trainer.max_steps", "4", "--model.removal_order",
               json.dumps(other), "--ckpt_path", "last", status=1)
    assert re.search(rf"healed removal order {re.escape(str(order))}.* names {re.escape(str(other))}",
                     capsys.readouterr().err)


def test_a_resume_that_switches_router_training_on_is_refused_naming_train_routers(tmp_path, capsys):
    # Before: refused with a list of missing adapter.* keys and "Router config differences: none".
    from conftest import fit_config

    fit_config(tmp_path, "tiny-prune-heal.yaml", "--trainer.max_steps", "2")
    fit_config(tmp_path, "tiny-prune-heal.yaml", "--trainer.max_steps", "4", "--model.train_routers", "true",
               "--ckpt_path", "last", status=1)
    assert re.search(r"did not train the routers and this run trains them .*resume with train_routers: false",
                     capsys.readouterr().err)


def test_the_run_logger_follows_the_root_it_is_given_and_refuses_to_guess(tmp_path):
    from types import SimpleNamespace

    from vlm_retrofit.training import RunCSVLogger

    unresolved = RunCSVLogger()
    with pytest.raises(RuntimeError, match="use_run_folder"):  # rather than writing under the current folder
        unresolved.experiment
    unresolved.use_run_folder(SimpleNamespace(default_root_dir=tmp_path / "run"))
    assert unresolved.log_dir == str(tmp_path / "run" / "logs" / "version_0")
    named = RunCSVLogger(save_dir=tmp_path / "mine", name=None)
    named.use_run_folder(SimpleNamespace(default_root_dir=tmp_path / "run"))
    assert named.log_dir == str(tmp_path / "mine" / "version_0")


def test_resuming_by_last_where_only_other_checkpoints_exist_is_refused_not_started_over(tmp_path, count_steps, capsys):
    # With `trainer.callbacks` listing no checkpoint callback, Lightning's own saved `epoch=0-step=2.ckpt` into a new
    # version folder each run, and `--ckpt_path last` started over from step 0 with a warning.
    no_callbacks = ("--trainer.callbacks", "null")
    assert _fit(tmp_path / "run", *no_callbacks, steps=2) == 0
    saved = list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"]
    count_steps.clear()
    assert _fit(tmp_path / "run", *no_callbacks, "--ckpt_path", "last", steps=4) == 1
    assert re.search(r"fit refused: --ckpt_path last: no last\.ckpt in .*epoch=0-step=2\.ckpt", capsys.readouterr().err)
    assert count_steps == []
    assert _fit(tmp_path / "run", *no_callbacks, "--ckpt_path", str(saved[0]), steps=4) == 0
    assert count_steps == [2, 3]
    assert _fit(tmp_path / "fresh", "--ckpt_path", "last", steps=1) == 0  # a first run: nothing to miss


def test_a_checkpoint_file_rebuilds_its_model_only_where_no_model_settings_are_given(tmp_path, capsys):
    # Lightning wrote a checkpoint file's hyperparameters over the parsed config: a changed setting was dropped
    # silently, and the resume checks compared the checkpoint with itself (another backbone was resumed).
    import shutil

    from vlm_retrofit.cli import read_hyperparameters

    assert _fit(tmp_path, "--model.lr", "0.02", steps=2) == 0
    checkpoint = str(tmp_path / "checkpoints" / "last.ckpt")
    assert _fit(tmp_path, "--ckpt_path", checkpoint, backbone="tiny:llava") == 1
    assert re.search(r"fit refused: .*different base model \(qwen2_vl.*\(llava", capsys.readouterr().err)
    # The optimizer's state restored on resume would keep the checkpoint's learning rates: refused, not ignored,
    # also where the value given is the default one; settings that mean the same are taken.
    assert _fit(tmp_path, "--ckpt_path", checkpoint, "--model.lr", "0.05") == 1
    assert "optimizer settings other than the checkpoint's (lr 0.02 -> 0.05)" in capsys.readouterr().err
    assert _fit(tmp_path, "--ckpt_path", checkpoint, "--model.lr", "0.02", "--model.optimizer", "torch.optim.AdamW",
                "--model.optimizer_kwargs", "{}", steps=3) == 0
    # No model settings given: `validate --ckpt_path X` rebuilds X's model, whatever the file is called.
    assert read_hyperparameters(checkpoint)["model"]["compute_target"] == 0.6  # the default run's is 0.75
    renamed = tmp_path / "registry_last.ckpt"  # not Lightning's model registry ("registry" or "registry:...")
    shutil.copy(checkpoint, renamed)
    assert main(["validate", "--ckpt_path", str(renamed), *FIXED_DATA, "--trainer.logger", "false",
                 "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                 str(tmp_path / "validate")]) == 0
    assert f"the model settings come from {renamed}" in capsys.readouterr().err
    saved = (tmp_path / "validate" / "config.yaml").read_text()
    assert "compute_target: 0.6" in saved and "max_drop_rate: 0.5" in saved and "lr: 0.02" in saved


def test_a_checkpoint_file_brings_its_data_settings_where_none_are_given(tmp_path, capsys):
    # Before, `validate --ckpt_path X` (no --config) validated X on the built-in synthetic shards whatever X was
    # trained on, and `fit --ckpt_path X` resumed X on them.
    import yaml

    from vlm_retrofit.cli import read_hyperparameters

    trained_on = ["--data", "vlm_retrofit.training.FixedBatchDataModule", "--data.num_batches", "3",
                  "--data.val_batches", "1", "--data.batch_size", "2", "--data.image_size", "28"]
    assert _fit(tmp_path, data=trained_on, steps=2) == 0
    checkpoint = str(tmp_path / "checkpoints" / "last.ckpt")
    recorded = read_hyperparameters(checkpoint)["data"]
    assert recorded["class_path"] == "vlm_retrofit.training.FixedBatchDataModule"
    assert recorded["init_args"]["image_size"] == 28 and "processor" not in recorded["init_args"]

    def validated_with(*extra):
        root = tmp_path / f"validate{len(extra)}"
        assert main(["validate", "--ckpt_path", checkpoint, *extra, "--trainer.logger", "false",
                     "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root)]) == 0
        return yaml.safe_load((root / "config.yaml").read_text())

    config = validated_with()
    assert f"the model and data settings come from {checkpoint}" in capsys.readouterr().err
    assert config["data"]["class_path"] == "vlm_retrofit.training.FixedBatchDataModule"
    assert config["data"]["init_args"] == recorded["init_args"]  # the saved config leaves out the linked ones
    # Data settings given: they stand, and only the model comes from the file.
    config = validated_with("--data.batch_size", "1")
    assert f"the model settings come from {checkpoint}" in capsys.readouterr().err
    assert config["data"]["class_path"].endswith("WebDatasetDataModule")
    assert config["data"]["init_args"]["batch_size"] == 1


def test_a_run_with_stand_ins_resumes_with_the_checkpoints_stand_ins_not_a_new_fit(tmp_path, count_steps):
    _stopped_at_half_an_epoch_resumes_like_straight(tmp_path, count_steps, "--model.router.skip_stand_in", "true",
                                                    "--model.stand_in_batches", "2")
    saved = _routers(tmp_path / "stopped" / "checkpoints" / "last.ckpt")
    assert any(k.startswith("adapter.stand_ins.") for k in saved)
