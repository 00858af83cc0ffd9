"""The `aio` section in the user's config files: read it, write it alone, or merge it into a whole config.

A whole config (DeepSpeed's training config, or an inference config) keeps every other key when the
tuned section is merged into it: the section is set where the file already has one (top level, or
inside ``zero_optimization`` as the Transformers guide prints it), else added at the top level,
where both the training and the inference engines read it. Only the tuned keys are set; others in
the section (``verify``, ``use_gds``) stay. A backup of the file is written first. A file that
holds more than an ``aio`` section is never replaced by one (`check_config_out`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from tensorio import AioConfig

__all__ = ["TUNED_KEYS", "check_config_out", "check_merge_target", "merge_aio", "merge_into", "read_aio_config",
           "read_json_object", "write_aio_config"]

TUNED_KEYS = ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "backend", "direct")
"""The keys a sweep measures and therefore sets; the rest of an ``aio`` section is left as it is."""

#: Names an aio section may hold (AioConfig's fields and the DeepSpeed spellings it accepts).
_AIO_NAMES = frozenset(f.name for f in fields(AioConfig)) | {"intra_op_parallelism", "use_gds"}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, keys in file order.

    Raises FileNotFoundError, and ValueError naming the file for bad JSON, a value that is not an
    object, or a key given twice in one object (loading would silently keep only the last).
    """
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{path}: key {key!r} is given twice in one object; keep one")
            seen[key] = value
        return seen

    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _where(data: Mapping[str, Any]) -> str | None:
    """Where ``data`` keeps its aio section: "aio", "zero_optimization.aio", "bare" (the file is the
    section) or None."""
    zero = data.get("zero_optimization")
    if "aio" in data:
        return "aio"
    if isinstance(zero, Mapping) and "aio" in zero:
        return "zero_optimization.aio"
    if set(data) & _AIO_NAMES and not any(isinstance(v, Mapping) for v in data.values()):
        return "bare"  # a section holds settings only; a whole config holds sections
    return None


def read_aio_config(path: Path) -> AioConfig:
    """The ``aio`` section of the JSON file ``path`` (a bare section, a file with an ``aio`` key, or a
    whole config holding one).

    Raises FileNotFoundError, and ValueError naming the file when it has no aio section (a whole config
    without one would otherwise run silently with the defaults) or a bad value.
    """
    data = read_json_object(path)
    if _where(data) is None:
        keys = ", ".join(list(data)[:4]) + (", ..." if len(data) > 4 else "")
        raise ValueError(f"{path} has no aio section (its keys: {keys or 'none'}); add one, or write the tuned "
                         f"one into it with `tensorio-bench sweep DIR --merge-into {path}`")
    try:
        return AioConfig.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def merge_aio(data: Mapping[str, Any], config: AioConfig) -> dict[str, Any]:
    """A copy of the config ``data`` with ``config``'s tuned keys (`TUNED_KEYS`) set in its aio section
    and every other key as it was; a section is added at the top level where there is none.

    ``thread_count`` is written as ``intra_op_parallelism`` where the section spells it so. Raises
    ValueError where the result would not load (an aio section in both places, a bad other key).
    """
    merged = json.loads(json.dumps(data))  # a deep copy that keeps key order
    where = _where(merged)
    if where == "bare":
        section = merged
    elif where == "zero_optimization.aio":
        section = merged["zero_optimization"]["aio"]
    else:
        section = merged.setdefault("aio", {})
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(section).__name__}")
    tuned = config.to_dict()
    for key in TUNED_KEYS:
        name = "intra_op_parallelism" if key == "thread_count" and "intra_op_parallelism" in section else key
        section[name] = tuned[key]
    AioConfig.from_dict(merged)  # raises for a section in both places or a bad untouched key
    return merged


def check_merge_target(path: Path) -> None:
    """Raise ValueError (or FileNotFoundError) naming ``path`` unless the tuned section can be merged
    into it: checked before a sweep, so that a long sweep does not end in a refusal."""
    if not Path(path).exists():
        raise FileNotFoundError(f"--merge-into {path}: no such file; give an existing config, or use "
                                f"--config-out to write the aio section alone")
    try:
        merge_aio(read_json_object(path), AioConfig())
    except ValueError as exc:
        raise ValueError(f"--merge-into {path}: {exc}") from None


def merge_into(path: Path, config: AioConfig) -> Path:
    """Set ``config``'s tuned keys in the aio section of the config file ``path``, keeping every other
    key, its order and the file's indentation; return the backup of the original written first
    (``FILE.bak``, or ``FILE.bak.N`` where that exists: a backup is never overwritten).

    The file is replaced atomically. Raises FileNotFoundError, and ValueError as `merge_aio` does.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    merged = merge_aio(read_json_object(path), config)
    backup = _free_name(path.with_name(path.name + ".bak"))
    shutil.copy2(path, backup)
    _replace(path, json.dumps(merged, indent=_indent(text), ensure_ascii=False) + ("\n" if text.endswith("\n") else ""))
    return backup


def check_config_out(path: Path) -> None:
    """Raise ValueError unless ``path`` may be replaced by a file holding an aio section alone: it does
    not exist, or holds nothing but an aio section (the output of an earlier sweep)."""
    path = Path(path)
    if not path.exists():
        return
    if path.is_dir():
        raise ValueError(f"--config-out {path} is a directory; give a file name")
    try:
        data = read_json_object(path)
    except ValueError as exc:
        raise ValueError(f"--config-out {path} exists and is not an aio config ({exc}); "
                         f"choose another file or remove it") from None
    where = _where(data)
    others = [key for key in data if key != "aio"] if where != "bare" else [k for k in data if k not in _AIO_NAMES]
    if others:
        raise ValueError(f"--config-out {path} holds other sections ({', '.join(others)}) that writing the aio "
                         f"section alone would lose; use --merge-into {path} to set its aio section and keep them, or choose "
                         f"another --config-out")


def write_aio_config(path: Path, config: AioConfig) -> None:
    """Write ``{"aio": {...}}`` with exactly the keys and types ``AioConfig.from_file`` reads (atomically;
    call `check_config_out` first: this replaces whatever ``path`` holds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, json.dumps({"aio": config.to_dict()}, indent=2) + "\n")


def _indent(text: str) -> str | None:
    """The indentation of the first indented key of a JSON text (None for one on one line)."""
    match = re.search(r"^[{\[]\s*?\n([ \t]+)\S", text.lstrip("\ufeff"))
    return match.group(1) if match else None


def _free_name(path: Path) -> Path:
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
