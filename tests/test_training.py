"""RetrofitModule: the distillation loss and its invariants, skip simulation = cached inference, logging, NaN steps."""

import contextlib
import math

import lightning.pytorch as pl
import pytest
import torch

from vlm_retrofit import RouterAdapter
from vlm_retrofit.skipping import PatternPolicy, SkipController
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm
from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule, compute_penalty, distillation_kl, drop_rate_at
from vlm_retrofit.training.optim import base_lr, lr_lambda, parameter_groups
from vlm_retrofit.training.peft_layers import autocast_lora_inputs, lora_addmm
from vlm_retrofit.training.prefix import head_rows_selected


def _batch(family, batch_size=2, seed=0):
    dm = FixedBatchDataModule(processor=f"tiny:{family}", num_batches=1, val_batches=0, batch_size=batch_size,
                              seed=seed)
    dm.setup()
    return dm.train_batches[0]


def _trainer(max_steps, **kw):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, **kw)


def _randomise_routers(adapter, scale=0.5, seed=5):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(scale * torch.randn(router.query.shape, generator=generator))
        for gate in adapter.gates.values():
            gate.query.copy_(torch.randn(gate.query.shape, generator=generator))
            gate.bias.fill_(0.5)


# --------------------------------------------------------------------------- loss pieces
def test_distillation_kl_is_the_masked_tempered_kl():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, requires_grad=True), torch.randn(2, 5, 11)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    T = 2.0
    p_t = torch.softmax(teacher[mask] / T, -1)
    manual = (p_t * (p_t.log() - torch.log_softmax(student[mask] / T, -1))).sum(-1).mean() * T * T
    value = distillation_kl(student, teacher, mask, temperature=T)
    torch.testing.assert_close(value, manual)
    assert distillation_kl(teacher, teacher, mask).abs() < 1e-6
    empty = distillation_kl(student, teacher, torch.zeros_like(mask))
    empty.backward()  # no selected position: zero, still differentiable
    assert empty == 0 and student.grad is not None and student.grad.abs().sum() == 0



@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 2.0), (torch.bfloat16, 1.0),
                                               (torch.float16, 1.0)])
def test_chunked_kl_equals_autograd_through_log_softmax_in_value_and_gradient(monkeypatch, dtype, temperature):
    import vlm_retrofit.training.losses as losses

    monkeypatch.setattr(losses, "KL_CHUNK_ELEMENTS", 3 * 97)  # 3 positions a chunk: 7 chunks over 19 positions
    torch.manual_seed(0)
    student = (3 * torch.randn(4, 6, 97)).to(dtype).requires_grad_(True)
    teacher = (3 * torch.randn(4, 6, 97)).to(dtype).requires_grad_(True)
    mask = torch.rand(4, 6) < 0.8
    reference_student = student.detach().clone().requires_grad_(True)
    log_s = torch.log_softmax(reference_student[mask].float() / temperature, -1)
    log_t = torch.log_softmax(teacher.detach()[mask].float() / temperature, -1)
    reference = torch.nn.functional.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1).mean()
    (reference * temperature ** 2).backward()
    value = distillation_kl(student, teacher, mask, temperature)
    value.backward()
    torch.testing.assert_close(value, reference * temperature ** 2, rtol=1e-5, atol=1e-6)
    assert student.grad.dtype == dtype and teacher.grad is None  # the teacher is a target
    tolerance = dict(rtol=2e-2, atol=1e-4) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(student.grad, reference_student.grad, **tolerance)
    assert student.grad[~mask].abs().sum() == 0
    with torch.no_grad():  # no gradient held where none can flow
        assert distillation_kl(student, teacher, mask, temperature).grad_fn is None



def test_chunked_kl_keeps_the_gradient_tail_that_an_fp16_loss_scale_lifts():
    """fp16 mixed precision scales the loss (here 2^16) so that gradients below fp16's range survive: the KL must
    not round its gradient to fp16 before the scale reaches it."""
    torch.manual_seed(0)
    student = (12 * torch.randn(3, 64)).half().requires_grad_(True)  # wide logits: a tail of tiny probabilities
    teacher = (12 * torch.randn(3, 64)).half()
    scale = 2.0 ** 16
    (distillation_kl(student, teacher) * scale).backward()
    s, t = student.detach().double(), teacher.double()
    expected = (torch.softmax(s, -1) - torch.softmax(t, -1)) / s.shape[0] * scale
    tail = (expected.abs() < 2 ** -24 * scale) & (expected.abs() > 2 ** -14)  # fp16-flushed unscaled, normal scaled
    assert tail.sum() >= 5
    torch.testing.assert_close(student.grad.double()[tail], expected[tail], rtol=2e-2, atol=0)

