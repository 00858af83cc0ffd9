"""The DeepSpeed config a trainer hands the engine: "auto" values filled from the trainer's own settings,
and the checks every integration's constructor makes on its keyword arguments."""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Collection, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload.config import EngineConfig, resolve_auto
from offload.config.auto import AutoSources
from offload.config.parse import AUTO, AUTO_ARGUMENTS, read_config

__all__ = ["AutoSources", "cast_floating", "check_keywords", "half_dtype", "hidden_size", "optimizer_hyperparameters",
           "read_argument", "trainer_config"]


def hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size as Hugging Face's Trainer reads it for the bucket sizes (``config.hidden_size``,
    else the largest of ``config.hidden_sizes``) of the model or, for a wrapper such as a LightningModule,
    of the first submodule that has such a config; None when none has."""
    for module in model.modules():
        config = getattr(module, "config", None)
        size = getattr(config, "hidden_size", None)
        if size is None and getattr(config, "hidden_sizes", None):
            size = max(config.hidden_sizes)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def half_dtype(config: EngineConfig) -> torch.dtype | None:
    """The 16-bit dtype an engine built from ``config`` trains in (``fp16`` / ``bf16`` enabled), else None."""
    return torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None


def cast_floating(data: Any, dtype: torch.dtype | None) -> Any:
    """``data`` (a tensor, or lists, tuples and dicts of them) with its floating-point tensors cast to
    ``dtype``, as Lightning's DeepSpeed precision (``convert_input``) and transformers' Trainer under
    DeepSpeed (``_prepare_input``) cast a batch for 16-bit weights; integer tensors (token ids) and
    other values are left as they are. ``dtype`` None returns ``data`` unchanged."""
    if dtype is None:
        return data
    return tree_map(lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
                    else leaf, data)


def optimizer_hyperparameters(optimizer: Any) -> dict[str, Any]:
    """The lr, betas, eps and weight_decay of ``optimizer``'s first param group (a torch optimizer) or of
    Accelerate's ``DummyOptim`` (its lr, weight_decay and keyword arguments), those it has."""
    if optimizer is None:
        return {}
    if hasattr(optimizer, "param_groups") and optimizer.param_groups:
        group = optimizer.param_groups[0]
    else:
        group = {"lr": getattr(optimizer, "lr", None), "weight_decay": getattr(optimizer, "weight_decay", None),
                 **(getattr(optimizer, "kwargs", None) or {})}
    out = {name: group.get(name) for name in ("lr", "betas", "eps", "weight_decay")}
    if out["betas"] is not None:
        out["betas"] = tuple(float(b) for b in out["betas"])
    return {name: value for name, value in out.items() if value is not None}


def trainer_config(config: Mapping[str, Any] | str | os.PathLike, *, model: nn.Module, micro_batch_size: int | None,
                   gradient_accumulation_steps: int, max_grad_norm: float | None, lr: float | None = None,
                   betas: tuple[float, float] | None = None, eps: float | None = None,
                   weight_decay: float | None = None, warmup_steps: int | None = None,
                   total_steps: int | None = None, fp16: bool | None = None, bf16: bool | None = None,
                   auto_only: Collection[str] = (), sources: AutoSources | None = None) -> dict[str, Any]:
    """A copy of ``config`` (dict or JSON path) ready for `offload.initialize`: "auto" values filled as
    Hugging Face's ``HfTrainerDeepSpeedConfig`` fills them from the trainer's arguments (`resolve_auto`).

    Differences, on purpose: a config without ``gradient_clipping`` gets the trainer's ``max_grad_norm``
    when one is given (DeepSpeed's own default, 1.0, would ignore what the trainer asked for); with
    ``max_grad_norm`` None the engine's default applies, DeepSpeed's 1.0. The arguments
    named in ``auto_only`` (Lightning's and Accelerate's optimizer, schedule and precision, as their
    DeepSpeed integrations treat them) only fill "auto": a value the config writes out is kept, except
    that ``fp16``/``bf16`` true still enable a precision the config leaves out or contradicts.
    ``sources`` words the errors in the framework's own terms.
    Raises ValueError naming the key for an "auto" value nothing fills or a value the arguments contradict.
    """
    raw = read_config(config)
    if "gradient_clipping" not in raw and max_grad_norm is not None:
        raw["gradient_clipping"] = max_grad_norm
    arguments = {"lr": lr, "betas": None if betas is None else list(betas), "eps": eps, "weight_decay": weight_decay,
                 "warmup_steps": warmup_steps, "total_steps": total_steps, "fp16": fp16, "bf16": bf16}
    for argument in auto_only:
        value = arguments[argument]
        if value is None:
            continue  # "auto" stays, and resolve_auto says what would fill it
        for key, fills in AUTO_ARGUMENTS.items():
            if fills == argument:
                _replace_auto(raw, key, value)
        arguments[argument] = value if argument in ("fp16", "bf16") and value else None
    return resolve_auto(raw, micro_batch_size=micro_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                        hidden_size=hidden_size(model), max_grad_norm=max_grad_norm, sources=sources, **arguments)


def _replace_auto(config: dict[str, Any], key: str, value: Any) -> None:
    *parents, name = key.split(".")
    node: Any = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    if isinstance(node, dict) and isinstance(node.get(name), str) and node[name] == AUTO:
        node[name] = value


def read_argument(argument: str, config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """`read_config` of a constructor's config argument, checked at once as far as it can be before the
    trainer fills its "auto" values (keys, types, ranges: `EngineConfig.from_dict` without the "auto"
    keys and the batch sizes, which depend on the run). Errors are prefixed with ``argument`` (such as
    "OffloadTrainer(offload_config=...)"). Raises what read_config and EngineConfig.from_dict raise."""
    try:
        raw = read_config(config)
        with warnings.catch_warnings():  # said once, when the engine starts
            warnings.simplefilter("ignore")
            EngineConfig.from_dict(_without_auto(raw), world_size=1)
    except OSError as exc:
        raise type(exc)(exc.errno, f"{argument}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"{argument}: {exc}") from None
    return raw


_PLACEHOLDERS = {"gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": False, "bfloat16.enabled": False,
                 "optimizer.params.lr": 1e-3, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
                 "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
                 "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": 1,
                 "scheduler.params.total_num_steps": 2, "zero_optimization.reduce_bucket_size": 1,
                 "zero_optimization.stage3_prefetch_bucket_size": 1,
                 "zero_optimization.stage3_param_persistence_threshold": 1}
"""A valid value in place of each "auto" a trainer fills, to check the rest of a config before it does."""


def _without_auto(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``node`` with placeholders for the "auto" values a trainer fills, and without the batch sizes."""
    out: dict[str, Any] = {}
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else name
        if key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            continue
        if isinstance(value, Mapping):
            out[name] = _without_auto(value, key)
        else:
            auto = isinstance(value, str) and value == AUTO and key in _PLACEHOLDERS
            out[name] = _PLACEHOLDERS[key] if auto else value
    return out


def check_keywords(owner: str, given: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse keyword arguments ``owner`` does not take, naming the closest one it does (difflib).

    Raises TypeError, as Python does for an unexpected keyword argument, with the suggestion.
    """
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}=?" if close else f"; it takes {', '.join(sorted(known))}"
        raise TypeError(f"{owner}: unexpected keyword argument {name}={given[name]!r}{hint}")
