"""Reading a DeepSpeed-style JSON config and checking its values, each error naming the dotted key."""

from __future__ import annotations

import copy
import difflib
import errno
import json
import math
import os
from dataclasses import fields
from typing import Any, Collection, Mapping

AUTO = "auto"

OWN_AUTO_KEYS = ("compute_device", "zero_optimization.offload_param.max_in_cpu")
"""Keys whose "auto" is a choice of their own (CUDA where available; as many elements as the host's
available memory holds), not DeepSpeed's placeholder: accepted and left as written."""

# The `resolve_auto` argument that fills each key Hugging Face's integration lets users write as "auto"
# ("" for a key resolve_auto fills without one).
AUTO_ARGUMENTS = {
    "train_batch_size": "micro_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "bfloat16.enabled": "bf16",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "",
    "scheduler.params.warmup_max_lr": "lr",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "total_steps",
    "zero_optimization.reduce_bucket_size": "hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "hidden_size",
}


def read_config(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Return a deep copy of a config given as a mapping, or the JSON object read from a file path.

    Raises ValueError naming the type received for anything else (a list, a number, bytes, ...);
    FileNotFoundError, IsADirectoryError, PermissionError (OSError) naming the path for a file that
    cannot be read; ValueError naming the path for invalid JSON, text that is not UTF-8, or a top
    level that is not a JSON object.
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str):
        raise ValueError(
            f"config: expected a dict or the path (str or os.PathLike) of a DeepSpeed-format JSON file, got "
            f"{_describe(source)}"
        )
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        where = path if os.path.isabs(path) else f"{path} (in {os.getcwd()})"
        reason = {errno.ENOENT: "does not exist", errno.EISDIR: "is a directory, not a JSON file",
                  errno.EACCES: "is not readable by this process"}.get(exc.errno, exc.strerror or str(exc))
        raise type(exc)(exc.errno, f"config file {where} {reason}; pass the path of a DeepSpeed-format JSON "
                                   f"config or a dict") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); is it a JSON config?") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top, got {type(data).__name__}")
    return data


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def auto_error(key: str) -> ValueError:
    """The error for an "auto" value that reached a dataclass unresolved."""
    argument = AUTO_ARGUMENTS.get(key)
    if argument is None:
        return ValueError(f'{key}: "auto" is not supported for this key; write a value')
    call = f"resolve_auto(config, {argument}=...)" if argument else "resolve_auto(config)"
    return ValueError(f'{key}: "auto" is not resolved; call offload.{call} first')


def did_you_mean(name: str, known: Collection[str]) -> str:
    """"; did you mean X?" naming the entry of ``known`` closest to ``name`` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def section_values(section: Any, key: str, allowed: Collection[str], *,
                   auto_is_a_value: Collection[str] = ()) -> dict[str, Any]:
    """Return a copy of the JSON object at dotted ``key``, refusing keys not in ``allowed`` and "auto" values
    (except for the keys of ``auto_is_a_value``, whose "auto" is a choice of their own, not DeepSpeed's
    placeholder)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{key or 'config'}: expected a JSON object, got {section!r} ({type(section).__name__})")
    for name, value in section.items():
        dotted = f"{key}.{name}" if key else name
        if name not in allowed:
            raise ValueError(f"{dotted}: unknown key; allowed keys are {', '.join(sorted(allowed))}"
                             f"{did_you_mean(name, allowed)}")
        if isinstance(value, str) and value == AUTO and name not in auto_is_a_value and dotted not in OWN_AUTO_KEYS:
            raise auto_error(dotted)
    return dict(section)


def build(cls: Any, section: Any, key: str | None = None) -> Any:
    """Build dataclass ``cls`` from the JSON object at dotted ``key`` (default ``cls._KEY``), fields as keys."""
    return cls(**section_values(section, cls._KEY if key is None else key, {f.name for f in fields(cls) if f.init}))


def renamed(written: str, canonical: str, error: ValueError) -> ValueError:
    """``error`` with its leading dotted key ``canonical`` replaced by the key as the user ``written`` it."""
    message = str(error)
    if message.startswith(canonical) and written != canonical:
        return ValueError(written + message[len(canonical):])
    return error


def integral(key: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, accepting integral floats such as 1e8 as JSON configs spell them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{key}: expected an integer, got {value!r}; write a whole number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}: {value!r} is not allowed; use an integer >= {minimum}")
    return int(value)


def number(key: str, value: Any, *, minimum: float | None = None, maximum: float | None = None) -> float:
    """Return ``value`` as a finite float within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f">= {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        raise ValueError(f"{key}: {value!r} is not allowed; use a number {' and '.join(filter(None, (low, high)))}")
    return float(value)


def boolean(key: str, value: Any) -> bool:
    """Return ``value`` if it is a JSON boolean."""
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r} ({type(value).__name__})")
    return value


def choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of the ``allowed`` strings."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{key}: {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")
    return value