@pytest.mark.parametrize("torch_dtype", [None, "bfloat16"])
def test_lora_inputs_uncast_under_autocast_give_the_same_logits(torch_dtype):
    module = RetrofitModule(backbone="tiny:llama", torch_dtype=torch_dtype, train_routers=False, max_drop_rate=0.0,
                            lora={"r": 4, "target_modules": ["q_proj", "down_proj"]}, removal_order=[1],
                            max_removed_blocks=1)
    with torch.no_grad():  # a LoRA that does something
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    inputs = tiny_inputs(module.processor, batch=2)
    assert len(module._lora_layers) == 4 * 2  # 4 layers x 2 targets
    casting = []
    module._lora_layers[0].register_forward_pre_hook(lambda layer, args: casting.append(layer.cast_input_dtype_enabled))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        peft_default = module.model(**inputs).logits
        with autocast_lora_inputs(module._lora_layers, "cpu"):
            uncast = module.model(**inputs).logits
    assert torch.equal(uncast, peft_default) and casting == [True, False]
    assert all(layer.cast_input_dtype_enabled for layer in module._lora_layers)  # restored
    with torch.no_grad():  # outside autocast the cast stays (bf16 inputs, fp32 LoRA weights)
        module._forward(dict(inputs), None)


def _lora_logits_and_grads(module, inputs, fused, autocast=False):
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            lora_addmm(module._lora_layers) if fused else contextlib.nullcontext():
        logits = module.model(**inputs).logits
    logits.float().square().mean().backward()
    return logits.detach().float(), {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("torch_dtype", [None, "bfloat16"])
def test_lora_as_one_addmm_gives_peft_logits_and_gradients(torch_dtype, monkeypatch):
    module = RetrofitModule(backbone="tiny:llama", torch_dtype=torch_dtype,
                            lora={"r": 4, "target_modules": ["q_proj", "up_proj", "down_proj"]})
    with torch.no_grad():  # a LoRA that does something
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    inputs = tiny_inputs(module.processor, batch=2)
    addmm, calls = torch.addmm, []
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(1) or addmm(*a, **k))
    autocast = torch_dtype == "bfloat16"  # bf16 frozen weights train under autocast; fp32 ones need none
    peft_logits, peft_grads = _lora_logits_and_grads(module, inputs, fused=False, autocast=autocast)
    assert not calls
    logits, grads = _lora_logits_and_grads(module, inputs, fused=True, autocast=autocast)
    assert len(calls) == 4 * 3  # every adapted projection of the 4 layers
    assert grads.keys() == peft_grads.keys() and len(grads) == 4 * 3 * 2
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if autocast else {"atol": 1e-5, "rtol": 1e-5}  # bf16: one rounding less
    torch.testing.assert_close(logits, peft_logits, **tolerance)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, peft_grads[name], **tolerance, msg=name)
    assert not any("forward" in vars(layer) for layer in module._lora_layers)  # PEFT's forward back
    calls.clear()
    with torch.no_grad(), module.teacher(), lora_addmm(module._lora_layers):  # adapters off: PEFT's path, the base
        module.model(**inputs)
    assert not calls


def test_lora_addmm_leaves_other_adapters_to_peft():
    module = RetrofitModule(backbone="tiny:llama", lora={"r": 4, "target_modules": ["q_proj"], "use_dora": True})
    inputs = tiny_inputs(module.processor, batch=2)
    with torch.no_grad():
        expected = module.model(**inputs).logits
        with lora_addmm(module._lora_layers):
            assert torch.equal(module.model(**inputs).logits, expected)

