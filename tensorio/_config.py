"""`AioConfig`: the settings of the aio layer, validated in one place."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

KiB = 1024
MiB = 1024 * KiB

#: Largest piece one system call may move: Linux transfers at most 0x7FFFF000 bytes per call.
MAX_PIECE_BYTES = 0x7FFFF000 & ~(MiB - 1)

BACKENDS = ("auto", "io_uring", "threads")

# DeepSpeed's runtime reads `intra_op_parallelism`; its older docs and the Transformers guide say
# `thread_count`. Both mean the same knob here (DeepSpeed silently drops the one it does not read).
_ALIASES = {"intra_op_parallelism": "thread_count"}
# Keys DeepSpeed's aio section has that select hardware we do not drive; accepted only when off.
_ACCEPTED_WHEN_FALSE = ("use_gds",)


def _integral(key: str, value: Any) -> int:
    """Return ``value`` as an int, accepting integral floats such as 1e6 as JSON configs spell them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"aio.{key}: expected an integer, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"aio.{key}: expected an integer, got {value!r}")
    return int(value)


# Top-level keys of a whole DeepSpeed-style config, which tell one from a bare aio section.
_WHOLE_CONFIG_KEYS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "steps_per_print",
    "wall_clock_breakdown",
})


def _aio_section(config: Any) -> Mapping[str, Any]:
    """The ``aio`` section of ``config``: itself, its "aio" key, or zero_optimization's "aio" key."""
    if not isinstance(config, Mapping):
        raise ValueError(f"aio: expected a JSON object, got {type(config).__name__}")
    zero = config.get("zero_optimization")
    nested = isinstance(zero, Mapping) and "aio" in zero
    if "aio" in config and nested:
        raise ValueError("aio: given both at the top level and inside zero_optimization; keep one "
                         "(DeepSpeed reads only the top-level one)")
    if "aio" in config or nested:
        section = config["aio"] if "aio" in config else zero["aio"]
        if not isinstance(section, Mapping):
            raise ValueError(f"aio: expected a JSON object, got {type(section).__name__}")
        return section
    if _WHOLE_CONFIG_KEYS & set(config):
        return {}  # a whole config without an aio section: the defaults
    return config


@dataclass(kw_only=True, slots=True)
class AioConfig:
    """Settings of the aio layer, named as DeepSpeed's ``aio`` config section names them."""

    block_size: int = MiB
    """Bytes per piece: each request is split into pieces of this size. A positive multiple of 512."""

    queue_depth: int = 8
    """Pieces in flight per worker. At least 1."""

    thread_count: int = 1
    """Workers a request is spread over (DeepSpeed's ``intra_op_parallelism``). At least 1."""

    single_submit: bool = False
    """Submit each piece with its own system call instead of one call per batch (io_uring)."""

    overlap_events: bool = True
    """Top the queue up as each completion arrives instead of waiting for the whole batch (io_uring)."""

    backend: str = "auto"
    """"io_uring", "threads", or "auto" (io_uring when the kernel and the `liburing` package allow)."""

    direct: bool | str = "auto"
    """O_DIRECT: True requires it, False never uses it, "auto" uses it where the file system has it."""

    verify: bool = True
    """Checksum every write to offload's swap files and verify every read before its bytes are used
    (xxh3, hashed in the I/O threads; docs/reliability.md, "Checksums"). False turns it off."""

    def __post_init__(self) -> None:
        self.block_size = _integral("block_size", self.block_size)
        self.queue_depth = _integral("queue_depth", self.queue_depth)
        self.thread_count = _integral("thread_count", self.thread_count)
        if self.block_size <= 0 or self.block_size % 512:
            raise ValueError(
                f"aio.block_size: {self.block_size} is not allowed; use a positive multiple of 512 bytes "
                f"(for example 1048576)"
            )
        if self.block_size > MAX_PIECE_BYTES:
            raise ValueError(
                f"aio.block_size: {self.block_size} is too large; Linux moves at most {MAX_PIECE_BYTES} "
                f"bytes per call, so use at most that"
            )
        for key in ("queue_depth", "thread_count"):
            if getattr(self, key) < 1:
                raise ValueError(f"aio.{key}: {getattr(self, key)} is not allowed; use an integer >= 1")
        for key in ("single_submit", "overlap_events", "verify"):
            if not isinstance(getattr(self, key), bool):
                value = getattr(self, key)
                raise ValueError(f"aio.{key}: expected true or false, got {value!r} ({type(value).__name__})")
        if self.backend not in BACKENDS:
            raise ValueError(f"aio.backend: {self.backend!r} is not allowed; use one of {', '.join(BACKENDS)}")
        if not (self.direct is True or self.direct is False or self.direct == "auto"):
            raise ValueError(f"aio.direct: {self.direct!r} is not allowed; use true, false or \"auto\"")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "AioConfig":
        """Build a config from an ``aio`` section, or from a whole DeepSpeed-style config holding one.

        A whole config may hold it at the top level (where DeepSpeed reads it) or inside
        ``zero_optimization`` (where the Transformers guide prints it), not both.
        Raises ValueError naming the key for an unknown key, a wrong type or a value out of range.
        """
        section = _aio_section(section)
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in section.items():
            name = _ALIASES.get(key, key)
            if key in _ACCEPTED_WHEN_FALSE:
                if value not in (False, "false"):
                    raise ValueError(f"aio.{key}: {value!r} is not supported here; only false is")
                continue
            if name not in known:
                names = sorted(known | set(_ALIASES) | set(_ACCEPTED_WHEN_FALSE))
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                raise ValueError(f"aio.{key}: unknown key; allowed keys are {', '.join(names)}"
                                 f"{f'; did you mean {close[0]}?' if close else ''}")
            if name in values:
                raise ValueError(f"aio.{key}: given twice (as {key} and as its alias); keep one")
            values[name] = value
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "AioConfig":
        """Load a JSON file holding an ``aio`` section or a whole config with one (see ``from_dict``).

        Raises FileNotFoundError for a missing file and ValueError for bad JSON or a bad value.
        """
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The config as an ``aio`` section that ``from_dict`` reads back unchanged."""
        return asdict(self)
