"""Filling a config's "auto" values from the model and the training arguments, as Hugging Face does.

Follows transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize``:
an argument replaces "auto"; an argument given for a key the config writes out must agree with it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from offload.config.parse import AUTO, AUTO_ARGUMENTS, OWN_AUTO_KEYS, read_config

_MISSING = object()


class AutoSources:
    """Where the user gives each `resolve_auto` argument, for the messages: ``resolve_auto``'s own keyword
    arguments by default; an integration names its framework's settings instead (``hints`` says how to
    set one, ``names`` what it is called there, both keyed by the resolve_auto argument)."""

    def __init__(self, hints: Mapping[str, str] | None = None, names: Mapping[str, str] | None = None) -> None:
        self.hints, self.names = dict(hints or {}), dict(names or {})

    def hint(self, argument: str) -> str:
        """How to give ``argument`` a value: "pass lr=... to resolve_auto" by default."""
        return self.hints.get(argument, f"pass {argument}=... to resolve_auto")

    def given(self, argument: str, value: Any) -> str:
        """``argument`` as given with ``value``: "lr=5e-05" by default; a name with "{}" is a template for
        the value ("TrainingArguments(learning_rate={})")."""
        name = self.names.get(argument, argument)
        return name.format(repr(value)) if "{}" in name else f"{name}={value!r}"


def _fill(config: dict[str, Any], key: str, value: Any, *, must_match: bool = True, if_missing: bool = False,
          sources: AutoSources = AutoSources()) -> None:
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
            raise ValueError(f'{key}: "auto" needs a value; {sources.hint(argument)} or write a value')
        node[name] = value
    elif must_match and value is not None and not _same(current, value):
        raise ValueError(
            f'{key}: the config says {current!r} but {sources.given(argument, value)}; make them agree or set the key '
            f'to "auto"'
        )


def _same(written: Any, value: Any) -> bool:
    if isinstance(written, (list, tuple)) and isinstance(value, (list, tuple)):
        return list(written) == list(value)
    return written == value and isinstance(written, bool) == isinstance(value, bool)


def unresolved_auto_error(config: Mapping[str, Any]) -> ValueError | None:
    """The error for a config that reaches the engine with "auto" values `resolve_auto` fills: it names the
    first such key (top-level keys first) and the one call that fills them all, with every argument needed;
    None when there are none."""
    found: list[str] = []
    level: list[tuple[str, Any]] = [("", config)]
    while level:  # breadth first: top-level keys are named before nested ones
        nested: list[tuple[str, Any]] = []
        for prefix, node in level:
            for name, value in node.items():
                key = f"{prefix}.{name}" if prefix else name
                if isinstance(value, Mapping):
                    nested.append((key, value))
                elif isinstance(value, str) and value == AUTO and key in AUTO_ARGUMENTS:
                    found.append(key)
        level = nested
    if not found:
        return None
    arguments = list(dict.fromkeys(AUTO_ARGUMENTS[key] for key in found if AUTO_ARGUMENTS[key]))
    call = ", ".join(["config", *(f"{argument}=..." for argument in arguments)])
    count = f'its {len(found)} "auto" values' if len(found) > 1 else "it"
    return ValueError(f'{found[0]}: "auto" is not resolved; call offload.resolve_auto({call}) first, which fills '
                      f"{count}, or write the values")


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
    sources: AutoSources | None = None,
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
    config leaves out; other arguments only fill "auto". ``sources`` words the messages for an integration
    (which of its settings gives each argument).

    Raises ValueError naming the key when an "auto" value has no argument to fill it, when a written
    value disagrees with the argument given for it, or when hidden_size is not a positive integer.
    """
    out = read_config(config)
    sources = sources or AutoSources()
    if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
                                    or hidden_size < 1):
        raise ValueError(f"hidden_size: {hidden_size!r} is not allowed; pass the model's hidden size, an integer >= 1")

    _fill(out, "train_micro_batch_size_per_gpu", micro_batch_size, if_missing=True, sources=sources)
    _fill(out, "gradient_accumulation_steps", gradient_accumulation_steps, if_missing=True, sources=sources)
    if isinstance(out.get("train_batch_size"), str) and out["train_batch_size"] == AUTO:
        if "train_micro_batch_size_per_gpu" not in out:
            raise ValueError(
                'train_batch_size: "auto" is micro batch x accumulation steps x world size; '
                f'{sources.hint("micro_batch_size")} or write train_micro_batch_size_per_gpu'
            )
        del out["train_batch_size"]  # EngineConfig.from_dict derives it from the other two and the world size
    _fill(out, "gradient_clipping", max_grad_norm, sources=sources)
    for section, enabled in (("fp16", fp16), ("bfloat16" if "bfloat16" in out else "bf16", bf16)):
        if enabled and section not in out:
            out[section] = {}  # the argument asks for this precision and the config is silent about it
        _fill(out, f"{section}.enabled", enabled, if_missing=True, sources=sources)
    _fill(out, "optimizer.params.lr", lr, sources=sources)
    _fill(out, "optimizer.params.betas", None if betas is None else list(betas), sources=sources)
    _fill(out, "optimizer.params.eps", eps, sources=sources)
    _fill(out, "optimizer.params.weight_decay", weight_decay, sources=sources)
    _fill(out, "scheduler.params.warmup_min_lr", 0, must_match=False)  # not a training argument
    _fill(out, "scheduler.params.warmup_max_lr", lr, sources=sources)
    _fill(out, "scheduler.params.warmup_num_steps", warmup_steps, sources=sources)
    _fill(out, "scheduler.params.total_num_steps", total_steps, sources=sources)
    h = hidden_size
    # Hugging Face fills these from the model only where they say "auto" and never checks written values.
    _fill(out, "zero_optimization.reduce_bucket_size", None if h is None else h * h, must_match=False, sources=sources)
    _fill(out, "zero_optimization.stage3_prefetch_bucket_size", None if h is None else int(0.9 * h * h),
          must_match=False, sources=sources)
    _fill(out, "zero_optimization.stage3_param_persistence_threshold", None if h is None else 10 * h,
          must_match=False, sources=sources)

    leftover = _leftover_auto(out)
    if leftover is not None:
        raise ValueError(f'{leftover}: "auto" is not supported for this key; write a value')
    return out
