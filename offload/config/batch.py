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
        f"{note}; change one of them, leave one out to have it derived, or set them to \"auto\""
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
        accum = train // (micro * world_size)
        check_batch_sizes(train, micro, accum, world_size, derived="gradient_accumulation_steps")
    elif train is not None:
        accum = 1 if accum is None else accum
        micro = train // (accum * world_size)
        check_batch_sizes(train, micro, accum, world_size, derived="train_micro_batch_size_per_gpu")
    else:
        micro = 1 if micro is None else micro
        accum = 1 if accum is None else accum
        train = micro * accum * world_size
    return train, micro, accum
