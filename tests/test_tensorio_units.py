"""tensorio.parse_size / format_size: the one parser of byte sizes (tensorio-bench, offload.infer, benchmarks)."""

from __future__ import annotations

import pytest

import tensorio
from bench._units import parse_size as bench_parse_size
from offload.infer.config import InferenceConfig
from tensorio import format_size, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("1", 1), ("4095", 4095), ("4096", 4096), ("4096B", 4096), ("7 b", 7),
    # a letter alone, or with "iB": binary, any case, with or without a space
    ("128K", 128 * KiB), ("128k", 128 * KiB), ("128KiB", 128 * KiB), ("1m", MiB), ("512MiB", 512 * MiB),
    ("8G", 8 * GiB), ("8GiB", 8 * GiB), ("8 GiB", 8 * GiB), ("8 gib", 8 * GiB), ("1 G", GiB), ("2T", 2 << 40),
    (" 8GiB ", 8 * GiB),
    # a letter with "B" alone: decimal
    ("3KB", 3000), ("20MB", 20 * 10**6), ("20GB", 20 * 10**9), ("20 gb", 20 * 10**9), ("1TB", 10**12),
    # fractions, exact (no float rounding) and rounded down to the byte
    ("1.5M", 3 * MiB // 2), ("1.5GB", 1_500_000_000), ("4.35GB", 4_350_000_000), ("0.1K", 102), ("1.1GiB", 1181116006),
    # ints pass through
    (0, 0), (4096 * 10 + 1, 40961), (8 * GiB, 8 * GiB),
])
def test_parse_size(text, value):
    assert parse_size(text) == value
    assert tensorio.parse_size is parse_size and bench_parse_size is parse_size  # one parser


@pytest.mark.parametrize("text", ["", " ", "M", "GiB", "-1", "+1", "12X", "8 GiBs", "1e9", "1.", ".5G", "1,5G", "8 G B",
                                  "0x10", -1, True, 1.5, None, b"8G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_error_names_the_text_and_how_to_write_it():
    with pytest.raises(ValueError) as info:
        parse_size("8 gigs")
    assert "'8 gigs' is not a size" in str(info.value) and "8 GiB" in str(info.value) and "20GB" in str(info.value)


@pytest.mark.parametrize(("value", "label"), [(0, "0"), (1, "1"), (512, "512"), (1536, "1536"), (4096, "4K"),
                                              (128 * KiB, "128K"), (MiB, "1M"), (3 * MiB, "3M"), (GiB, "1G"),
                                              (1 << 40, "1T"), (GiB + KiB, "1048577K"), (10**9, "1000000000")])
def test_format_size_is_exact_and_round_trips(value, label):
    assert format_size(value) == label
    assert parse_size(format_size(value)) == value


def test_inference_budget_takes_the_same_spellings():
    for text in ("8GiB", "8G", "8 GiB", "8gib"):
        assert InferenceConfig(max_in_cpu=text).budget_bytes(2) == 8 * GiB
    assert InferenceConfig(max_in_cpu="20GB").budget_bytes(2) == 20 * 10**9
    assert InferenceConfig(max_in_cpu=1000).budget_bytes(2) == 2000  # a number is elements of the dtype
    with pytest.raises(ValueError, match=r"offload_param\.max_in_cpu: 'lots' is not a size.*elements"):
        InferenceConfig(max_in_cpu="lots")
