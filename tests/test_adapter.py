"""RouterAdapter on every supported family: identity at init, disable/detach, routing in the path, save/load."""

import pytest
import torch

from vlm_retrofit import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers
from vlm_retrofit.backbones import layer_hidden_states, resolve
from vlm_retrofit.routing import entry, get_adapter
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

TEXT_ONLY = {"llama", "qwen2"}


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """(family, model, inputs with images, inputs without images, base logits for both) built once per family."""
    family = request.param
    model, processor = tiny_vlm(family)
    # Frozen, as attach_routers leaves it: F.linear on a non-contiguous 3-D input takes another matmul path when the
    # weight requires grad (under no_grad too), rounding differently (LLaVA-OneVision's projector input, ~1e-7).
    model.requires_grad_(False)
    with_image = tiny_inputs(processor, batch=2, with_image=True)
    text_only = tiny_inputs(processor, batch=2, with_image=False)
    with torch.no_grad():
        base = {"image": model(**with_image).logits, "text": model(**text_only).logits}
    return family, model, {"image": with_image, "text": text_only}, base


@pytest.fixture
def attached(case):
    """Routers attached for one test, always detached afterwards so the module-scoped model stays pristine."""
    family, model, inputs, base = case
    adapter = attach_routers(model, RouterConfig())
    yield family, model, inputs, base, adapter
    adapter.detach()


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _randomize(adapter, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(torch.randn(router.query.shape, generator=generator))
            router.bias.copy_(torch.randn(router.bias.shape, generator=generator))


def test_detach_gives_back_the_trainable_flags_attach_froze():
    # Before: a model fine-tuned after `detach` had nothing left to train, and on LLaVA-OneVision the flags alone
    # moved its logits (see `case`): "as before" was not.
    model, processor = tiny_vlm("llava_onevision")
    model.lm_head.requires_grad_(False)  # a flag of the user's own: kept
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    inputs = tiny_inputs(processor, batch=2)
    before = _logits(model, inputs)
    adapter = attach_routers(model, RouterConfig())
    assert not any(p.requires_grad for p in model.parameters() if not any(p is q for q in adapter.parameters()))
    adapter.detach()
    assert [name for name, p in model.named_parameters() if p.requires_grad] == trainable
    assert torch.equal(_logits(model, inputs), before)


def test_identity_at_init_with_and_without_images(attached):
    family, model, inputs, base, adapter = attached
    for kind in ("image", "text"):
        diff = (_logits(model, inputs[kind]) - base[kind]).abs().max().item()
        assert diff <= 1e-4, f"{family}/{kind}: routed logits differ from base by {diff}"
    # The routers really ran: one weight set per router in the last forward.
    assert set(adapter.last_routing_weights) == set(adapter.routers)
    # A forward without routing (the distillation teacher's) lets the last one's stream go: it held every delta.
    with adapter.disabled():
        _logits(model, inputs["text"])
    assert adapter.last_routing_weights == {} and adapter._state.stack is None


def test_disabled_and_detach_give_the_exact_base(case):
    family, model, inputs, base = case
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = attach_routers(model, RouterConfig())
    _randomize(adapter)
    assert list(model.state_dict()) == list(before), "attach changed the state_dict keys"
    with adapter.disabled():
        assert torch.equal(_logits(model, inputs["image"]), base["image"])
    assert not torch.equal(_logits(model, inputs["image"]), base["image"])
    adapter.detach()
    assert not any(p.requires_grad for p in model.parameters())  # frozen before attach: frozen after detach
    assert torch.equal(_logits(model, inputs["image"]), base["image"])
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert get_adapter(model) is None


def test_unhooked_runs_the_plain_model_and_puts_the_hooks_back(case):
    """Inside: no hook of the adapter on any module, each its own class again, the exact base; after: the same
    hooks, routing again."""
    family, model, inputs, base = case
    adapter = attach_routers(model, RouterConfig(block_size=2))
    _randomize(adapter)
    routed = _logits(model, inputs["image"])
    classes = {id(module): type(module) for module in model.modules()}
    hooks = [entry.entry_hook(module) for module in adapter._entry_modules()]
    assert len(hooks) == adapter.layout.num_blocks + 1  # each block's first layer and the final norm
    with adapter.unhooked() as plain:
        assert plain is model and not any(entry.has_entry(module) for module in model.modules())
        assert all(type(module) is getattr(classes[id(module)], "_vlm_retrofit_plain_class", classes[id(module)])
                   for module in model.modules())
        assert torch.equal(_logits(model, inputs["image"]), base["image"])
    assert {id(module): type(module) for module in model.modules()} == classes
    assert [entry.entry_hook(module) for module in adapter._entry_modules()] == hooks
    assert torch.equal(_logits(model, inputs["image"]), routed)
    adapter.detach()


def test_a_layer_receives_the_routed_input_before_its_own_hooks_and_patched_forward(case):
    """The routers' entry runs first in a hooked layer's call: its forward pre-hooks (even one registered before the
    routers were attached) and an instance `forward` (a skip context's) see the routed input. The layer keeps its
    class's name and type checks; detach gives it its own class back."""
    family, model, inputs, base = case
    layer = resolve(model).get_layers(model)[1]
    plain_class = type(layer)
    seen = {}
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.__setitem__(
        "pre", layer_hidden_states(args, kwargs).clone()), with_kwargs=True)
    original = layer.forward

    def forward(*args, **kwargs):
        seen["forward"] = layer_hidden_states(args, kwargs).clone()
        return original(*args, **kwargs)

    _logits(model, inputs["text"])
    unrouted = seen["pre"]
    adapter = attach_routers(model, RouterConfig(block_size=1))
    _randomize(adapter)
    layer.forward = forward
    try:
        _logits(model, inputs["text"])
    finally:
        del layer.forward
        handle.remove()
    assert isinstance(layer, plain_class) and type(layer).__name__ == plain_class.__name__
    assert not torch.equal(seen["pre"], unrouted)  # the routers changed it (layer 1 is block 1: routed)
    assert torch.equal(seen["forward"], seen["pre"])
    adapter.detach()
    assert type(layer) is plain_class and not entry.has_entry(layer)