def test_compute_penalty_drop_schedule_and_lr_schedule():
    expected = torch.tensor(0.9, requires_grad=True)
    assert compute_penalty(expected, None, 5.0) == 0
    torch.testing.assert_close(compute_penalty(expected, 0.8, 2.0, "hinge"), torch.tensor(0.2))
    torch.testing.assert_close(compute_penalty(expected, 0.95, 2.0, "hinge"), torch.tensor(0.0))
    torch.testing.assert_close(compute_penalty(expected, 0.8, 2.0, "squared"), torch.tensor(0.02))
    compute_penalty(expected, 0.8, 2.0).backward()
    assert expected.grad == 2.0
    assert [drop_rate_at(s, 0.4, 4) for s in (0, 2, 4, 100)] == [0.0, 0.2, 0.4, 0.4]
    assert drop_rate_at(0, 0.3, 0) == 0.3
    f = lr_lambda("cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert f(0) == 0.25 and f(3) == 1.0 and f(4) == 1.0
    assert math.isclose(f(9), 0.55) and math.isclose(f(14), 0.1) and math.isclose(f(100), 0.1)
    assert lr_lambda("constant", 2, 10, 0.1)(9) == 1.0
    assert math.isclose(lr_lambda("linear", 0, 10, 0.0)(5), 0.5)


# --------------------------------------------------------------------------- invariants of the loss
@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "gemma3", "idefics3", "llama"])
def test_identity_at_init_zero_kl_and_skipping_gives_signal(family):
    module = RetrofitModule(backbone=f"tiny:{family}", max_drop_rate=0.5)
    batch = _batch(family)
    assert batch["loss_mask"].any()
    identity = module.compute_loss(batch, drop_rate=0.0, seed=0)
    assert identity.kl.abs() < 1e-6 and identity.realised_compute == 1.0
    # Identity at init: no gradient signal (KL(p||p) is flat) ...
    identity.loss.backward()
    assert all(p.grad is None or p.grad.abs().max() < 1e-5 for p in module.adapter.parameters())
    module.zero_grad()
    # ... simulated skipping gives the routers something to learn.
    skipped = module.compute_loss(batch, drop_rate=0.5, seed=1)
    assert skipped.kl > 1e-5 and skipped.realised_compute < 1.0
    assert all(0.0 < v < 1.0 for v in skipped.realised_keep.values())
    assert all(abs(v - 0.5) < 1e-6 for v in skipped.expected_keep.values())
    skipped.loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in module.adapter.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_the_kl_positions_only_give_the_loss_and_gradients_of_full_logits(family):
    module = RetrofitModule(backbone=f"tiny:{family}", distill_positions="text", max_drop_rate=0.5)
    _randomise_routers(module.adapter)
    batch = _batch(family)
    inputs, mask = module.model_inputs(batch)
    assert mask.any() and not mask.all()  # padding and image placeholders are not read
    with torch.no_grad():
        full = module.model(**inputs).logits
        with head_rows_selected(module.adapter.spec.get_lm_head(module.model), mask):
            selected = module.model(**inputs).logits
    assert selected.shape == (int(mask.sum()), full.shape[-1])
    torch.testing.assert_close(selected, full[mask], atol=1e-5, rtol=1e-5)
    losses, grads = {}, {}
    for select in (True, False):
        module.hparams.select_logits = select
        module.zero_grad(set_to_none=True)
        out = module.compute_loss(batch, drop_rate=0.5, seed=1)
        out.loss.backward()
        losses[select] = out.loss.detach()
        grads[select] = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    assert losses[True] > 1e-5 and grads[True] and grads[True].keys() == grads[False].keys()
    torch.testing.assert_close(losses[True], losses[False], atol=1e-6, rtol=1e-5)
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][name], atol=1e-6, rtol=1e-4, msg=name)


def test_teacher_is_the_base_model_without_inference_tensors():
    module = RetrofitModule(backbone="tiny:qwen2_vl")
    _randomise_routers(module.adapter)
    base, _ = tiny_vlm("qwen2_vl")
    batch = _batch("qwen2_vl")
    inputs, _ = module.model_inputs(batch)
    with module.teacher():
        teacher = module.model(**inputs).logits
    with torch.no_grad():
        reference = base(**inputs).logits
        student = module.model(**inputs).logits
    assert not teacher.requires_grad and not teacher.is_inference()
    torch.testing.assert_close(teacher, reference, atol=1e-5, rtol=0)
    assert (student - reference).abs().max() > 1e-3  # the routers really change the student


