"""Shared fixtures: scratch directories on the disk (O_DIRECT) and on tmpfs (no O_DIRECT)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def disk_dir():
    """A scratch directory on the local disk, inside the clone (ext4 here: O_DIRECT works)."""
    root = REPO / ".tio_scratch"
    root.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=root))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmpfs_dir():
    """A scratch directory on tmpfs (/dev/shm), where there is no direct I/O to a device."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs on this machine")
    path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
