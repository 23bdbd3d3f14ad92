"""RouterAdapter: depth routers held outside the HF module tree, attached by entry hooks on module instances."""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..backbones import (BackboneSpec, base_fingerprint, differing_weights, layer_hidden_states, lora_layers, resolve,
                         unwrap_model, with_layer_hidden_states)
from ..errors import InputError
from ..files import atomic_write
from . import entry
from .config import BlockLayout, RouterConfig
from .native import StreamBuffers
from .router import DepthRouter, SkipGate
from .stand_in import StandIn
from .stream import SourceStack, StreamState

ADAPTER_TYPE = "vlm_retrofit.attnres_router"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FORMAT_VERSION = 2
"""2: the base fingerprint holds weight samples (1 read on: its fingerprint is compared by structure)."""
FINAL = "final"
CACHELESS_LAYERS = "_vlm_retrofit_cacheless_layers"
"""Attribute a skip context sets on a KV cache: the layers it wrote no K/V for (statically removed)."""

# model -> its attached adapter; weak so that a dropped model does not stay alive through the registry.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, RouterAdapter]" = weakref.WeakKeyDictionary()


class AdapterMismatchError(InputError):
    """An adapter (or checkpoint) was made for a different base model than the one given."""


class RouterAdapter(nn.Module):
    """All router parameters of one backbone, plus the hooks that put them into its forward pass.

    Router `n` (key `str(n)`, n >= 1) runs before block n; block 0 reads only the decoder input, so it has
    no router. Router `"final"` forms the input of the final norm. The HF model's modules, parameters and
    state_dict keys are never changed: `detach()` leaves the model exactly as it was.
    """

    def __init__(self, model: nn.Module, config: RouterConfig | None = None) -> None:
        super().__init__()
        config = config or RouterConfig()
        spec = resolve(model)
        layers = spec.get_layers(model)
        text_config = spec.get_text_config(model)
        self.config = config
        self.spec: BackboneSpec = spec
        self.fingerprint = base_fingerprint(model)
        self.layout: BlockLayout = config.layout(len(layers), spec.always_run_layers(unwrap_model(model).config))
        hidden_size = int(text_config.hidden_size)
        device = next(iter(layers.parameters())).device
        generator = torch.Generator().manual_seed(0)
        num_blocks = self.layout.num_blocks
        routers = {
            str(n): DepthRouter(hidden_size, n + 1, source_bias=config.source_bias, init_scale=config.init_scale,
                                device=device, generator=generator)
            for n in range(1, num_blocks)
        }
        routers[FINAL] = DepthRouter(hidden_size, num_blocks + 1, source_bias=config.source_bias,
                                     init_scale=config.init_scale, device=device, generator=generator)
        self.routers = nn.ModuleDict(routers)
        self.gates = nn.ModuleDict(
            {str(n): SkipGate(hidden_size, init_bias=config.gate_init_bias, device=device)
             for n in self.layout.skippable_blocks} if config.skip_gate else {}
        )
        self.stand_ins = nn.ModuleDict(
            {str(layer): StandIn(hidden_size, device=device)
             for layer in self.layout.layers_of_blocks(self.layout.skippable_blocks)} if config.skip_stand_in else {}
        )
        """Per decoder layer of the skippable blocks (key `str(layer)`), what a token skipping it adds instead
        (`RouterConfig.skip_stand_in`); empty without stand-ins."""
        # Plain attributes (not submodules): the adapter must not own or save the backbone.
        self.__dict__["_model_ref"] = weakref.ref(model)
        self._entries: list[weakref.ref[nn.Module]] = []
        """The modules carrying this adapter's entry hooks (`routing.entry`): each block's first layer, the final norm."""
        self._frozen_by_attach: list[nn.Parameter] = []
        self._enabled = True
        self._state = StreamState()
        self._stream_buffers = StreamBuffers()  # a prefill's fused-kernel stream memory, kept for the next one
        self._controller: Any = None
        self.calibration: dict[str, dict[str, dict[str, Any]]] = {}
        """Skip thresholds found by calibration: policy -> target saving -> policy settings."""
        self.calibration_metrics: dict[str, dict[str, dict[str, Any]]] = {}
        """What calibration measured: policy -> target saving -> {achieved_saving, unit, token_match, ...}."""
        self.companions: list[str] = []
        """Files beside the routers that the adapter folder it was saved in or loaded from needs (paths relative to
        it: its LoRA, its linear replacement). Recorded so that a copy without them is refused instead of loading
        as another model (routers without the LoRA they were trained with)."""
        self.removal_order: list[int] | None = None
        """Skippable blocks in the order a removal schedule was trained on (cheapest first); static
        calibration removes a prefix of it. None = untrained for removal (Block Influence decides)."""
        self.removal_range: tuple[int, int] | None = None
        """(fewest, most) leading blocks of `removal_order` a training step removed (k uniform in between): the
        removals its routers and LoRA were trained for. A pruned release of another set is refused unless asked
        for (`untrained_removal`). None = not trained under a removal schedule."""
        self.skip_candidates: list[int] | None = None
        """The only blocks per-token skipping was trained on (`RetrofitModule(skip_candidates=...)`); calibration of a
        per-token policy restricts itself to them by default. None = every skippable block."""
        self.skip_image_positions = True
        """False when per-token skipping was trained with visual placeholders running every block
        (`RetrofitModule(skip_image_positions=False)`); calibration of a per-token policy then keeps them too."""
        self.compute_counted_on = "text"
        """Where per-token skipping's compute target was counted in training (`RetrofitModule(compute_counted_on=...)`):
        "text" (every real text position, prompts too; also routers trained without a compute target) or "response"
        (the answer tokens: what a decode runs); calibration of a per-token policy counts its target there too by
        default."""
        self.base_model: dict[str, Any] = {"name": getattr(unwrap_model(model), "name_or_path", None) or None}
        """How to load the base again: keyword arguments of `vlm_retrofit.backbones.loading.load_backbone`."""

    # -- attach / detach -------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model this adapter was attached to no longer exists")
        return model

    @property
    def attached(self) -> bool:
        return bool(self._entries)

    def _attach(self) -> "RouterAdapter":
        model = self.model
        if model in _ATTACHED:
            raise RuntimeError("this model already has a RouterAdapter attached; call adapter.detach() first")
        layers = self.spec.get_layers(model)
        hooked = [(layers[start], self._block_hook(block)) for block, start in enumerate(self.layout.block_starts)]
        hooked.append((self.spec.get_final_norm(model), self._final_hook))
        try:
            for module, hook in hooked:
                entry.install(module, hook)
                self._entries.append(weakref.ref(module))
        except RuntimeError:  # a module another adapter entered: leave the model as it was
            self._remove_entries()
            raise
        _ATTACHED[model] = self
        return self

    def detach(self) -> None:
        """Remove every hook and unfreeze the parameters `attach_routers` froze (those that were trainable before
        it): the model computes and trains as it did before."""
        self._remove_entries()
        for parameter in self._frozen_by_attach:
            parameter.requires_grad_(True)
        self._frozen_by_attach = []
        self._drop_state()
        self._stream_buffers = StreamBuffers()  # the kept stream memory goes with the hooks
        model = self._model_ref()
        if model is not None and _ATTACHED.get(model) is self:
            del _ATTACHED[model]

    def merge_lora(self) -> nn.Module:
        """Merge the LoRA of the PEFT model this adapter is attached to (`merge_and_unload`) and attach the adapter
        to the merged model it returns. The hooks move with it: the merge puts a LoRA's `modules_to_save` copies in
        place of their wrappers, and a hook on the final norm's wrapper would otherwise be lost with it."""
        model = self.model
        self.detach()
        merged = model.merge_and_unload()
        self.__dict__["_model_ref"] = weakref.ref(merged)
        return self._attach().model

    @contextlib.contextmanager
    def disabled(self) -> Iterator["RouterAdapter"]:
        """Run the exact base function inside the block (the distillation teacher)."""
        previous, self._enabled = self._enabled, False
        try:
            yield self
        finally:
            self._enabled = previous

    @contextlib.contextmanager
    def unhooked(self) -> Iterator[nn.Module]:
        """The plain base model (yielded): this adapter's hooks taken off it while inside, and the same hooks put back
        on exit.

        `disabled()` runs the base function through the hooks; this also leaves out their calls: the base that speed
        ratios divide by. Nothing of this adapter runs inside, the check that a KV cache filled under static removal
        is continued under the same removal included.
        """
        hooked = [(module, entry.entry_hook(module)) for module in self._entry_modules()]
        for module, _ in hooked:
            entry.remove(module)
        try:
            yield self.model
        finally:
            for module, hook in hooked:
                entry.install(module, hook)

    def _remove_entries(self) -> None:
        for module in self._entry_modules():
            entry.remove(module)
        self._entries.clear()

    def _entry_modules(self) -> list[nn.Module]:
        """The modules carrying this adapter's hooks, where they still exist and carry them."""
        modules = (ref() for ref in self._entries)
        return [module for module in modules if module is not None and entry.has_entry(module)]

    @property
    def enabled(self) -> bool:
        return self._enabled and self.attached

    # -- hooks -----------------------------------------------------------------------------------------
    def _block_hook(self, block: int):
        key = str(block)

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if block:  # a whole forward on the fused kernels (a decoding step) routes in one call, nothing else
                route_whole = self._state.route_whole
                if route_whole is not None:
                    routed = route_whole(block - 1, layer_hidden_states(args, kwargs), key)
                    if routed is not None:
                        return with_layer_hidden_states(args, kwargs, routed)
            cache = kwargs.get("cache", kwargs.get("past_key_values")) if block == 0 else None
            if cache is not None:
                self._check_cache(cache)  # also for the base function (disabled routers): it runs every layer
            if not self._enabled:
                if block == 0:  # a forward without routing: the previous one's stream (every delta) can go now
                    self._drop_state()
                return None
            hidden = layer_hidden_states(args, kwargs)
            controller = self._controller
            if block == 0:
                self._follow_device(hidden)
                stack = self._drop_state().stack  # the last forward's own hold on its stream goes before reuse
                if stack is not None and not stack.restart(hidden):
                    stack = None  # and before a new stream takes the memory it held (`StreamBuffers`)
                if stack is None:
                    stack = SourceStack(hidden, self.layout.num_blocks + 1, self.config.key_norm_eps,
                                        self._stream_buffers)
                # Read before layer 0 writes: the tokens the cache already holds (0 in prefill or without one).
                context = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
                self._state = StreamState(stack=stack, routed_input=hidden, context_length=context)
                if stack.native is not None:
                    # Every router of this forward, checked in one pass here: per layer the same check costs
                    # several times more, between layers that evict the caches.
                    self._state.fused_params = [router._inference_params()[1] for router in self.routers.values()]
                    if controller is None:
                        self._state.enable_whole_routing()
                    if controller is not None and controller.reads_gates and len(self.gates):  # the same way
                        self._state.fused_gates = [self.gates[key]._inference_params() if key in self.gates else None
                                                   for key in self.routers]
                if controller is not None:
                    controller.begin_forward(self._state)
                    controller.decide(0, self._state)
                return None
            if controller is None:
                return with_layer_hidden_states(args, kwargs, self._push_and_mix(block - 1, hidden, key))
            if controller.bypasses(block):
                # Every token skips this block and it writes no cache: nothing would read its routed input.
                self._record_delta(block - 1, hidden, controller.ran(block - 1))
                controller.decide(block, self._state)
                return None
            routed = self._push_and_mix(block - 1, hidden, key)
            controller.decide(block, self._state)
            return with_layer_hidden_states(args, kwargs, routed)

        return hook

    def _drop_state(self) -> StreamState:
        """Forget the last forward's stream state (returned); the next forward starts a new one."""
        previous = self._state
        # Its `route_whole` closure holds the state: a cycle only the garbage collector would free, keeping the last
        # forward's stream (all its sources, megabytes in a prefill) alive until it ran.
        previous.route_whole = None
        self._state = StreamState()
        return previous

    def _check_cache(self, cache: Any) -> None:
        """Refuse a cache that lacks K/V for layers this forward would run (written under static removal)."""
        missing = getattr(cache, CACHELESS_LAYERS, None)
        if not missing:
            return
        allowed = getattr(self._controller, "cacheless_layers", frozenset()) if self._enabled else frozenset()
        if not missing <= allowed:
            raise RuntimeError(
                f"this KV cache was filled under static removal of layers {sorted(missing)}, which hold no K/V in it; "
                "continue it only under the same static skipping, or start a new cache (e.g. a new generate call)"
            )

    def _final_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self._enabled:
            return None
        hidden = layer_hidden_states(args, kwargs)
        route_whole = self._state.route_whole
        routed = route_whole(self.layout.num_blocks - 1, hidden, FINAL) if route_whole is not None else None
        if routed is None:
            routed = self._push_and_mix(self.layout.num_blocks - 1, hidden, FINAL)
        return with_layer_hidden_states(args, kwargs, routed)

    def _record_delta(self, block: int, hidden: Tensor, present: Tensor | bool | None) -> None:
        """Push the delta of `block` (its output `hidden` minus its routed input), absent where it was skipped
        (`present`: the skip controller's `ran(block)`, None when every token ran it)."""
        state = self._state
        if state.routed_input is None:
            raise RuntimeError("router hook ran before the decoder's first layer; is the decoder loop reordered?")
        if present is False:  # no token ran the block: its delta is absent everywhere
            state.stack.drop()
        else:
            state.stack.push_delta(hidden, state.routed_input, present)

    def _push_and_mix(self, block: int, hidden: Tensor, key: str) -> Tensor:
        """`_record_delta`, then `_mix(block, key)`: one fused call where every token ran the block,
        on a buffered fp32 CPU stream (a decoding step's case, with or without a skip policy)."""
        state = self._state
        present = self._controller.ran(block) if self._controller is not None else None
        if state.fused_params is not None and present is None:
            stack = state.stack
            gate = state.fused_gates[block] if state.fused_gates is not None else None
            # Router `key` runs after `block`: routers are listed in block order, the final one last.
            row = stack.push_delta_and_route(hidden, state.routed_input, state.fused_params[block], gate)
            if row is not None:
                return self._take_fused_row(key, row)
        self._record_delta(block, hidden, present)
        return self._mix(block, key)

    def _mix(self, block: int, key: str) -> Tensor:
        """Mix every source on the stream with router `key`, the one after `block`: the input of the next block (or
        the final norm)."""
        state = self._state
        if state.fused_params is not None:
            gate = state.fused_gates[block] if state.fused_gates is not None else None
            row = state.stack.route_fused(state.fused_params[block], gate)
            if row is not None:
                return self._take_fused_row(key, row)
        routed, alpha = self.routers[key](state.stack)
        state.routed_input = routed
        state.alphas[key] = alpha
        return routed

    def _take_fused_row(self, key: str, row: int) -> Tensor:
        """Router `key`'s output, left by the fused kernels in `row`: the next block's input. Its weights stay in the
        kernels' buffer until asked for (`StreamState.alpha`), its gate's run probability is noted where computed."""
        state = self._state
        native = state.stack.native
        routed = state.routed_input = native.routed_rows[row]
        state.fused_rows[key] = row
        gate_run = native.gate_run_row(row)
        if gate_run is not None:
            state.gate_run[key] = gate_run
        return routed

    # -- skipping --------------------------------------------------------------------------------------
    def skipping(self, policy: Any = "recent_weight", *, budget: int | float | None = None,
                 target_saving: float | None = None, **policy_kwargs: Any) -> Any:
        """Context in which blocks are skipped per token; `as report` gives the SkipReport of what ran.

        `policy` is a name (`recent_weight` with `thresholds=`, `gate` with `threshold=`, `static` with
        `blocks=`, `random` with `rate=`) or a `SkipPolicy`. `target_saving` looks up thresholds stored by
        calibration; `budget` caps the blocks one token may skip (a count, or a fraction in (0, 1)).
        """
        from ..skipping.runtime import skipping

        return skipping(self, policy, budget=budget, target_saving=target_saving, **policy_kwargs)

    def _set_controller(self, controller: Any) -> None:
        """Install (or with None remove) the object that decides per token which blocks run.

        It is called with `begin_forward(state)` at the first layer, `decide(block, state)` after each
        block's routing (state.routed_input is that block's input, state.alpha(key) its routing weights) and
        `ran(block)` when the block's delta is recorded: a bool [B, T] run mask, None (all ran) or False
        (no token ran it: the delta is dropped from the stream rather than stored as absent everywhere).
        `bypasses(block)` True means every token skips the block and it writes no cache, so its router
        is not run at all (the layer returns its input, whatever that is). `reads_gates` True asks for the skip
        gates' run probabilities in `state.gate_run` where the fused kernels route (the policy computes the rest).
        """
        if controller is not None and self._controller is not None:
            raise RuntimeError("skipping is already active on this adapter; nested skip contexts are not supported")
        self._controller = controller

    def _follow_device(self, hidden: Tensor) -> None:
        # The adapter lives outside the model's module tree, so `model.to(device)` does not move it.
        if self.routers[FINAL].query.device != hidden.device:
            self.to(hidden.device)

    @property
    def last_routing_weights(self) -> dict[str, Tensor]:
        """Routing weights alpha [K, B, T] of each router in the most recent forward, keyed like `routers`."""
        state = self._state
        if state.stack is None:
            return {}
        # Internally alpha covers the stored sources only; callers index it by source (s_0, block 0's delta, ...).
        return {key: state.stack.expand(state.alpha(key), self.routers[key].num_sources) for key in state.routed_keys()}

    # -- persistence -----------------------------------------------------------------------------------
    def adapter_config(self) -> dict[str, Any]:
        return {
            "adapter_type": ADAPTER_TYPE,
            "format_version": FORMAT_VERSION,
            "router_config": self.config.to_dict(),
            "base_fingerprint": self.fingerprint,
            "layout": self.layout.to_dict(),
            "calibration": self.calibration,
            "calibration_metrics": self.calibration_metrics,
            "companions": self.companions,
            # Routers trained on a base with a PEFT adapter (a LoRA) route that model, not the plain base.
            "with_peft_adapter": bool(lora_layers(self.model)),
            **self.training_record(),
            "base_model": self.base_model,
        }

    def training_record(self) -> dict[str, Any]:
        """What training decided about skipping (saved with the adapter and in checkpoints): the removal order and
        the removal counts trained, the per-token skip candidates, whether image positions may skip, where the
        compute target was counted."""
        return {"removal_order": self.removal_order,
                "removal_range": None if self.removal_range is None else list(self.removal_range),
                "skip_candidates": self.skip_candidates, "skip_image_positions": self.skip_image_positions,
                "compute_counted_on": self.compute_counted_on}

    def restore_training_record(self, saved: Mapping[str, Any]) -> None:
        """Set what `training_record` wrote (older files lack some keys: those mean untrained for them)."""
        self.removal_order = saved.get("removal_order")
        removal_range = saved.get("removal_range")
        self.removal_range = None if removal_range is None else (int(removal_range[0]), int(removal_range[1]))
        self.skip_candidates = saved.get("skip_candidates")
        self.skip_image_positions = bool(saved.get("skip_image_positions", True))
        self.compute_counted_on = str(saved.get("compute_counted_on", "text"))

    def save_pretrained(self, directory: str | os.PathLike, *, companions: list[str] | None = None) -> Path:
        """Write `adapter_config.json` + `adapter_model.safetensors` (each replaced atomically). `companions` (files
        the caller writes beside them, relative paths) replaces `self.companions`; None keeps those this folder
        holds."""
        directory = Path(directory)
        # None keeps what the folder loaded from had, where this folder has it too (calibrate in place); a copy
        # saved elsewhere without them must not claim them.
        self.companions = sorted(companions if companions is not None else
                                 [c for c in self.companions if (directory / c).exists()])
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        atomic_write(directory / WEIGHTS_NAME, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
        text = json.dumps(self.adapter_config(), indent=2, sort_keys=True) + "\n"
        atomic_write(directory / CONFIG_NAME, lambda path: Path(path).write_text(text))
        return directory

    @classmethod
    def from_pretrained(cls, model: nn.Module, directory: str | os.PathLike, *, freeze_base: bool = True,
                        base: nn.Module | None = None) -> "RouterAdapter":
        """Attach the adapter saved in `directory` to `model`; a mismatched base is refused before any change.
        `base` (default `model`) is the model checked against the base the adapter was trained on: the unmerged
        base when `model` has the adapter's LoRA merged in and it trained weights the check reads (norms, head)."""
        directory = Path(directory)
        saved = read_adapter_config(directory)
        fingerprint = base_fingerprint(model if base is None else base)
        check_fingerprint(saved["base_fingerprint"], fingerprint, source=str(directory))
        # Routers saved beside a LoRA, given the plain base (no PEFT layers, no LoRA merged into the projections the
        # fingerprint samples): without the LoRA they would route another model, silently.
        if (saved.get("with_peft_adapter") and base is None and not lora_layers(model)
                and not differing_weights(saved["base_fingerprint"].get("projection_samples") or {},
                                          fingerprint.get("projection_samples") or {})):
            raise AdapterMismatchError(
                f"{directory}: these routers were saved on a model with a PEFT adapter (a LoRA), and the model given "
                "is the plain base: without the LoRA they route another model. Load that LoRA onto the model first "
                "(peft.PeftModel.from_pretrained), or load a folder holding both (`lora/` beside the routers, as "
                "RetrofitModule.save_adapter writes it) with vlm_retrofit.release.load_trained. If the model has the "
                "LoRA merged into its weights, pass base= (the unmerged base) to check it against")
        adapter = cls(model, RouterConfig.from_dict(saved["router_config"]))
        check_layout(saved.get("layout"), adapter.layout, source=str(directory))
        adapter.fingerprint = fingerprint  # the unmerged base's where `base` is given
        state = load_file(str(directory / WEIGHTS_NAME))
        expected = adapter.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        wrong_shape = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
        if missing or unexpected or wrong_shape:
            raise AdapterMismatchError(
                f"{directory / WEIGHTS_NAME} does not match its adapter_config.json: missing {missing}, "
                f"unexpected {unexpected}, wrong shape {wrong_shape}"
            )
        adapter.load_state_dict(state)
        adapter.calibration = saved.get("calibration", {})
        adapter.calibration_metrics = saved.get("calibration_metrics", {})
        adapter.companions = list(saved.get("companions") or [])
        adapter.restore_training_record(saved)
        adapter.base_model = saved.get("base_model") or adapter.base_model
        return _finish_attach(model, adapter, freeze_base)


def _finish_attach(model: nn.Module, adapter: RouterAdapter, freeze_base: bool) -> RouterAdapter:
    adapter._attach()
    if freeze_base and not hasattr(model, "peft_config"):
        # A peft model has already frozen its base and marked its own adapters trainable: leave those flags.
        adapter._frozen_by_attach = [p for p in model.parameters() if p.requires_grad]  # `detach` gives them back
        model.requires_grad_(False)
    adapter.requires_grad_(True)
    return adapter


def attach_routers(model: nn.Module, config: RouterConfig | None = None, *, freeze_base: bool = True) -> RouterAdapter:
    """Retrofit depth routers into `model` (a supported HF model, or a `peft` model wrapping one).

    Returns the `RouterAdapter` holding every router parameter. With `freeze_base` the backbone's own
    parameters stop requiring gradients (a `peft` model's trainable flags are left as they are).
    """
    return _finish_attach(model, RouterAdapter(model, config), freeze_base)


def get_adapter(model: nn.Module) -> RouterAdapter | None:
    """The adapter attached to `model`, if any."""
    return _ATTACHED.get(model)


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check an adapter folder's `adapter_config.json`."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"{directory} is not a router adapter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME} "
            "(written by RouterAdapter.save_pretrained)"
        )
    saved = json.loads(path.read_text())
    if saved.get("adapter_type") != ADAPTER_TYPE:
        raise AdapterMismatchError(f"{path} holds adapter_type {saved.get('adapter_type')!r}, not {ADAPTER_TYPE!r}")
    if saved.get("format_version", 0) > FORMAT_VERSION:
        raise AdapterMismatchError(f"{path} was written by a newer vlm_retrofit (format {saved['format_version']})")
    return saved