def test_skip_simulation_is_the_cached_inference_function():
    """Invariant 2 for training: the student forward under SkipSimulation equals the no-cache reference with the
    same per-token pattern AND prefill + token-by-token decoding with the KV cache (kv-only fill)."""
    module = RetrofitModule(backbone="tiny:llama", router={"skip_gate": True}, backbone_kwargs={"num_hidden_layers": 6})
    adapter, model = module.adapter, module.model
    _randomise_routers(adapter)
    tokenizer = module.processor
    ids = tokenizer(["The quick brown fox jumps over the lazy dog. A small red ball rolls across the grass."],
                    return_tensors="pt")["input_ids"]
    T = ids.shape[1]
    sim = module.simulation(drop_rate=0.3, seed=7)
    masks, ran = {}, sim.ran

    def recording_ran(block):
        mask = ran(block)
        if mask is not None:
            masks[block] = ~mask
        return mask

    sim.ran = recording_ran
    with sim:
        student = model(input_ids=ids).logits
    skips = torch.stack(list(masks.values()))
    assert set(masks) == set(adapter.layout.skippable_blocks) and 0 < skips.float().mean() < 1
    assert student.requires_grad

    window = {"cols": slice(0, T)}
    policy = PatternPolicy(lambda block, state: masks[block][:, window["cols"]])
    with torch.no_grad():
        with SkipController(adapter, policy):
            reference = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(student.detach(), reference, atol=1e-5, rtol=0)
        prefill = T // 2
        with SkipController(adapter, policy) as report:
            window["cols"] = slice(0, prefill)
            out = model(input_ids=ids[:, :prefill], use_cache=True)
            cache, pieces = out.past_key_values, [out.logits]
            for t in range(prefill, T):
                window["cols"] = slice(t, t + 1)
                out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                pieces.append(out.logits)
        cached = torch.cat(pieces, 1)
    assert report.layer_calls["kv_only"] > 0  # whole-token skips took the kv-only path
    torch.testing.assert_close(cached, student.detach(), atol=1e-4, rtol=0)


def test_gate_gradient_pulls_expected_compute_toward_target():
    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True}, compute_target=0.5,
                            compute_weight=1.0, max_drop_rate=0.0)
    out = module.compute_loss(_batch("qwen2_vl"), drop_rate=0.0, seed=0)
    assert out.expected_compute > 0.5 and out.penalty > 0
    out.loss.backward()
    for gate in module.adapter.gates.values():
        assert gate.bias.grad > 0  # lowering the run probability lowers the penalty


def test_compute_counted_on_response_counts_the_answer_tokens_only(tmp_path, monkeypatch):
    batch = _batch("qwen2_vl")
    assert batch["loss_mask"].any() and (batch["attention_mask"].bool() & ~batch["loss_mask"].bool()).any()
    counted = {}
    for where in ("text", "response"):
        module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True}, compute_target=0.5,
                                max_drop_rate=0.0, compute_counted_on=where)

        def capture(drop_rate, seed, removed, positions, simulation=module.simulation, where=where):
            counted[where] = positions
            return simulation(drop_rate, seed, removed, positions)
        monkeypatch.setattr(module, "simulation", capture)
        module.compute_loss(batch, drop_rate=0.0, seed=0)
        assert module.adapter.compute_counted_on == where
    assert torch.equal(counted["response"], batch["loss_mask"].bool())  # what a decode step runs
    assert counted["text"].sum() > counted["response"].sum()  # the prompt's text positions too
    module.save_adapter(tmp_path / "adapter")
    module.adapter.detach()
    assert RouterAdapter.from_pretrained(module.model, tmp_path / "adapter").compute_counted_on == "response"
    with pytest.raises(ValueError, match="compute_counted_on must be 'text' or 'response'"):
        RetrofitModule(backbone="tiny:qwen2_vl", compute_counted_on="answer")


