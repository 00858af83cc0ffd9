"""Memory cgroups for the benchmarks that run a peer: each side alone in a cgroup whose limit counts its
page cache, so that a budget means the same memory for both (Accelerate's disk offload reads through
the page cache, which its ``max_memory`` does not bound).

cgroup v1 (``/sys/fs/cgroup/memory``): a group made inside the one this process is in; v2
(``/sys/fs/cgroup`` with a ``cgroup.controllers`` file): a group made at the hierarchy's root, the
memory controller enabled there. Needs root (or a delegated hierarchy). Where no group can be made,
`MemoryCgroup.create` returns the reason instead, which the benchmark prints once and writes as
"page cache unbounded" beside every peer figure.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

__all__ = ["UNBOUNDED", "MemoryCgroup"]

UNBOUNDED = "page cache unbounded"
"""The label of a figure measured without a memory cgroup."""

_V1_NO_LIMIT = 9223372036854771712
_COUNTER = itertools.count()


def _own_path(controller_line: str, proc: Path) -> str:
    for line in (proc / "self" / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller_line == "" and controllers == "" or controller_line in controllers.split(","):
            return path.lstrip("/")
    return ""


class MemoryCgroup:
    """One memory cgroup: its ``limit`` (bytes, None: none), the processes started in it with `enter`
    (a ``preexec_fn``), and its figures after the run (`peak`, `limit_hits`, `oom_kills`). Remove it
    with `close` once its processes are gone."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version
        self.limit: int | None = None

    @classmethod
    def create(cls, name: str, *, root: str | os.PathLike = "/sys/fs/cgroup",
               proc: str | os.PathLike = "/proc") -> "MemoryCgroup | str":
        """A new group named ``name`` plus a number, or the reason none can be made (a string)."""
        root, proc = Path(root), Path(proc)
        unique = f"{name}-{os.getpid()}-{next(_COUNTER)}"
        try:
            if (root / "memory").is_dir():
                parent = root / "memory" / _own_path("memory", proc)
                if not parent.is_dir():  # a cgroup namespace: the mount's root is this process's own group
                    parent = root / "memory"
                version = "v1"
            elif (root / "cgroup.controllers").is_file():
                if "memory" not in (root / "cgroup.controllers").read_text().split():
                    return f"the cgroup v2 hierarchy at {root} has no memory controller"
                if "memory" not in (root / "cgroup.subtree_control").read_text().split():
                    (root / "cgroup.subtree_control").write_text("+memory")
                parent, version = root, "v2"
            else:
                return f"no memory cgroup hierarchy at {root} (neither {root / 'memory'} nor a cgroup v2 mount)"
            path = parent / unique
            path.mkdir()
        except OSError as exc:
            return f"a memory cgroup cannot be made under {root} ({exc.strerror or exc}; root is needed)"
        group = cls(path, version)
        try:
            group.set_limit(None)
        except OSError as exc:
            group.close()
            return f"the memory cgroup {path} cannot be limited ({exc.strerror or exc})"
        return group

    def set_limit(self, nbytes: int | None) -> None:
        """Limit the group's memory, page cache included, to ``nbytes`` (None: no limit). Raises OSError."""
        if self.version == "v1":
            (self.path / "memory.limit_in_bytes").write_text(str(_V1_NO_LIMIT if nbytes is None else nbytes))
            if (self.path / "memory.swappiness").exists():
                (self.path / "memory.swappiness").write_text("0")
        else:
            (self.path / "memory.max").write_text("max" if nbytes is None else str(nbytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        self.limit = nbytes

    def enter(self) -> None:
        """Move the calling process into the group (as a child's ``preexec_fn``, before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _events(self, name: str) -> dict[str, int]:
        return {key: int(value) for key, value in (line.split() for line in self._read(name).splitlines() if line)
                if value.isdigit()}

    def peak(self) -> int:
        """The highest usage so far, page cache included (bytes; 0 where the kernel does not say)."""
        name = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        try:
            return int(self._read(name))
        except (OSError, ValueError):
            return 0

    def limit_hits(self) -> int:
        """How often a charge hit the limit (v1 ``memory.failcnt``; v2 ``memory.events`` max): reclaim forced."""
        if self.version == "v1":
            return int(self._read("memory.failcnt"))
        return self._events("memory.events").get("max", 0)

    def oom_kills(self) -> int:
        """Processes of the group the OOM killer killed."""
        events = self._events("memory.oom_control" if self.version == "v1" else "memory.events")
        return events.get("oom_kill", 0)

    def close(self) -> None:
        """Remove the group (its processes have exited); leaves it where the kernel refuses."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def describe(self) -> str:
        """ "cgroup v1 /sys/fs/cgroup/memory/x (limit 9.00 GiB)"."""
        limit = "no limit" if self.limit is None else f"limit {self.limit / (1 << 30):.2f} GiB"
        return f"cgroup {self.version} {self.path} ({limit})"
