"""Call-time routing hooks on module instances, without nn.Module's hook dispatch."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

EntryHook = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
"""A forward pre-hook's signature (`with_kwargs=True`): the module and its call's arguments -> replacement
(args, kwargs), or None to leave them."""

_HOOK = "_vlm_retrofit_entry_hook"
_PLAIN = "_vlm_retrofit_plain_class"
_ENTRY_CLASSES: dict[type, type] = {}


def _entry_class(cls: type) -> type:
    """`cls` whose calls first run the instance's entry hook: a subclass of the same name, made once per class.

    A forward pre-hook puts nn.Module's general call path (hook dicts walked, results checked, forward hooks looked
    for) in front of every call of its module. Between the layers of a decoding step that path is cold: on SmolLM2 it
    cost ~7 us per hooked layer per token, ~0.7 % of a batch-1 decoding step at one router per layer. Here the call
    runs the hook, then the class's own `__call__` (the fast path where the module has no hooks of its own); the
    hook runs before any forward pre-hook and any instance `forward` (a skip context's), as a pre-hook registered
    first did."""
    entry = _ENTRY_CLASSES.get(cls)
    if entry is None:
        plain_call = cls.__call__

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            replaced = self.__dict__[_HOOK](self, args, kwargs)
            if replaced is not None:
                args, kwargs = replaced
            return plain_call(self, *args, **kwargs)

        entry = type(cls)(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                  "__qualname__": cls.__qualname__, _PLAIN: cls})
        _ENTRY_CLASSES[cls] = entry
    return entry


def install(module: nn.Module, hook: EntryHook) -> None:
    """Run `hook` at the start of every call of `module` (this instance only)."""
    if has_entry(module):
        raise RuntimeError(f"{type(module).__name__} already has a routing entry hook; remove it first")
    module.__dict__[_HOOK] = hook
    module.__class__ = _entry_class(type(module))


def remove(module: nn.Module) -> None:
    """Take `module`'s entry hook off: its own class again. Nothing happens where it has none."""
    if has_entry(module):
        module.__class__ = getattr(type(module), _PLAIN)
        del module.__dict__[_HOOK]


def has_entry(module: nn.Module) -> bool:
    return _HOOK in module.__dict__


def entry_hook(module: nn.Module) -> EntryHook:
    """The hook `install` put on `module`."""
    return module.__dict__[_HOOK]


def replace_hook(module: nn.Module, hook: EntryHook) -> None:
    """Swap `module`'s entry hook for `hook` in place (e.g. a timed copy of it)."""
    if not has_entry(module):
        raise RuntimeError(f"{type(module).__name__} has no routing entry hook")
    module.__dict__[_HOOK] = hook