# --------------------------------------------------------------------------- training loop
def test_few_steps_train_only_the_routers_and_log_everything():
    module = RetrofitModule(backbone="tiny:qwen2_vl", max_drop_rate=0.5, drop_warmup_steps=0, lr=1e-2, warmup_steps=1)
    dm = FixedBatchDataModule(processor="tiny:qwen2_vl", num_batches=3, val_batches=0, batch_size=2)
    frozen = {k: v.clone() for k, v in module.model.state_dict().items()}
    routers = {k: v.clone() for k, v in module.adapter.state_dict().items()}
    logged = []

    class Capture(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    _trainer(3, callbacks=[Capture()]).fit(module, dm)
    assert all(torch.equal(v, module.model.state_dict()[k]) for k, v in frozen.items())
    changed = [k for k, v in module.adapter.state_dict().items() if not torch.equal(v, routers[k])]
    assert any(k.endswith("query") for k in changed)
    assert not module.model.training  # the backbone stays in eval mode (no dropout in student or teacher)
    assert len(logged) == 3
    last = logged[-1]
    skippable = module.adapter.layout.skippable_blocks
    required = {"train/loss", "train/kl", "train/lr", "train/keep_expected", "train/keep_realised",
                "train/router_entropy", "train/compute_expected", "train/compute_realised", "train/drop_rate",
                "train/nonfinite_steps"}
    required |= {f"train/keep_expected/b{b}" for b in skippable} | {f"train/keep_realised/b{b}" for b in skippable}
    required |= {f"train/router_entropy/{k}" for k in module.adapter.routers}
    assert required <= set(last)
    assert last["train/drop_rate"] == 0.5 and last["train/keep_expected"] == 0.5
    assert 0 < last["train/lr"] <= 1e-2 and last["train/router_entropy"] > 0


def test_dense_steps_run_every_block_without_the_penalty_and_train_routers_and_lora_toward_the_base():
    module = RetrofitModule(backbone="tiny:llama", router={"skip_gate": True}, compute_target=0.6, max_drop_rate=0.3,
                            lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    _randomise_routers(module.adapter)  # a routed model that has drifted from the base with skipping off
    batch = _batch("llama")
    skipping = module.compute_loss(batch, drop_rate=0.3, seed=3)
    assert skipping.realised_compute < 1.0 and skipping.penalty > 0
    dense = module.compute_loss(batch, drop_rate=0.3, seed=3, dense=True)
    assert dense.realised_compute == 1.0 and dense.penalty == 0 and not dense.keeps_sampled
    assert dense.kl > 1e-4  # the drift with skipping off is what these steps train away
    dense.loss.backward()
    assert all(r.query.grad is not None and r.query.grad.abs().max() > 0 for r in module.adapter.routers.values())
    assert all(g.query.grad is None for g in module.adapter.gates.values())  # no gate is sampled
    assert any(p.grad is not None and p.grad.abs().max() > 0 for n, p in module.named_parameters() if "lora_" in n)


def test_dense_steps_are_drawn_per_step_at_their_fraction_and_logged_apart():
    assert not any(RetrofitModule(backbone="tiny:llama").is_dense_step(seed) for seed in range(50))
    module = RetrofitModule(backbone="tiny:qwen2_vl", max_drop_rate=0.5, drop_warmup_steps=0, dense_step_fraction=0.5)
    draws = [module.is_dense_step(seed) for seed in range(400)]
    assert draws == [module.is_dense_step(seed) for seed in range(400)]  # a resumed run draws the same steps
    assert 0.4 < sum(draws) / len(draws) < 0.6
    logged = []

    class Capture(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    dm = FixedBatchDataModule(processor="tiny:qwen2_vl", num_batches=8, val_batches=0, batch_size=2)
    _trainer(8, callbacks=[Capture()]).fit(module, dm)
    flags = [entry["train/dense_step"] for entry in logged]
    expected = [float(module.is_dense_step(module._step_seed(step, 0))) for step in range(8)]
    assert flags == expected and 0 < sum(flags) < 8
    for entry, previous in zip(logged[1:], logged):
        if entry["train/dense_step"]:  # the skipping steps' KL is not overwritten by a dense step's
            assert entry["train/kl"] == previous.get("train/kl", entry["train/kl"]) and "train/kl_dense" in entry


def test_optimizer_covers_trainable_parameters_only():
    module = RetrofitModule(backbone="tiny:llama", router={"skip_gate": True}, weight_decay=0.1,
                            lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = module.configure_optimizers()["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(params) == len(trainable) and {id(p) for p in params} == {id(p) for p in trainable}
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in names) and any(n.startswith("adapter.gates") for n in names)
    no_decay = {id(p) for g in parameter_groups(module.named_parameters(), 0.1) if g["weight_decay"] == 0
                for p in g["params"]}
    for name, param in module.named_parameters():
        if param.requires_grad and name.endswith(("key_norm_weight", "norm_weight", ".bias")):
            assert id(param) in no_decay, name


def test_lora_healing_teacher_is_the_plain_base():
    module = RetrofitModule(backbone="tiny:llama",
                            lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
                                  "init_lora_weights": False})
    base, _ = tiny_vlm("llama")
    batch = _batch("llama")
    inputs, _ = module.model_inputs(batch)
    with module.teacher():
        teacher = module.model(**inputs).logits
    with torch.no_grad():
        torch.testing.assert_close(teacher, base(**inputs).logits, atol=1e-5, rtol=0)
        assert (module.model(**inputs).logits - teacher).abs().max() > 1e-4  # the student has LoRA on
    ckpt = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ckpt)
    assert set(ckpt["state_dict"]) == module.trainable_keys()
    assert all(k.startswith("adapter.") or "lora_" in k for k in ckpt["state_dict"])


def test_teacher_switches_adapters_off_as_peft_does_and_gives_each_its_state_back():
    module = RetrofitModule(backbone="tiny:llama",
                            lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
                                  "modules_to_save": ["lm_head"], "init_lora_weights": False})
    lm_head_copy = next(m for m in module._adapter_switches if hasattr(m, "modules_to_save"))
    with torch.no_grad():  # the trainable copy of the head differs from the frozen one, as after training
        lm_head_copy.modules_to_save["default"].weight.add_(0.05)
    base, _ = tiny_vlm("llama")
    inputs, _ = module.model_inputs(_batch("llama"))
    with torch.no_grad():
        with module.adapter.disabled(), module.model.disable_adapter():  # the teacher's routers are off too
            peft_off = module.model(**inputs).logits
        with module.teacher():
            teacher = module.model(**inputs).logits
            assert not module.model.has_active_enabled_adapter
        student = module.model(**inputs).logits
        torch.testing.assert_close(teacher, peft_off, atol=0, rtol=0)
        torch.testing.assert_close(teacher, base(**inputs).logits, atol=1e-5, rtol=0)
        assert (student - teacher).abs().max() > 1e-4  # LoRA and the head's copy are back on
    assert module.model.has_active_enabled_adapter
    first, *others = module._adapter_switches
    first.enable_adapters(False)  # switched off by its user: the teacher leaves it off
    with module.teacher():
        pass
    assert first.disable_adapters and not any(layer.disable_adapters for layer in others)
    assert all(p.requires_grad for layer in others for n, p in layer.named_parameters()
               if "lora_" in n or "modules_to_save" in n)


def test_modules_to_save_copies_of_a_bf16_backbone_train_in_fp32_and_run_outside_autocast():
    module = RetrofitModule(backbone="tiny:llama", torch_dtype="bfloat16", max_drop_rate=0.5, lr=1e-3,
                            lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "modules_to_save": ["norm"]})
    wrappers = [m for m in module._adapter_switches if hasattr(m, "modules_to_save")]
    copies = [w.modules_to_save["default"] for w in wrappers]
    assert len(copies) == 9  # two norms per layer and the final norm
    assert all(w.original_module.weight.dtype == torch.bfloat16 for w in wrappers)
    assert all(c.weight.dtype == torch.float32 and c.weight.requires_grad for c in copies)
    before = [c.weight.detach().clone() for c in copies]
    optimizer = module.configure_optimizers()["optimizer"]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as bf16-mixed steps run
        out = module.compute_loss(_batch("llama"), drop_rate=0.5, seed=1)
    out.loss.backward()
    optimizer.step()
    # An AdamW step of at most lr = 1e-3 (less in warmup) on a gain of 1: in bf16 it would round back to 1 (a unit
    # there is 2^-7).
    steps = [float((c.weight.detach() - b).abs().max()) for c, b in zip(copies, before)]
    assert all(1e-5 < step <= 1.1e-3 for step in steps), steps
    inputs, _ = module.model_inputs(_batch("llama"))
    with torch.no_grad():  # no autocast, as generation runs: bf16 activations meet the fp32 copies
        logits = module.model(**inputs).logits
        with module.teacher():
            teacher = module.model(**inputs).logits
    assert logits.dtype == teacher.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert (logits.float() - teacher.float()).abs().max() > 0  # the trained copies are what the student runs


