"""Atomic checkpoint directories and safetensors files: what is visible after success, an exception, an
interrupted replacement and a SIGKILL in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from offload.storage import LATEST, atomic_checkpoint, resolve_tag, save_tensors_safetensors
from ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent


def save(save_dir, tag, content, **kwargs):
    with atomic_checkpoint(save_dir, tag, **kwargs) as staging:
        (staging / "model.bin").write_bytes(content)
        (staging / "sub").mkdir()
        (staging / "sub" / "rank0.txt").write_text(tag)


def visible(save_dir):
    return sorted(entry.name for entry in save_dir.iterdir())


def test_save_makes_the_tag_and_latest(tmp_path):
    save_dir = tmp_path / "ckpt"
    save(save_dir, "global_step1", b"one")
    save(save_dir, "global_step2", b"two")
    assert visible(save_dir) == ["global_step1", "global_step2", LATEST]
    assert (save_dir / LATEST).read_text() == "global_step2"
    assert resolve_tag(save_dir) == save_dir / "global_step2"
    assert (resolve_tag(save_dir, "global_step1") / "model.bin").read_bytes() == b"one"
    assert (save_dir / "global_step2" / "sub" / "rank0.txt").read_text() == "global_step2"


def test_update_latest_false_leaves_latest_alone(tmp_path):
    save(tmp_path, "a", b"a")
    save(tmp_path, "b", b"b", update_latest=False)
    assert resolve_tag(tmp_path).name == "a"
    assert (tmp_path / "b" / "model.bin").read_bytes() == b"b"


def test_exception_inside_the_block_leaves_the_previous_checkpoint(tmp_path):
    save(tmp_path, "good", b"good")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_checkpoint(tmp_path, "bad") as staging:
            (staging / "model.bin").write_bytes(b"half")
            raise RuntimeError("boom")
    assert visible(tmp_path) == ["good", LATEST]
    assert (resolve_tag(tmp_path) / "model.bin").read_bytes() == b"good"


def test_replacing_a_tag_swaps_its_whole_contents(tmp_path):
    save(tmp_path, "step", b"old")
    with atomic_checkpoint(tmp_path, "step") as staging:
        (staging / "other.bin").write_bytes(b"new")
    assert visible(tmp_path) == [LATEST, "step"]
    assert visible(tmp_path / "step") == ["other.bin"]


def test_failed_replacement_keeps_the_old_contents(tmp_path):
    save(tmp_path, "step", b"old")
    with pytest.raises(ValueError):
        with atomic_checkpoint(tmp_path, "step") as staging:
            (staging / "model.bin").write_bytes(b"new")
            raise ValueError("stop")
    assert (resolve_tag(tmp_path) / "model.bin").read_bytes() == b"old"


def test_crash_between_the_renames_of_a_replacement_is_repaired_by_the_next_save(tmp_path):
    save(tmp_path, "step", b"old")
    # the state after os.rename(step, .replaced-step) and before the staging directory took its place
    os.rename(tmp_path / "step", tmp_path / ".replaced-step")
    (tmp_path / ".staging-step-x1y2").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\.replaced-step.*next save restores it"):
        resolve_tag(tmp_path)
    save(tmp_path, "other", b"other", update_latest=False)
    assert visible(tmp_path) == [LATEST, "other", "step"]
    assert (resolve_tag(tmp_path) / "model.bin").read_bytes() == b"old"


def test_crash_after_the_renames_of_a_replacement_drops_the_old_copy(tmp_path):
    save(tmp_path, "step", b"new")
    (tmp_path / ".replaced-step").mkdir()
    (tmp_path / ".replaced-step" / "model.bin").write_bytes(b"old")
    save(tmp_path, "next", b"next")
    assert visible(tmp_path) == [LATEST, "next", "step"]
    assert (tmp_path / "step" / "model.bin").read_bytes() == b"new"


def test_leftovers_are_cleaned_by_the_next_save(tmp_path):
    save(tmp_path, "a", b"a")
    (tmp_path / ".staging-b-abc123").mkdir()
    (tmp_path / ".staging-b-abc123" / "model.bin").write_bytes(b"partial")
    (tmp_path / ".latest-q9").write_text("b")
    save(tmp_path, "c", b"c")
    assert visible(tmp_path) == ["a", "c", LATEST]


_KILLED_SAVER = textwrap.dedent(
    """
    import sys, time
    from offload.storage import atomic_checkpoint
    save_dir = sys.argv[1]
    with atomic_checkpoint(save_dir, "step1") as staging:
        (staging / "model.bin").write_bytes(b"complete" * 1000)
    with atomic_checkpoint(save_dir, "step2") as staging:
        with open(staging / "model.bin", "wb") as file:
            file.write(b"partial")
            file.flush()
            print("writing", flush=True)
            time.sleep(60)
    """
)


@pytest.mark.subprocess
def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    saver = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert saver.stdout.readline() == "writing\n"
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
    assert saver.returncode == -signal.SIGKILL
    assert [name for name in visible(tmp_path) if not name.startswith(".")] == [LATEST, "step1"]
    assert (resolve_tag(tmp_path) / "model.bin").read_bytes() == b"complete" * 1000
    with pytest.raises(FileNotFoundError, match="step2"):
        resolve_tag(tmp_path, "step2")
    save(tmp_path, "step3", b"three")
    assert visible(tmp_path) == [LATEST, "step1", "step3"]


_LOOPING_SAVER = textwrap.dedent(
    """
    import sys
    from offload.storage import atomic_checkpoint
    step = 0
    while True:
        with atomic_checkpoint(sys.argv[1], f"step{step}") as staging:
            (staging / "model.bin").write_bytes(bytes([step % 256]) * (1 << 18))
            (staging / "done").write_text(str(step))
        step += 1
        if step == 3:
            print("saving", flush=True)
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_sigkill_at_an_arbitrary_moment_leaves_only_whole_checkpoints(tmp_path, delay):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    saver = subprocess.Popen(
        [sys.executable, "-c", _LOOPING_SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert saver.stdout.readline() == "saving\n"
        time.sleep(delay)
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
    tags = [name for name in visible(tmp_path) if not name.startswith(".") and name != LATEST]
    assert len(tags) >= 3
    for tag in tags:
        step = int((tmp_path / tag / "done").read_text())
        assert tag == f"step{step}"
        assert (tmp_path / tag / "model.bin").read_bytes() == bytes([step % 256]) * (1 << 18)
    assert resolve_tag(tmp_path).name in tags
    save(tmp_path, "after", b"after")
    assert [name for name in visible(tmp_path) if name.startswith(".")] == []


def _two_rank_saver(rank, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=2)
    save_dir, outcome = tmp_path / "ckpt", {}
    try:
        with atomic_checkpoint(save_dir, "s1", all_ranks=True) as staging:
            (staging / f"rank{rank}.txt").write_text(str(rank))
        # every rank returns only after the commit, so both files are visible to both ranks here
        outcome["s1"] = visible(save_dir / "s1")
        try:
            with atomic_checkpoint(save_dir, "s2", all_ranks=True) as staging:
                (staging / f"rank{rank}.txt").write_text(str(rank))
                if rank == 1:
                    raise ValueError("disk full on rank 1")
        except (ValueError, RuntimeError) as exc:
            outcome["s2"] = f"{type(exc).__name__}: {exc}"
        # without all_ranks, one rank saves on its own while the group is initialized
        if rank == 1:
            save(save_dir, "solo", b"solo", update_latest=False)
        dist.barrier()
        outcome["solo"] = visible(save_dir / "solo")
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_share_one_staging_directory_and_fail_together(tmp_path):
    save(tmp_path / "ckpt", "s0", b"zero")
    run_ranks(_two_rank_saver, [(rank, tmp_path) for rank in range(2)])
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [outcome["s1"] for outcome in outcomes] == [["rank0.txt", "rank1.txt"]] * 2
    assert outcomes[1]["s2"] == "ValueError: disk full on rank 1"
    assert outcomes[0]["s2"].startswith("RuntimeError: checkpoint") and "another rank failed" in outcomes[0]["s2"]
    assert [outcome["solo"] for outcome in outcomes] == [["model.bin", "sub"]] * 2
    assert visible(tmp_path / "ckpt") == [LATEST, "s0", "s1", "solo"]
    assert resolve_tag(tmp_path / "ckpt").name == "s1"


@pytest.mark.parametrize("tag", ["", ".hidden", LATEST, "a/b", "../up"])
def test_bad_tags_are_refused(tmp_path, tag):
    with pytest.raises(ValueError, match="checkpoint tag"):
        with atomic_checkpoint(tmp_path, tag):
            pass
    assert visible(tmp_path) == []


def test_resolve_tag_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'} does not exist; pass the save_dir"):
        resolve_tag(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        resolve_tag(tmp_path / "file")
    save(tmp_path / "ckpt", "s1", b"1", update_latest=False)
    with pytest.raises(FileNotFoundError, match=r"latest does not exist.*pass tag=.*tags in .*: s1"):
        resolve_tag(tmp_path / "ckpt")
    (tmp_path / "ckpt" / LATEST).write_text("")
    with pytest.raises(ValueError, match="latest is empty"):
        resolve_tag(tmp_path / "ckpt")
    (tmp_path / "ckpt" / LATEST).write_text("s9\n")
    with pytest.raises(FileNotFoundError, match=r"s9 \(named by .*latest\) does not exist; tags in .*: s1"):
        resolve_tag(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match=r"s7 \(named by tag=\)"):
        resolve_tag(tmp_path / "ckpt", "s7")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_safetensors_round_trip(tmp_path, dtype):
    tensors = {
        "embed.weight": torch.arange(4095 * 3).reshape(4095, 3).to(dtype),
        "scalar": torch.tensor(7).to(dtype),
        "empty": torch.zeros(0, 5, dtype=dtype),
    }
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"an older file")
    save_tensors_safetensors(path, tensors, metadata={"format": "pt"})
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == dtype and torch.equal(loaded[name], tensor)
    with safe_open(path, framework="pt") as file:
        assert file.metadata() == {"format": "pt"}
    assert visible(tmp_path) == ["model.safetensors"]


def test_safetensors_failure_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    save_tensors_safetensors(path, {"w": torch.ones(3)})
    with pytest.raises(TypeError, match="cannot be stored"):
        save_tensors_safetensors(path, {"w": torch.ones(3, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"tensors\['w'\]"):
        save_tensors_safetensors(path, {"w": [1.0]})
    with pytest.raises(TypeError, match=r"metadata\['step'\]"):
        save_tensors_safetensors(path, {"w": torch.ones(3)}, metadata={"step": 3})
    with pytest.raises(FileNotFoundError, match="does not exist; create it"):
        save_tensors_safetensors(tmp_path / "missing" / "m.safetensors", {"w": torch.ones(3)})
    assert visible(tmp_path) == ["model.safetensors"]
    assert torch.equal(load_file(path)["w"], torch.ones(3))


def test_safetensors_writer_streams_pieces_in_any_order(tmp_path):
    """Views, shared memory and pieces written out of order: the file equals save_file's tensors."""
    from offload.storage import SafetensorsWriter

    base = torch.arange(24, dtype=torch.float32)
    tensors = {"t": base.view(4, 6).t(), "shared": base, "half": torch.randn(4097).to(torch.bfloat16),
               "empty": torch.zeros(0, 3)}
    path = tmp_path / "streamed.safetensors"
    with SafetensorsWriter(path, {n: (t.dtype, t.shape) for n, t in tensors.items()}, {"k": "v"}) as out:
        out.write("half", tensors["half"][4000:], 4000)
        out.write("shared", tensors["shared"])
        out.write("t", tensors["t"])
        out.write("half", tensors["half"][:4000])
        with pytest.raises(ValueError, match="outside tensor 'half'"):
            out.write("half", tensors["half"][:10], 4090)
        with pytest.raises(ValueError, match="tensor 'shared' is torch.float32"):
            out.write("shared", base.double())
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    with safe_open(path, framework="pt") as file:
        assert file.metadata() == {"k": "v"}
        assert torch.equal(file.get_slice("half")[10:20], tensors["half"][10:20])