def check_layout(saved: Mapping[str, Any] | None, layout: BlockLayout, *, source: str) -> None:
    """Refuse routers trained on another block layout than the one they would run with here: the same router
    config gives another one where the backbone's registration differs (`BackboneSpec.never_skip_layers`,
    `feature_injection_layers`), and the routers would then skip blocks they were trained never to skip."""
    if saved is None:  # written before layouts were recorded
        return
    now = layout.to_dict()
    differing = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if differing:
        details = "; ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in differing.items())
        raise AdapterMismatchError(
            f"{source} was trained with another block layout than its router config gives on this backbone "
            f"({details}): the backbone is registered differently here (BackboneSpec.never_skip_layers / "
            "feature_injection_layers). Register it as it was when the routers were trained")


SAMPLE_KEYS = ("weight_samples", "projection_samples")


def check_fingerprint(saved: dict[str, Any], actual: dict[str, Any], *, source: str, projections: bool = False) -> None:
    """Refuse an adapter or checkpoint whose base fingerprint differs from the model's, naming both. With
    `projections`, where the model is the plain base (freshly loaded, a LoRA not merged into it), the samples of
    its projections are compared too: a fine-tune that differs only there (a merged LoRA) is another base."""
    saved_structure, structure = ({k: v for k, v in f.items() if k not in SAMPLE_KEYS} for f in (saved, actual))
    if saved_structure == structure:
        # Fingerprints written before weights were sampled have no samples: their structure is all there is.
        differing = differing_weights(saved.get("weight_samples") or {}, actual.get("weight_samples") or {})
        if projections:
            differing += differing_weights(saved.get("projection_samples") or {}, actual.get("projection_samples") or {})
        if not differing:
            return
        raise AdapterMismatchError(
            f"{source} was made for a base of the same architecture ({saved.get('model_type')}, "
            f"{saved.get('num_layers')} layers, hidden {saved.get('hidden_size')}) but other weights: the values it "
            f"recorded from {', '.join(differing)} differ from the given model's (another checkpoint, e.g. the base "
            "instead of the instruct model, or a fine-tune). Load the base it was trained on.")
    differing = {k: (saved.get(k), actual.get(k)) for k in sorted(set(saved_structure) | set(structure))
                 if saved.get(k) != actual.get(k)}
    details = "; ".join(f"{k}: saved {a!r} vs model {b!r}" for k, (a, b) in differing.items())
    raise AdapterMismatchError(
        f"{source} was made for a different base model ({saved.get('model_type')}, {saved.get('num_layers')} layers, "
        f"hidden {saved.get('hidden_size')}) than the one given ({actual.get('model_type')}, "
        f"{actual.get('num_layers')} layers, hidden {actual.get('hidden_size')}). Differences: {details}. "
        "Load the base it was trained on."
    )