class _NaNAt(RetrofitModule):
    """Loss is NaN at the listed optimizer steps (all steps when `nan_steps` is None)."""

    nan_steps: set | None = set()

    def compute_loss(self, batch, **kw):
        out = super().compute_loss(batch, **kw)
        if self.nan_steps is None or self.global_step in self.nan_steps:
            out.loss = out.loss * float("nan")
        return out


def test_nonfinite_step_is_skipped_and_counted():
    module = _NaNAt(backbone="tiny:qwen2_vl", max_drop_rate=0.5, drop_warmup_steps=0)
    module.nan_steps = {1}
    dm = FixedBatchDataModule(processor="tiny:qwen2_vl", num_batches=4, val_batches=0, batch_size=2)
    snapshots = []

    class Snap(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append({k: v.clone() for k, v in pl_module.adapter.state_dict().items()})

    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        trainer = _trainer(4, callbacks=[Snap()])
        trainer.fit(module, dm)
    assert trainer.global_step == 4 and module.nonfinite_steps == 1 and module.stop_reason is None
    assert all(torch.isfinite(v).all() for v in module.adapter.state_dict().values())
    # The NaN step (the second batch) left the routers as they were; the others moved them.
    assert all(torch.equal(snapshots[1][k], snapshots[0][k]) for k in snapshots[0])
    assert any(not torch.equal(snapshots[2][k], snapshots[1][k]) for k in snapshots[1])


def test_nonfinite_streak_stops_training_with_a_message():
    module = _NaNAt(backbone="tiny:qwen2_vl", max_nonfinite_steps=3)
    module.nan_steps = None
    dm = FixedBatchDataModule(processor="tiny:qwen2_vl", num_batches=2, val_batches=0, batch_size=2)
    trainer = _trainer(20)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer.fit(module, dm)
    assert module.nonfinite_steps == 3 and trainer.global_step == 3
    assert "non-finite 3 steps in a row" in module.stop_reason


def test_query_lr_scale_puts_queries_in_their_own_group():
    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_gate": True}, lr=1e-2, query_lr_scale=0.125)
    groups = module.configure_optimizers()["optimizer"].param_groups
    queries = {id(r.query) for r in module.adapter.routers.values()} | {id(g.query) for g in module.adapter.gates.values()}
    by_lr = {}
    for group in groups:
        for param in group["params"]:
            by_lr[id(param)] = group["initial_lr"]  # the scheduler scales "lr" during warmup
    assert {by_lr[q] for q in queries} == {1e-2 * 0.125}
    assert {lr for key, lr in by_lr.items() if key not in queries} == {1e-2}
    routers_only = RetrofitModule(backbone="tiny:qwen2_vl", lr=1e-2, query_lr_scale=0.125)
    optimizer = routers_only.configure_optimizers()["optimizer"]
    assert optimizer.param_groups[0].get("name") == "queries"  # the first group: what a naive lr log would show
    assert base_lr(optimizer) == pytest.approx(1e-2 / routers_only.hparams.warmup_steps)  # warmup step 0
    with pytest.raises(ValueError, match="query_lr_scale"):
        RetrofitModule(backbone="tiny:qwen2_vl", query_lr_scale=0.0).configure_optimizers()



def test_lora_b_lr_scale_puts_the_lora_b_matrices_in_their_own_group():
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    module = RetrofitModule(backbone="tiny:llama", lora=lora, lr=1e-3, lora_b_lr_scale=16.0)
    optimizer = module.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in module.named_parameters()}
    by_name = {names[id(p)]: g["initial_lr"] for g in optimizer.param_groups for p in g["params"]}
    lora_b = {n for n in by_name if ".lora_B." in n}
    assert lora_b and {by_name[n] for n in lora_b} == {1e-3 * 16}
    assert any(".lora_A." in n for n in by_name) and {lr for n, lr in by_name.items() if n not in lora_b} == {1e-3}
    assert base_lr(optimizer) == pytest.approx(1e-3 / module.hparams.warmup_steps)  # the unnamed groups' rate
    plain = RetrofitModule(backbone="tiny:llama", lora=lora, lr=1e-3).configure_optimizers()["optimizer"]
    assert not any("name" in g for g in plain.param_groups)
    with pytest.raises(ValueError, match="lora_b_lr_scale"):
        RetrofitModule(backbone="tiny:llama", lora=lora, lora_b_lr_scale=0.0).configure_optimizers()

