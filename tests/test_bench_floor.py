"""benchmarks/_floor.py: the ring's reads alone read exactly the streamed bytes of each forward, into the
ring's buffers; with reads skipped a forward reads nothing, and afterwards generation is the same as
before, token for token (nothing skipped stays bound)."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_infer_generate import PAD, build_model, prompts, save_checkpoint, scratch_dir, tight_budget

from benchmarks._floor import reads_skipped, ring_reads_alone, side_by_side
from offload.infer import init_inference


@pytest.fixture(scope="module")
def checkpoint():
    root = scratch_dir("bench-floor-")
    try:
        yield save_checkpoint(build_model("llama", torch.bfloat16), root / "llama")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def engine(checkpoint):
    with init_inference(checkpoint, max_in_cpu=tight_budget(checkpoint), disk_gbps=1.0) as engine:
        engine.wait_loaded()
        yield engine


def generate(engine, tokens: int = 6) -> torch.Tensor:
    ids, mask = prompts(1)
    return engine.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=PAD)


def test_the_rings_reads_alone_read_every_streamed_window_into_the_ring(engine):
    streamed = [u for u in engine.streamer.units if u.state == "on disk"]
    assert len(streamed) >= 2 and engine.plan.read_bytes_per_forward == sum(u.read_nbytes for u in streamed)
    nbytes, seconds = ring_reads_alone(engine, forwards=2)
    assert nbytes == 2 * engine.plan.read_bytes_per_forward and seconds > 0
    # The last unit read landed in its ring buffer as the file holds it (read here with plain open()).
    buffers = engine.streamer.buffers
    last = streamed[-1]
    buffer = buffers[(2 * len(streamed) - 1) % len(buffers)]
    for window in last.windows:
        with open(window.path, "rb") as f:
            f.seek(window.offset)
            expected = f.read(window.nbytes)
        got = buffer[window.buffer_offset: window.buffer_offset + len(expected)].numpy().tobytes()
        assert got == expected


def test_a_forward_with_reads_skipped_reads_nothing_and_changes_nothing_after(engine):
    before = generate(engine)
    with reads_skipped(engine):  # the reads the last forward left in flight are drained on the way in
        read = engine.streamer.bytes_read
        generate(engine)
        assert engine.streamer.bytes_read == read  # no streamed byte was read
    assert all(u.state in ("resident", "on disk") for u in engine.streamer.units)
    assert torch.equal(generate(engine), before)
    assert engine.streamer.bytes_read > read


def test_side_by_side_keeps_the_runs_plan_and_reports_both_halves(engine):
    ids, _ = prompts(1)
    generate(engine)
    figures = side_by_side(engine, ids, 6)
    assert len(figures["compute_alone_steps"]) == 5 and figures["compute_alone_s"] > 0
    assert figures["reads_alone_bps"] > 0 and figures["reads_alone_s"] > 0


def test_nothing_streamed_or_a_load_under_way_is_refused(checkpoint):
    with init_inference(checkpoint, max_in_cpu="1GiB", disk_gbps=1.0) as engine:
        engine.wait_loaded()
        with pytest.raises(RuntimeError, match="streams nothing"):
            ring_reads_alone(engine)
    with init_inference(checkpoint, max_in_cpu=tight_budget(checkpoint), disk_gbps=1.0) as engine:
        engine.wait_loaded()
        engine.streamer.units[0].state = "loading"  # as a unit is while its load runs
        with pytest.raises(RuntimeError, match="wait_loaded"):
            with reads_skipped(engine):
                pass
        engine.streamer.units[0].state = "on disk"
