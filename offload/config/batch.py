"""Batch-size arithmetic: train_batch_size = micro batch x accumulation steps x world size."""

from __future__ import annotations


def check_batch_sizes(train: int, micro: int, accum: int, world_size: int, *, derived: str = "") -> None:
    """Raise ValueError naming all three values and the world size unless they multiply out.

    ``derived`` names the key that was computed rather than written, for the message.
    """
    if micro * accum * world_size == train and min(train, micro, accum) >= 1:
        return
    note = f" ({derived} was derived from the others)" if derived else ""
    raise ValueError(
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
        f"gradient_accumulation_steps ({accum}) x world size ({world_size}) = {micro * accum * world_size}"
        f"{note}; change one of them or leave one out to have it derived (\"auto\" only under OffloadTrainer, "
        f"OffloadStrategy or OffloadAccelerator, which fill it)"
    )


def derive_batch_sizes(
    train: int | None, micro: int | None, accum: int | None, world_size: int
) -> tuple[int, int, int]:
    """Return (train_batch_size, micro batch per rank, accumulation steps), filling in the missing ones.

    Any two determine the third, as in DeepSpeed; with one alone the accumulation steps default to 1;
    with none the micro batch is 1 too. Raises ValueError if they do not multiply out with world_size.
    """
    if train is not None and micro is not None and accum is not None:
        check_batch_sizes(train, micro, accum, world_size)
        return train, micro, accum
    if train is not None and micro is not None:
        _check_divides(train, micro, "train_micro_batch_size_per_gpu", world_size, "gradient_accumulation_steps")
        accum = train // (micro * world_size)
        check_batch_sizes(train, micro, accum, world_size, derived="gradient_accumulation_steps")
    elif train is not None:
        accum = 1 if accum is None else accum
        _check_divides(train, accum, "gradient_accumulation_steps", world_size, "train_micro_batch_size_per_gpu")
        micro = train // (accum * world_size)
        check_batch_sizes(train, micro, accum, world_size, derived="train_micro_batch_size_per_gpu")
    else:
        micro = 1 if micro is None else micro
        accum = 1 if accum is None else accum
        train = micro * accum * world_size
    return train, micro, accum


def _check_divides(train: int, given: int, given_key: str, world_size: int, derived: str) -> None:
    """Raise ValueError when no whole ``derived`` makes train_batch_size = given x derived x world size."""
    if given < 1:
        raise ValueError(f"{given_key}: {given} is not allowed; use an integer >= 1")
    if train % (given * world_size) == 0:
        return
    raise ValueError(
        f"train_batch_size ({train}) is not a multiple of {given_key} ({given}) x world size ({world_size}) = "
        f"{given * world_size}, so no whole {derived} makes them multiply out; set train_batch_size to a multiple "
        f"of {given * world_size} (such as {max(1, train // (given * world_size)) * given * world_size}) or set "
        f"{derived} too"
    )
