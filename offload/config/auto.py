"""Filling a config's "auto" values from the model and the training arguments, as Hugging Face does.

Follows transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize``:
an argument replaces "auto"; an argument given for a key the config writes out must agree with it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from offload.config.parse import AUTO, AUTO_ARGUMENTS, OWN_AUTO_KEYS, read_config

_MISSING = object()


def _fill(config: dict[str, Any], key: str, value: Any, *, must_match: bool = True, if_missing: bool = False) -> None:
    # Walk to the key's parent; a missing or malformed section is left for EngineConfig.from_dict to judge.
    *parents, name = key.split(".")
    node: Any = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return
    current = node.get(name, _MISSING)
    argument = AUTO_ARGUMENTS[key]
    if current is _MISSING:
        if if_missing and value is not None:
            node[name] = value
    elif isinstance(current, str) and current == AUTO:
        if value is None:
            raise ValueError(f'{key}: "auto" needs a value; pass {argument}=... to resolve_auto or write a value')
        node[name] = value
    elif must_match and value is not None and not _same(current, value):
        raise ValueError(
            f'{key}: the config says {current!r} but {argument}={value!r}; make them agree or set the key to "auto"'
        )


def _same(written: Any, value: Any) -> bool:
    if isinstance(written, (list, tuple)) and isinstance(value, (list, tuple)):
        return list(written) == list(value)
    return written == value and isinstance(written, bool) == isinstance(value, bool)


def _leftover_auto(node: Any, key: str = "") -> str | None:
    if key in OWN_AUTO_KEYS:
        return None
    if isinstance(node, dict):
        for name, value in node.items():
            found = _leftover_auto(value, f"{key}.{name}" if key else name)
            if found is not None:
                return found
    elif isinstance(node, str) and node == AUTO:
        return key
    return None


def resolve_auto(
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    hidden_size: int | None = None,
    lr: float | None = None,
    betas: Sequence[float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
    max_grad_norm: float | None = None,
    fp16: bool | None = None,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Return a copy of ``config`` (a mapping or a JSON file path) with its "auto" values filled in.

    Each argument fills the keys Hugging Face's Trainer fills from it: ``micro_batch_size`` (the data
    loader's batch size per rank) -> train_micro_batch_size_per_gpu; ``gradient_accumulation_steps``;
    train_batch_size "auto" is left to EngineConfig.from_dict to compute as micro x accumulation x world
    size; ``max_grad_norm`` -> gradient_clipping; ``fp16``/``bf16`` -> fp16.enabled / bf16.enabled;
    ``lr``, ``betas``, ``eps``, ``weight_decay`` -> optimizer.params; ``lr`` -> scheduler warmup_max_lr,
    warmup_min_lr "auto" -> 0, ``warmup_steps`` -> warmup_num_steps, ``total_steps`` -> total_num_steps;
    ``hidden_size`` h -> reduce_bucket_size h*h, stage3_prefetch_bucket_size int(0.9*h*h),
    stage3_param_persistence_threshold 10*h. The two batch arguments also fill their keys when the config
    leaves them out (the data loader decides the batch), and ``fp16``/``bf16`` true enable a precision the
    config leaves out; other arguments only fill "auto".

    Raises ValueError naming the key when an "auto" value has no argument to fill it, when a written
    value disagrees with the argument given for it, or when hidden_size is not a positive integer.
    """
    out = read_config(config)
    if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
                                    or hidden_size < 1):
        raise ValueError(f"hidden_size: {hidden_size!r} is not allowed; pass the model's hidden size, an integer >= 1")

    _fill(out, "train_micro_batch_size_per_gpu", micro_batch_size, if_missing=True)
    _fill(out, "gradient_accumulation_steps", gradient_accumulation_steps, if_missing=True)
    if isinstance(out.get("train_batch_size"), str) and out["train_batch_size"] == AUTO:
        if "train_micro_batch_size_per_gpu" not in out:
            raise ValueError(
                'train_batch_size: "auto" is micro batch x accumulation steps x world size; pass micro_batch_size=... '
                "to resolve_auto or write train_micro_batch_size_per_gpu"
            )
        del out["train_batch_size"]  # EngineConfig.from_dict derives it from the other two and the world size
    _fill(out, "gradient_clipping", max_grad_norm)
    for section, enabled in (("fp16", fp16), ("bfloat16" if "bfloat16" in out else "bf16", bf16)):
        if enabled and section not in out:
            out[section] = {}  # the argument asks for this precision and the config is silent about it
        _fill(out, f"{section}.enabled", enabled, if_missing=True)
    _fill(out, "optimizer.params.lr", lr)
    _fill(out, "optimizer.params.betas", None if betas is None else list(betas))
    _fill(out, "optimizer.params.eps", eps)
    _fill(out, "optimizer.params.weight_decay", weight_decay)
    _fill(out, "scheduler.params.warmup_min_lr", 0, must_match=False)  # not a training argument
    _fill(out, "scheduler.params.warmup_max_lr", lr)
    _fill(out, "scheduler.params.warmup_num_steps", warmup_steps)
    _fill(out, "scheduler.params.total_num_steps", total_steps)
    h = hidden_size
    # Hugging Face fills these from the model only where they say "auto" and never checks written values.
    _fill(out, "zero_optimization.reduce_bucket_size", None if h is None else h * h, must_match=False)
    _fill(out, "zero_optimization.stage3_prefetch_bucket_size", None if h is None else int(0.9 * h * h),
          must_match=False)
    _fill(out, "zero_optimization.stage3_param_persistence_threshold", None if h is None else 10 * h,
          must_match=False)

    leftover = _leftover_auto(out)
    if leftover is not None:
        raise ValueError(f'{leftover}: "auto" is not supported for this key; write a value')
    return out