def test_routing_is_in_the_forward_path_and_generate_runs(attached):
    family, model, inputs, base, adapter = attached
    with torch.no_grad():
        greedy_base = None
        with adapter.disabled():
            greedy_base = model.generate(**inputs["image"], max_new_tokens=4, do_sample=False)
        greedy_init = model.generate(**inputs["image"], max_new_tokens=4, do_sample=False)
    assert torch.equal(greedy_init, greedy_base), "generation with routers at init differs from the base"
    _randomize(adapter)
    diff = (_logits(model, inputs["image"]) - base["image"]).abs().max().item()
    assert diff > 1e-3, f"{family}: non-zero router queries did not change the logits"
    with torch.no_grad():
        out = model.generate(**inputs["image"], max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["image"]["input_ids"].shape[1] + 4


def test_gradients_reach_router_parameters_only(attached):
    family, model, inputs, base, adapter = attached
    assert not any(p.requires_grad for p in model.parameters())
    logits = model(**inputs["image"]).logits
    (logits.float() * torch.randn_like(logits.float())).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for name, param in adapter.named_parameters():
        if name.endswith("key_norm_weight"):
            continue  # multiplies the query, which is 0 at init: no gradient yet by construction
        assert param.grad is not None and param.grad.abs().sum() > 0, f"{family}: no gradient for {name}"


def test_save_load_round_trip_reproduces_outputs(case, tmp_path):
    family, model, inputs, base = case
    adapter = attach_routers(model, RouterConfig(block_size=2))
    _randomize(adapter, seed=1)
    expected = _logits(model, inputs["image"])
    adapter.save_pretrained(tmp_path)
    adapter.detach()
    assert {p.name for p in tmp_path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    # A fresh build of the same family is the same base (tiny_vlm is deterministic).
    fresh, _ = tiny_vlm(family)
    restored = RouterAdapter.from_pretrained(fresh, tmp_path)
    try:
        assert restored.layout == adapter.layout
        assert torch.equal(_logits(fresh, inputs["image"]), expected)
    finally:
        restored.detach()
    model.requires_grad_(False)  # the fixture's state


def test_mismatched_base_is_refused_before_touching_the_model(case, tmp_path):
    family, model, inputs, base = case
    adapter = attach_routers(model, RouterConfig())
    adapter.save_pretrained(tmp_path)
    adapter.detach()
    model.requires_grad_(False)  # the fixture's state
    deeper, _ = tiny_vlm(family, num_hidden_layers=6)
    before = {k: v.clone() for k, v in deeper.state_dict().items()}
    with pytest.raises(AdapterMismatchError, match="different base model") as err:
        RouterAdapter.from_pretrained(deeper, tmp_path)
    assert "4 layers" in str(err.value) and "6 layers" in str(err.value)
    assert get_adapter(deeper) is None
    assert all(p.requires_grad for p in deeper.parameters())
    assert all(torch.equal(v, before[k]) for k, v in deeper.state_dict().items())
