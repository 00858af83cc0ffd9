import json

import pytest

from tensorio import AioConfig


def test_defaults_match_deepspeed_runtime():
    cfg = AioConfig()
    assert (cfg.block_size, cfg.queue_depth, cfg.thread_count) == (1 << 20, 8, 1)
    assert (cfg.single_submit, cfg.overlap_events, cfg.backend, cfg.direct) == (False, True, "auto", "auto")


def test_intra_op_parallelism_is_thread_count():
    assert AioConfig.from_dict({"intra_op_parallelism": 3}).thread_count == 3
    with pytest.raises(ValueError, match="given twice"):
        AioConfig.from_dict({"intra_op_parallelism": 3, "thread_count": 2})


def test_integral_floats_accepted():
    assert AioConfig.from_dict({"block_size": 262144.0, "queue_depth": 3.2e1}).block_size == 262144


@pytest.mark.parametrize(
    "section, words",
    [
        ({"block_size": 1000}, ["aio.block_size", "1000", "multiple of 512"]),
        ({"block_size": 0}, ["aio.block_size", "multiple of 512"]),
        ({"block_size": "1M"}, ["aio.block_size", "'1M'", "integer"]),
        ({"block_size": 4096.5}, ["aio.block_size", "integer"]),
        ({"queue_depth": 0}, ["aio.queue_depth", ">= 1"]),
        ({"thread_count": -2}, ["aio.thread_count", ">= 1"]),
        ({"single_submit": "false"}, ["aio.single_submit", "'false'", "true or false"]),
        ({"overlap_events": 1}, ["aio.overlap_events", "true or false"]),
        ({"backend": "libaio"}, ["aio.backend", "'libaio'", "io_uring", "threads"]),
        ({"direct": "yes"}, ["aio.direct", "'yes'"]),
        ({"queue_size": 8}, ["aio.queue_size", "unknown key", "queue_depth"]),
        ({"use_gds": True}, ["aio.use_gds", "only false"]),
        ({"queue_depth": True}, ["aio.queue_depth", "integer"]),
    ],
)
def test_bad_values_name_the_key(section, words):
    with pytest.raises(ValueError) as info:
        AioConfig.from_dict(section)
    for word in words:
        assert word in str(info.value)


def test_whole_config_with_aio_in_either_place(tmp_path):
    top = {"zero_optimization": {"stage": 3}, "aio": {"queue_depth": 16}}
    nested = {"zero_optimization": {"stage": 3, "aio": {"queue_depth": 32}}}
    assert AioConfig.from_dict(top).queue_depth == 16
    assert AioConfig.from_dict(nested).queue_depth == 32
    with pytest.raises(ValueError, match="both at the top level and inside zero_optimization"):
        AioConfig.from_dict({"aio": {}, "zero_optimization": {"aio": {}}})


def test_from_file_reads_the_example_configs():
    cfg = AioConfig.from_file("configs/zero3_nvme_offload_auto.json")
    assert (cfg.block_size, cfg.queue_depth, cfg.thread_count) == (262144, 32, 1)
    assert AioConfig.from_file("configs/zero3_auto.json") == AioConfig()


def test_to_dict_round_trips_through_a_file(tmp_path):
    cfg = AioConfig(block_size=4096, queue_depth=3, thread_count=2, single_submit=True,
                    overlap_events=False, backend="threads", direct=False)
    path = tmp_path / "aio.json"
    path.write_text(json.dumps({"aio": cfg.to_dict()}))
    assert AioConfig.from_file(path) == cfg


def test_from_file_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        AioConfig.from_file(path)


def test_whole_config_without_aio_gives_defaults():
    assert AioConfig.from_dict({"train_batch_size": 4, "fp16": {"enabled": True}}) == AioConfig()
