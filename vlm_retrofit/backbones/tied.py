"""Tied weights (a head that is the embedding matrix) kept apart where a merged adapter trained only one of them."""

from __future__ import annotations

from collections import defaultdict

from torch import nn


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name of `model` -> every name of the same tensor (one name unless weights are tied, e.g.
    `lm_head.weight` and the input embeddings of a model with `tie_word_embeddings`)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return {name: group for group in names.values() for name in group}


def with_tied_partners(model: nn.Module, names: list[str]) -> list[str]:
    """`names` and every other name of the same tensors: a merge that changed one changed them all."""
    groups = tied_names(model)
    return sorted({partner for name in names for partner in groups.get(name, [name])})


def untie(model: nn.Module, names: set[str] | list[str]) -> None:
    """Give each parameter in `names` that is tied to one outside `names` its own copy.

    Loading a trained head (a `modules_to_save` copy of `lm_head`) into a base whose head *is* its embedding
    matrix would otherwise write the embeddings too: the trained model had a head of its own and the base's
    embeddings."""
    names = set(names)
    for name, group in tied_names(model).items():
        if name in names and any(other not in names for other in group):
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            shared = getattr(module, attribute)
            setattr(module, attribute, nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad))
    record_untied_embeddings(model)


def record_untied_embeddings(model: nn.Module) -> None:
    """Set `tie_word_embeddings` false in `model`'s configs where its head and input embeddings are no longer one
    tensor. Saved with the tie still on, the two would load as one again (transformers ties them unless both
    are saved and differ, and then it warns)."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is inputs.weight:
        return
    config = model.config
    for each in {id(c): c for c in (config, config.get_text_config())}.values():
        if getattr(each, "tie_word_embeddings", False):
            each.tie_word_embeddings = False
