"""What a checked load costs, beside fio reading the same bytes: `engine.load_checkpoint` reads every
range it loads once, checks it against the checkpoint's checksums as it lands and stages it (uncommitted
swap slots, copies of what is in memory), committing only once every byte matched (so that a flipped bit
leaves the engine as it was): one read of the bytes.

A GPT-2 (default: small) with parameters and optimizer state on NVMe takes one step and saves a
checkpoint; then it is loaded ``--repeats`` times, each followed by fio reading as many bytes (O_DIRECT,
1 MiB, 32 in flight; skipped without fio or with ``--no-fio``). Per load: its time, and from its log line
the bytes checked and the pass's time. Reported: the medians, the load over fio's read; and the rank's
state file (which carries its own checksum): its size, and the medians of 100 reads of it with its
checksum checked (as every load reads it) and of 100 plain ``json.load``s of it (what reading it cost
before).

    python -m benchmarks.checkpoint_load --dir DIR --repeats 5
    python -m benchmarks.checkpoint_load --dir DIR --model-config '{"n_layer": 2, "n_embd": 64, "n_head": 2}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import time

from benchmarks._common import gpt2_on_nvme_after_a_step
from benchmarks.checkpoint_save import _fio

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
_CHECKED = re.compile(r"load_checkpoint: ([0-9.]+) MB of .* checked against their checksums in ([0-9.]+) s")
"""The load's log line: the MB read (once) and checked, and the seconds of the pass that read, checked and staged them."""


class _Checked(logging.Handler):
    """Keeps the figures of the load's "checked against their checksums" line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.figures: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _CHECKED.match(record.getMessage())
        if found:
            self.figures.append((float(found.group(1)) / 1e3, float(found.group(2))))  # GB, s


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return its figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory on the disk for the swap files and the checkpoint")
    parser.add_argument("--model-config", default=json.dumps(GPT2_SMALL), help="GPT2Config keywords, JSON")
    parser.add_argument("--repeats", type=int, default=5, help="loads timed; medians reported (default 5)")
    parser.add_argument("--no-fio", action="store_true", help="leave fio out (it is skipped where not installed)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="checkpoint-load-", dir=args.dir)
    try:
        figures = _measure(root, json.loads(args.model_config), args.repeats, fio=not args.no_fio)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load {figures['load_s']:.3f} s (median of {args.repeats}), of which the check "
          f"{figures['check_s']:.3f} s ({figures['check_share']:.0%}): {figures['checked_gb']:.3f} GB read and "
          f"checked at {figures['check_gb_per_s']:.2f} GB/s; loads {figures['loads_s']}")
    if figures.get("fio_read_s"):
        print(f"fio reading the same bytes {figures['fio_read_s']:.3f} s (median): the load is "
              f"{figures['load_over_fio_read']:.2f}x fio's read")
    print(f"state file {figures['state_file_bytes'] / 1e3:.1f} KB: read with its checksum checked "
          f"{figures['state_check_s'] * 1e3:.3f} ms, a plain json.load {figures['state_plain_s'] * 1e3:.3f} ms "
          f"(medians of 100)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(figures, file, indent=1)
    return figures


def _measure(root: str, model_config: dict, repeats: int, *, fio: bool = True) -> dict:
    _, engine = gpt2_on_nvme_after_a_step(root, model_config)
    engine.save_checkpoint(f"{root}/ckpt")
    state = _state_file_cost(f"{root}/ckpt/global_step1")
    handler = _Checked()
    logger = logging.getLogger("offload")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    loads, fio_reads = [], []
    try:
        for _ in range(repeats):
            began = time.perf_counter()
            engine.load_checkpoint(f"{root}/ckpt")
            loads.append(time.perf_counter() - began)
            if fio and handler.figures:  # alternated with the loads: the same disk, the same moment
                seconds = _fio(root, int(handler.figures[0][0] * 1e9)).get("read")
                if seconds is not None:
                    fio_reads.append(seconds)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        engine.close()
    if len(handler.figures) != repeats:
        raise RuntimeError(f"expected a 'checked against their checksums' log line per load, got "
                           f"{len(handler.figures)} for {repeats} loads")
    load, check = statistics.median(loads), statistics.median(s for _, s in handler.figures)
    checked = handler.figures[0][0]
    return {"load_s": load, "check_s": check, "check_share": check / load, "checked_gb": checked,
            "check_gb_per_s": checked / check if check else float("inf"), "loads_s": [round(s, 3) for s in loads],
            "checks_s": [s for _, s in handler.figures], **state, **_beside_fio(load, fio_reads)}


def _beside_fio(load: float, fio_reads: list[float]) -> dict:
    """fio's median read of the same bytes and the load's time over it; {} when fio was not measured."""
    if not fio_reads:
        return {}
    read = statistics.median(fio_reads)
    return {"fio_read_s": read, "load_over_fio_read": load / read if read else float("inf")}


def _state_file_cost(tag: str) -> dict:
    """Rank 0's state file: its bytes, and the medians of reading it checked and of a plain JSON load."""
    from offload.train.checkpoint.states_file import read_states_file

    path = f"{tag}/rank00000_states.json"

    def plain() -> None:
        with open(path, encoding="utf-8") as file:
            json.load(file)

    times = {}
    for name, read in (("state_check_s", lambda: read_states_file(tag, 0)), ("state_plain_s", plain)):
        runs = []
        for _ in range(100):
            began = time.perf_counter()
            read()
            runs.append(time.perf_counter() - began)
        times[name] = statistics.median(runs)
    return {"state_file_bytes": os.path.getsize(path), **times}


if __name__ == "__main__":
    main()
