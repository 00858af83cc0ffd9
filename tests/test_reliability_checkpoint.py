"""Checkpoint folders under concurrent and hostile use (issue 14): a second run saving into a folder
while the first saves is refused (it used to remove the first one's staging directory and crash it),
a killed saver does not block the next save, and a tag that is a symbolic link or a file is refused
at its own save without breaking the saves of other tags."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest
import torch.distributed as dist

from offload.storage import LATEST, atomic_checkpoint, resolve_tag
from offload.storage.checkpoint_dir import CheckpointInUseError
from offload.train.engine import initialize
from test_engine import engine_config, mlp, mlp_batches, mlp_loss
from ranks import run_ranks

# spawn, not fork: a child forked after this process ran OpenMP kernels can hang in its first one
SPAWN = multiprocessing.get_context("spawn")


def save(save_dir, tag, content=b"x"):
    with atomic_checkpoint(save_dir, tag) as staging:
        (staging / "model.bin").write_bytes(content)


def visible(save_dir):
    return sorted(entry.name for entry in save_dir.iterdir())


def _saver_inside_a_save(save_dir, conn):
    """Enter a save, say so, and finish it when told to (or never, when killed)."""
    with atomic_checkpoint(save_dir, "first") as staging:
        (staging / "model.bin").write_bytes(b"first")
        conn.send(("inside", os.getpid()))
        assert conn.recv() == "finish"
    conn.send("saved")


def _start_saver(save_dir):
    conn, child_conn = SPAWN.Pipe()
    saver = SPAWN.Process(target=_saver_inside_a_save, args=(save_dir, child_conn))
    saver.start()
    child_conn.close()  # so that recv() raises EOFError if the child dies instead of waiting forever
    assert conn.recv() == ("inside", saver.pid)
    return saver, conn


@pytest.mark.multiprocess
def test_a_second_writer_is_refused_and_the_first_save_completes(tmp_path):
    save_dir = tmp_path / "ckpt"
    save(save_dir, "zero")
    saver, conn = _start_saver(save_dir)
    try:
        staging = [name for name in visible(save_dir) if name.startswith(".staging-first-")]
        assert len(staging) == 1
        with pytest.raises(CheckpointInUseError, match=rf"checkpoint folder {save_dir} is being saved to by process "
                                                       rf"{saver.pid} on .*, which holds {save_dir / '.lock'}"):
            save(save_dir, "second")
        assert staging[0] in visible(save_dir)  # the refused save removed nothing
        conn.send("finish")
        assert conn.recv() == "saved"
    finally:
        saver.join()
    assert saver.exitcode == 0
    assert visible(save_dir) == ["first", LATEST, "zero"]
    assert (resolve_tag(save_dir) / "model.bin").read_bytes() == b"first"
    save(save_dir, "second")  # once the first save has ended
    assert visible(save_dir) == ["first", LATEST, "second", "zero"]


@pytest.mark.multiprocess
def test_a_killed_saver_leaves_an_unheld_lock_that_the_next_save_takes(tmp_path):
    save_dir = tmp_path / "ckpt"
    save(save_dir, "zero")
    saver, conn = _start_saver(save_dir)
    os.kill(saver.pid, signal.SIGKILL)
    saver.join()
    assert saver.exitcode == -signal.SIGKILL
    assert ".lock" in visible(save_dir)
    assert any(name.startswith(".staging-first-") for name in visible(save_dir))
    save(save_dir, "after")
    assert visible(save_dir) == ["after", LATEST, "zero"]


def test_a_nested_save_into_the_same_folder_is_refused_naming_this_process(tmp_path):
    with atomic_checkpoint(tmp_path, "outer") as staging:
        (staging / "a").write_text("a")
        with pytest.raises(CheckpointInUseError, match=f"process {os.getpid()} on"):
            save(tmp_path, "inner")
        save(tmp_path / "elsewhere", "inner")  # another folder is another lock
    assert visible(tmp_path) == ["elsewhere", LATEST, "outer"]


def _two_rank_saver(rank, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=2)
    try:
        try:
            with atomic_checkpoint(tmp_path / "ckpt", "group", all_ranks=True) as staging:
                (staging / f"rank{rank}.txt").write_text(str(rank))
            outcome = "saved"
        except RuntimeError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_a_process_group_is_refused_as_a_whole_when_another_run_saves(tmp_path):
    with atomic_checkpoint(tmp_path / "ckpt", "other") as staging:
        (staging / "a").write_text("a")
        run_ranks(_two_rank_saver, [(rank, tmp_path) for rank in range(2)])
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert outcomes[0].startswith(f"CheckpointInUseError: checkpoint folder {tmp_path / 'ckpt'} is being saved to "
                                  f"by process {os.getpid()}")
    assert outcomes[1] == f"RuntimeError: checkpoint {tmp_path / 'ckpt' / 'group'}: rank 0 could not start the save " \
                          f"(see its error)"
    assert visible(tmp_path / "ckpt") == [LATEST, "other"]


def test_an_engine_save_into_a_folder_another_save_holds_is_refused_and_the_engine_saves_later(disk_dir, tmp_path):
    engine, *_ = initialize(model=mlp(), config=engine_config(disk_dir, "nvme", "nvme"))
    try:
        batch = mlp_batches(1)[0]
        engine.backward(mlp_loss(engine, batch))
        engine.step()
        with atomic_checkpoint(tmp_path, "held"):
            with pytest.raises(CheckpointInUseError, match=str(tmp_path)):
                engine.save_checkpoint(tmp_path)
        assert engine.save_checkpoint(tmp_path) == str(tmp_path / "global_step1")
        engine.load_checkpoint(tmp_path)
    finally:
        engine.close()


def test_a_tag_that_is_a_symbolic_link_is_refused_and_other_tags_still_save(tmp_path):
    save_dir, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    save(save_dir, "one", b"one")
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep me")
    (save_dir / "two").symlink_to(elsewhere)
    for attempt in range(2):
        with pytest.raises(FileExistsError, match=rf"checkpoint {save_dir / 'two'} is a symbolic link \(to "
                                                  rf"{elsewhere}\).*remove the link or save under another tag"):
            save(save_dir, "two", b"two")
        assert visible(save_dir) == [LATEST, "one", *(f"other{i}" for i in range(attempt)), "two"]  # nothing left
        assert (save_dir / "two").is_symlink() and visible(elsewhere) == ["precious"]
        assert resolve_tag(save_dir).name == ("one" if attempt == 0 else "other0")
        save(save_dir, f"other{attempt}")
    assert (elsewhere / "precious").read_text() == "keep me"
    (save_dir / "dangling").symlink_to(tmp_path / "missing")
    with pytest.raises(FileExistsError, match="dangling is a symbolic link"):
        save(save_dir, "dangling")


def test_a_tag_that_is_a_file_and_a_latest_that_is_a_directory_are_refused(tmp_path):
    save(tmp_path, "one")
    (tmp_path / "two").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match=f"checkpoint {tmp_path / 'two'} is a file"):
        save(tmp_path, "two")
    assert (tmp_path / "two").read_text() == "not a checkpoint"
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST).mkdir()
    with pytest.raises(IsADirectoryError, match=f"{tmp_path / LATEST} is a directory"):
        save(tmp_path, "three")
    assert visible(tmp_path) == [LATEST, "one", "two"]
    with atomic_checkpoint(tmp_path, "four", update_latest=False) as staging:  # latest not touched
        (staging / "f").write_text("f")
    assert (tmp_path / "four" / "f").read_text() == "f"


def test_leftovers_that_are_links_or_files_are_removed_without_following_them(tmp_path):
    save_dir, target = tmp_path / "ckpt", tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("keep me")
    save(save_dir, "one")
    # what the save before this fix left behind after a tag that was a link: ".replaced-<tag>", a link
    (save_dir / ".replaced-one").symlink_to(target)
    (save_dir / ".staging-x-1").symlink_to(target)
    (save_dir / ".staging-y-2").write_text("a file")
    (save_dir / ".latest-3").mkdir()
    save(save_dir, "two")
    assert visible(save_dir) == [LATEST, "one", "two"]
    assert visible(target) == ["precious"]


def test_a_replaced_link_whose_tag_is_gone_is_put_back_as_it_was(tmp_path):
    save_dir, target = tmp_path / "ckpt", tmp_path / "target"
    target.mkdir()
    save(save_dir, "one")
    (save_dir / ".replaced-two").symlink_to(target)  # the state between the two renames of a replacement
    save(save_dir, "three")
    assert (save_dir / "two").is_symlink() and os.readlink(save_dir / "two") == str(target)
    with pytest.raises(FileExistsError, match="two is a symbolic link"):
        save(save_dir, "two")
    assert visible(save_dir) == [LATEST, "one", "three", "two"]