def test_distill_positions_text_covers_prompts_but_not_images_or_padding():
    batch = _batch("qwen2_vl", batch_size=2)
    response = RetrofitModule(backbone="tiny:qwen2_vl")
    text = RetrofitModule(backbone="tiny:qwen2_vl", distill_positions="text")
    _, answer_mask = response.model_inputs(batch)
    inputs, text_mask = text.model_inputs(batch)
    image_ids = response.adapter.spec.image_token_ids(response.model.config)
    is_image = torch.isin(inputs["input_ids"], torch.tensor(sorted(image_ids)))
    assert is_image.any() and not (text_mask & is_image).any()
    assert not (text_mask & ~inputs["attention_mask"].bool()).any()
    assert text_mask.sum() > answer_mask.sum()
    assert torch.isfinite(text.compute_loss(batch, drop_rate=0.3, seed=0).loss)
    with pytest.raises(ValueError, match="distill_positions"):
        RetrofitModule(backbone="tiny:qwen2_vl", distill_positions="all")


def test_hidden_state_distillation_is_the_mean_relative_error_of_the_pairs():
    from vlm_retrofit.training.losses import hidden_state_distillation

    torch.manual_seed(0)
    teacher = [torch.randn(2, 4, 6) for _ in range(3)]
    student = [t + 0.1 * torch.randn_like(t) for t in teacher[:2]]
    student[0].requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)

    def relative(s, t):
        return ((s[mask] - t[mask]).square().sum(-1) / t[mask].square().sum(-1)).mean()

    value = hidden_state_distillation(student, teacher, [(0, 1), (1, 2)], mask)
    torch.testing.assert_close(value, (relative(student[0], teacher[1]) + relative(student[1], teacher[2])) / 2)
    assert hidden_state_distillation(teacher, teacher, [(0, 0), (2, 2)], mask) == 0
    empty = hidden_state_distillation(student, teacher, [(0, 1)], torch.zeros_like(mask))
    empty.backward()  # no selected position: zero, still differentiable
    assert empty == 0 and student[0].grad is not None
    assert hidden_state_distillation(student, teacher, []) == 0


