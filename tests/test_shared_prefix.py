"""The healing student takes the layers below its first trainable and first removed layer from the teacher's forward."""

import pytest
import torch

from vlm_retrofit.backbones import resolve
from vlm_retrofit.testing import FAMILIES, tiny_vlm
from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule

TARGETS = ("q_proj", "v_proj", "down_proj")


def _module(family: str, removal_order: list[int], lora_from: int, **kwargs) -> RetrofitModule:
    """A 6-layer tiny backbone healed by a LoRA on the decoder layers from `lora_from` on, with random B matrices
    (so that it acts)."""
    model, _ = tiny_vlm(family, num_hidden_layers=6)
    layers = resolve(model).get_layers(model)
    upper = {id(m) for layer in layers[lora_from:] for m in layer.modules()}
    names = [name for name, m in model.named_modules() if id(m) in upper and name.rsplit(".", 1)[-1] in TARGETS]
    torch.manual_seed(0)
    module = RetrofitModule(backbone=f"tiny:{family}", backbone_kwargs={"num_hidden_layers": 6},
                            lora={"r": 4, "lora_alpha": 8, "target_modules": names}, train_routers=False,
                            removal_order=removal_order, max_removed_blocks=2, min_removed_blocks=2,
                            max_drop_rate=0.0, use_gates=False, **kwargs)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return module


def _batch(family: str):
    data = FixedBatchDataModule(processor=f"tiny:{family}", num_batches=1, val_batches=0, batch_size=2, seed=0)
    data.setup()
    return data.train_batches[0]


def _loss_and_grads(module: RetrofitModule, batch, share: bool):
    module.hparams.share_teacher_prefix = share
    module.zero_grad(set_to_none=True)
    out = module.compute_loss(batch, drop_rate=0.0, seed=0)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_gives_the_loss_and_gradients_of_the_whole_student(family):
    module = _module(family, removal_order=[4, 3], lora_from=3)
    assert module.shared_prefix_layers([3, 4]) == 3  # the first removed layer (3), also the first with a LoRA
    batch = _batch(family)
    first = module.adapter.spec.get_layers(module.model)[0]
    calls = []
    first.register_forward_pre_hook(lambda layer, args: calls.append(1))
    whole_loss, whole_grads = _loss_and_grads(module, batch, share=False)
    assert len(calls) == 2  # teacher and student
    calls.clear()
    shared_loss, shared_grads = _loss_and_grads(module, batch, share=True)
    assert module._prefix_verified
    assert len(calls) == 2  # teacher and, once, the check's whole student
    calls.clear()
    again_loss, again_grads = _loss_and_grads(module, batch, share=True)
    assert len(calls) == 1  # the teacher only: the student starts at layer 5
    assert whole_loss > 1e-6  # the removal and the LoRA act
    for loss, grads in ((shared_loss, shared_grads), (again_loss, again_grads)):
        torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == whole_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_nothing_is_shared_below_a_trainable_layer_a_replacement_or_with_the_hidden_term():
    module = _module("llama", removal_order=[4, 3], lora_from=0)
    assert module.shared_prefix_layers([3, 4]) == 0  # LoRA on every layer: the student's layer 0 is not the teacher's
    for name, param in module.model.named_parameters():  # frozen, a LoRA still acts in the student only
        param.requires_grad_(False)
    module._first_adapted_layer = None
    assert module.shared_prefix_layers([3, 4]) == 0
    module = _module("llama", removal_order=[4, 3], lora_from=2)
    assert module.shared_prefix_layers([3, 4]) == 2
    module.replacements = {1: torch.eye(64)}  # carried by layer 1: it must run in the student
    assert module.shared_prefix_layers([3, 4]) == 1
    assert _module("llama", [4, 3], 5, hidden_weight=0.5).shared_prefix_layers([3, 4]) == 0
    assert _module("llama", [4, 3], 5, share_teacher_prefix=False).shared_prefix_layers([3, 4]) == 0


def test_a_prefix_that_does_not_match_the_whole_student_is_dropped_with_a_warning(monkeypatch):
    import vlm_retrofit.training.module as module_code
    from vlm_retrofit.training.prefix import layer_input_replaced

    module = _module("llama", removal_order=[4, 3], lora_from=3)
    batch = _batch("llama")
    whole_loss, _ = _loss_and_grads(module, batch, share=False)
    # A decoder that acts by layer position would hand the next kept layer a different stream: modelled here.
    monkeypatch.setattr(module_code, "layer_input_replaced", lambda layer, hidden: layer_input_replaced(layer, 2 * hidden))
    with pytest.warns(UserWarning, match="share_teacher_prefix"):
        loss, _ = _loss_and_grads(module, batch, share=True)
    assert module._prefix_verified is False and module.shared_prefix_layers([3, 4]) == 0
    torch.testing.assert_close(loss, whole_loss)  # that step already ran the whole student
