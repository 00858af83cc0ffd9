"""Which checkpoint tensors make each parameter: transformers' own conversion of names and layouts.

Checkpoints on disk name and lay out tensors as their model family always did, and transformers 5 converts
them while loading (``transformers.conversion_mapping``): renames (GPT-NeoX's ``embed_out`` is ``lm_head``,
Mixtral's ``block_sparse_moe`` is ``mlp``) and fusions (every expert's ``w1`` and ``w3`` stacked and
concatenated into one ``experts.gate_up_proj``). `CheckpointNames` applies the same rules, from
transformers' public mapping for the model (`get_model_conversion_mapping`, and its `rename_source_key`,
which also adds or strips the base model's prefix), to the checkpoint's tensor names only: nothing is read.
A parameter is then either one checkpoint tensor (`ParamSource` with ``conversion`` None) or assembled
from several (`Conversion`), by transformers' own operations run on the tensors as read (a copy of those
bytes in memory; the checkpoint stays as it is on the disk).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["CheckpointNames", "Conversion", "ParamSource"]


@dataclass(frozen=True, eq=False)
class Conversion:
    """Several checkpoint tensors turned into one or more parameters by a transformers ``WeightConverter``:
    ``sources`` maps each of its source patterns (in its order) to the checkpoint keys that matched it (in
    natural order: expert 0, 1, ..., 10)."""

    converter: object
    """The transformers ``WeightConverter`` (its ``operations`` and patterns)."""
    layer: str
    """The first target key, as transformers' loading names the group."""
    sources: dict[str, tuple[str, ...]]
    model: nn.Module | None = None
    """The model whose parameters it makes: converters that split by the parameters' sizes read them."""

    @property
    def tensors(self) -> tuple[str, ...]:
        """Every checkpoint key it reads, in order."""
        return tuple(key for keys in self.sources.values() for key in keys)

    def run(self, tensors: Mapping[str, torch.Tensor], model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The parameters it makes (full model keys -> tensors) from the checkpoint's ``tensors`` (views as
        read, or meta tensors for their shapes), by the converter's operations in order. Over one expert
        (each source one tensor) whose first operation stacks along dim 0, that stack of one is a view of
        it (transformers' ``MergeModulelist`` passes a tensor through): one copy fewer."""
        converter = self.converter
        first = converter.operations[0] if converter.operations else None
        if (type(first).__name__ == "MergeModulelist" and getattr(first, "dim", None) == 0
                and all(len(keys) == 1 for keys in self.sources.values())):
            collected: dict = {pattern: tensors[keys[0]].unsqueeze(0) for pattern, keys in self.sources.items()}
        else:
            collected = {pattern: [tensors[key] for key in keys] for pattern, keys in self.sources.items()}
        model = model if model is not None else self.model
        config = getattr(model, "config", None)
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=converter.source_patterns,
                                   target_patterns=converter.target_patterns, full_layer_name=self.layer,
                                   model=model, config=config, missing_keys=None)
        full = self.layer.replace("*.", "0.") if "*." in self.layer else self.layer
        for short in collected:  # targets come back as patterns: give them the layer's prefix and suffix
            if short in full:
                prefix, _, suffix = full.partition(short)
                return {prefix + key + suffix: value for key, value in collected.items()}
        return dict(collected)


@dataclass(frozen=True)
class ParamSource:
    """Where one parameter comes from: checkpoint tensor ``tensor``, or ``conversion`` (then ``tensor`` is
    the model key the conversion makes for it)."""

    tensor: str
    conversion: Conversion | None = None

    @property
    def tensors(self) -> tuple[str, ...]:
        """The checkpoint keys it reads."""
        return (self.tensor,) if self.conversion is None else self.conversion.tensors


class CheckpointNames:
    """The checkpoint's tensor names as the model's parameter and buffer keys (see the module docstring)."""

    def __init__(self, module: nn.Module, shapes: Mapping[str, Sequence[int]]) -> None:
        """``shapes``: the checkpoint's tensors (key -> shape)."""
        self.module = module
        renamings, converters = _transforms(module)
        prefix = getattr(module, "base_model_prefix", "") or None
        meta = {name: True for name, _ in module.named_parameters(remove_duplicate=False)}
        meta.update((name, True) for name, _ in module.named_buffers())
        self.direct: dict[str, str] = {}
        """Model key -> the one checkpoint tensor it is read from."""
        self.converted: dict[str, Conversion] = {}
        """Model key -> the conversion that makes it."""
        groups: dict[tuple[int, str], dict[str, list[str]]] = {}
        converter_of: dict[tuple[int, str], object] = {}
        for key in shapes:
            target, pattern = _rename(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:  # as transformers loads: a model key as it is is not renamed
                target, pattern = _with_prefix(key, prefix, meta), None  # (DeepSeek-V4's `.norm.` -> `.kv_norm.`)
            if pattern is None:
                self.direct.setdefault(target, key)
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            group = (id(converter), target)
            converter_of[group] = converter
            groups.setdefault(group, {p: [] for p in converter.source_patterns})[pattern].append(key)
        for group, sources in groups.items():
            converter, target = converter_of[group], group[1]
            conversion = Conversion(converter, target, {p: tuple(sorted(k, key=_natural)) for p, k in sources.items() if k},
                                    module)
            for made in _made_keys(conversion, shapes, module):
                self.converted[made] = conversion

    def source(self, name: str) -> ParamSource | None:
        """Where model key ``name`` comes from, or None when the checkpoint has nothing for it."""
        if name in self.converted:
            return ParamSource(name, self.converted[name])
        key = self.direct.get(name)
        return ParamSource(key) if key is not None else None

    def buffer_key(self, name: str) -> str | None:
        """The checkpoint tensor of buffer ``name`` (persistent buffers saved with the model), or None."""
        return self.direct.get(name)


def _transforms(module: nn.Module) -> tuple[list, list]:
    """transformers' renamings and converters for ``module`` (fresh copies: matching marks them used)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers without conversions: checkpoint names are the model's
        return [], []
    if not hasattr(module, "config") or not hasattr(module, "base_model_prefix"):
        return [], []
    transforms = [copy.deepcopy(t) for t in get_model_conversion_mapping(module)]
    return ([t for t in transforms if not isinstance(t, WeightConverter)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _rename(key: str, renamings: list, converters: list, prefix: str | None,
            meta: Mapping[str, bool]) -> tuple[str, str | None]:
    if not renamings and not converters:
        return _with_prefix(key, prefix, meta), None
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, prefix, meta)


def _with_prefix(key: str, prefix: str | None, meta: Mapping[str, bool]) -> str:
    """``key`` with the base model's prefix added or removed where the model's keys need it."""
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in meta:
        return key[len(prefix) + 1:]
    if prefix and f"{prefix}.{key}" in meta:
        return f"{prefix}.{key}"
    return key


def _made_keys(conversion: Conversion, shapes: Mapping[str, Sequence[int]], module: nn.Module) -> list[str]:
    """The model keys ``conversion`` makes: its first target, and for a one-to-many converter the others
    (their names from a run on meta tensors of the sources' shapes)."""
    if len(getattr(conversion.converter, "target_patterns", [])) <= 1:
        return [conversion.layer]
    meta = {key: torch.empty(tuple(shapes[key]), device="meta") for key in conversion.tensors}
    return list(conversion.run(meta, module))


def _natural(key: str) -> list:
    """Sort key for dotted names with numbers: expert 2 before expert 10."""
    return [int(part) if part.isdigit() else part for part in key.split(".")]