def test_save_adapter_replaces_the_folder_whole(tmp_path):
    # A LoRA an earlier run left in the run's adapter folder must not be merged later with these routers.
    adapter = tmp_path / "adapter"
    RetrofitModule(backbone="tiny:llama", lora={"r": 2, "target_modules": ["q_proj"]}).save_adapter(adapter)
    assert (adapter / "lora" / "adapter_config.json").is_file()
    RetrofitModule(backbone="tiny:llama").save_adapter(adapter)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # nothing staged is left beside it


@pytest.mark.parametrize("settings, refusal", [
    ({"compute_target": 1.5}, r"compute_target .* in \(0, 1\]; got 1.5"),
    ({"compute_target": 0.7, "router": {"skip_gate": False}, "max_drop_rate": 0.3}, "compute_target pulls the learned"),
    ({"router": {"skip_gate": False}, "max_drop_rate": 0.0}, "nothing makes the routers learn"),
    ({"router": {"block_size": 4}, "backbone_kwargs": {"num_hidden_layers": 6}}, r"no block may skip: .* \[0, 4\]"),
    ({"compute_target": 0.3, "router": {"skip_gate": True}}, r"compute_target 0.3 is below what always runs: 0.500"),
    ({"dense_step_fraction": 1.0}, r"dense_step_fraction must be in \[0, 1\), got 1.0"),
    ({"dense_step_fraction": 0.2, "train_routers": False, "lora": {"r": 2, "target_modules": ["q_proj"]},
      "removal_order": [1], "max_removed_blocks": 1, "max_drop_rate": 0.0}, "with train_routers: false the student"),
    ({"compute_target": 0.7, "router": {"skip_gate": True}, "skip_candidates": [1],
      "backbone_kwargs": {"num_hidden_layers": 6}}, r"below what always runs: 0.833 .*blocks \[0, 2, 3, 4, 5\] never skip"),
])
def test_runs_that_cannot_train_what_they_say_are_refused_naming_the_setting(settings, refusal):
    # Before: each trained. A compute penalty with nothing to act on stayed constant; a run without skip pressure,
    # or with no skippable block, moved the routers by rounding noise only (the KL grew from 0).
    with pytest.raises(ValueError, match=refusal):
        RetrofitModule(backbone="tiny:llama", **settings)


def test_a_candidate_count_beside_a_removal_schedule_takes_blocks_the_schedule_keeps():
    # Before: the count took the first blocks of the removal order, the very blocks the schedule removes for every
    # token, so per-token skipping changed nothing.
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs={"num_hidden_layers": 8}, router={"block_size": 1},
                            removal_order=[3, 5, 2, 6, 1, 4], max_removed_blocks=2, min_removed_blocks=2,
                            skip_candidates=2, max_drop_rate=0.3)
    module._set_skip_candidates(2)
    assert module.adapter.skip_candidates == [2, 6]
    with pytest.raises(ValueError, match="names a block twice"):
        module._set_skip_candidates([1, 1])
