"""One rank's swap traffic striped over several drives, against the sum of fio on each drive.

Each round writes (after one untimed write that lays the file out, as the engine's first step and fio
do) then reads ``--size`` bytes of one swap file in ``--request-size`` requests,
``--in-flight`` of them at a time (as the engine's partitions and sub-groups move), first through a
`SwapFile` on each directory alone, then through one `StripedSwapFile` over all of them (stripes weighted
by ``--weights``: measured by default, as the engine does; with ``--compare-even`` also even stripes);
then fio (sequential, the same block size, queue depth and O_DIRECT) on each directory alone and on all of
them at once (one fio per directory, started together). Medians of the rounds. Headline: the striped
file's GB/s over the sum of each drive's fio alone (the target: at least 0.9).

With checksums on (not ``--no-verify``) our file hashes (xxh3) every byte it writes or reads, and fio
does not: the floor beside it is fio on all the directories at once while a thread of this process
hashes, on the same cores, as many bytes a second as fio moves (`HashLoad` paced in bytes, 4 MiB slices
from memory, as tensorio's I/O threads hash them). fio's own figure with that load is the pace's answer,
so each round runs it twice: paced first at fio at once without hashing (more than fio then moves), then
at what fio moved in that first pass; the second pass is the floor, with the GB/s hashed beside it (near
what fio moved; under it, the floor errs high). Printed per round and as medians: the striped file over it.

    python -m benchmarks.striped_swap /work/tmp/x /dev/shm/sd --size 512M --rounds 3 [--weights 1,3] [--compare-even]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import statistics
import tempfile
import time

import torch

from bench.fio import FioJob, run_fio
from benchmarks._hash_load import HashLoad
from offload.storage import StripedSwapFile, SwapFile
from tensorio import AioConfig, aligned_tensor, parse_size


def _stream(file: SwapFile | StripedSwapFile, buffers: list[torch.Tensor], total: int, *, write: bool) -> float:
    """GB/s of moving ``total`` bytes through ``file`` in requests the size of a buffer, one per buffer in flight."""
    size = buffers[0].nbytes
    start = time.perf_counter()
    in_flight: list = []
    for index, offset in enumerate(range(0, total, size)):
        if len(in_flight) == len(buffers):
            in_flight.pop(0).result()  # sync point: the oldest request frees its buffer
        buffer = buffers[index % len(buffers)]
        in_flight.append(file.write(buffer, offset) if write else file.read(buffer, offset))
    for future in in_flight:
        future.result()
    return total / (time.perf_counter() - start) / 1e9


def _swap_round(make, buffers: list[torch.Tensor], total: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of a fresh swap file from ``make()``, written once first (untimed): a
    preallocated file's first write also converts its extents (ext4: unwritten to written), which the
    engine pays once, at its first step, and fio once, laying out its file before its timed loop."""
    file = make()
    try:
        file.allocate(total)
        file.preallocate()
        _stream(file, buffers, total, write=True)
        return _stream(file, buffers, total, write=True), _stream(file, buffers, total, write=False)
    finally:
        file.close()


def _weights(text: str, drives: int) -> tuple[int, ...] | None:
    """``--weights``: None for "auto" (measured), ones for "even", else the integers given, one per directory."""
    if text == "auto":
        return None
    if text == "even":
        return (1,) * drives
    try:
        weights = tuple(int(w) for w in text.split(","))
    except ValueError:
        weights = ()
    if len(weights) != drives or min(weights) < 1:
        raise ValueError(f"--weights {text!r}: give \"auto\", \"even\" or {drives} integers of at least 1, "
                         f"comma-separated (one per directory)")
    return weights


def _fio(directories: list[str], rw: str, size: int, aio: AioConfig) -> float:
    """Summed GB/s of one fio per directory, all started together."""
    jobs = [FioJob(directory=d, rw=rw, size=size, block_size=aio.block_size, queue_depth=aio.queue_depth,
                   overwrite=rw == "write") for d in directories]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return sum(result.bw_bytes for result in pool.map(run_fio, jobs)) / 1e9


def _fio_hashing(directories: list[str], rw: str, size: int, aio: AioConfig, load: HashLoad,
                 pace: float) -> tuple[float, float]:
    """(summed fio GB/s, GB/s hashed) of one fio per directory at once while ``load`` hashes ``pace`` GB/s."""
    load.bytes_per_s = pace * 1e9
    hashed, start = load.hashed, time.perf_counter()
    with load:
        moved = _fio(directories, rw, size, aio)
    return moved, (load.hashed - hashed) / (time.perf_counter() - start) / 1e9


def _floor(directories: list[str], rw: str, size: int, aio: AioConfig, load: HashLoad,
           pace: float) -> tuple[float, float]:
    """fio at once while as many bytes are hashed as it moves: paced at ``pace`` (fio at once without the
    hashing), then at what fio moved then; the second pass's (fio GB/s, GB/s hashed)."""
    moved, _ = _fio_hashing(directories, rw, size, aio, load, pace)
    return _fio_hashing(directories, rw, size, aio, load, moved)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print the configuration, the figures and the headline ratio; return them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", metavar="DIR", help="one directory per drive (two or more)")
    ap.add_argument("--size", default="512M", help="bytes written then read per file (default 512M)")
    ap.add_argument("--request-size", default="16M", help="bytes per request (default 16M)")
    ap.add_argument("--in-flight", type=int, default=4, help="requests in flight (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--no-fio", action="store_true", help="skip fio")
    ap.add_argument("--no-verify", action="store_true", help="no checksums (aio.verify false), as fio has none")
    ap.add_argument("--weights", default="auto",
                    help='the drives\' stripe weights: "auto" (measured, the default), "even", or e.g. 1,3')
    ap.add_argument("--compare-even", action="store_true", help="also measure the striped file with even stripes")
    args = ap.parse_args(argv)
    if len(args.dirs) < 2:
        ap.error("give two or more directories, one per drive")
    try:
        weights = _weights(args.weights, len(args.dirs))
    except ValueError as error:
        ap.error(str(error))
    total, request = parse_size(args.size), parse_size(args.request_size)
    if request % 4096 or request < 4096 or total < request:
        ap.error(f"--request-size {args.request_size} must be a multiple of 4096 and at most --size {args.size}")
    total -= total % request
    aio = AioConfig(verify=not args.no_verify)
    print(f"dirs={' '.join(args.dirs)} size={total} request={request} in_flight={args.in_flight} "
          f"rounds={args.rounds} weights={args.weights} aio={aio}")
    buffers = [aligned_tensor(request, torch.uint8).fill_(index + 1) for index in range(args.in_flight)]
    figures: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    used: list[tuple[int, ...]] = []
    floor = not args.no_fio and aio.verify  # hashing beside fio, as our file hashes what it moves
    load = HashLoad(bytes_per_s=1e9) if floor else None

    def striped(directories: list[str], stripe_weights: tuple[int, ...] | None) -> StripedSwapFile:
        """A striped file of ``stripe_weights`` (None: measured), the weights it took noted in ``used``."""
        file = StripedSwapFile(directories, aio, kind="bench", weights=stripe_weights)
        used.append(file.weights)
        return file

    with contextlib.ExitStack() as stack:
        dirs = [stack.enter_context(tempfile.TemporaryDirectory(dir=d, prefix="bench-striped-")) for d in args.dirs]
        for _ in range(args.rounds):
            for index, directory in enumerate(dirs):
                write, read = _swap_round(lambda: SwapFile(directory, aio, kind="bench"), buffers, total)
                add(f"alone {index} write", write)
                add(f"alone {index} read", read)
            write, read = _swap_round(lambda: striped(dirs, weights), buffers, total)
            add("striped write", write)
            add("striped read", read)
            if args.compare_even:
                write, read = _swap_round(lambda: striped(dirs, (1,) * len(dirs)), buffers, total)
                add("striped even write", write)
                add("striped even read", read)
            if not args.no_fio:
                for rw in ("write", "read"):
                    for index, directory in enumerate(dirs):
                        add(f"fio {index} {rw}", _fio([directory], rw, total, aio))
                    add(f"fio at once {rw}", _fio(dirs, rw, total, aio))
                    if floor:
                        moved, hashed = _floor(dirs, rw, total, aio, load, figures[f"fio at once {rw}"][-1])
                        add(f"fio at once+hash {rw}", moved)
                        add(f"hashed beside fio {rw}", hashed)
                        add(f"striped / floor {rw}", figures[f"striped {rw}"][-1] / moved)
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for name, value in medians.items():
        unit = "x   " if name.startswith("striped / ") else "GB/s"
        print(f"{name:23s} {value:6.2f} {unit}  (rounds: {', '.join(f'{v:.2f}' for v in figures[name])})")
    print(f"stripe weights: {':'.join(map(str, used[0]))} ({'measured' if weights is None else 'given'}; 1 MiB units, "
          f"{' : '.join(args.dirs)})")
    medians.update({f"weight {index}": float(weight) for index, weight in enumerate(used[0])})
    for rw in ("write", "read"):
        alone = sum(medians[f"alone {i} {rw}"] for i in range(len(dirs)))
        line = f"{rw}: striped {medians[f'striped {rw}']:.2f} GB/s = {medians[f'striped {rw}'] / alone:.2f}x the " \
               f"sum of each alone ({alone:.2f})"
        if args.compare_even:
            line += f" (even stripes {medians[f'striped even {rw}']:.2f} GB/s = " \
                    f"{medians[f'striped even {rw}'] / alone:.2f}x)"
        if not args.no_fio:
            fio = sum(medians[f"fio {i} {rw}"] for i in range(len(dirs)))
            medians[f"ratio to fio {rw}"] = medians[f"striped {rw}"] / fio
            line += f", {medians[f'ratio to fio {rw}']:.2f}x the sum of fio alone ({fio:.2f}; fio at once " \
                    f"{medians[f'fio at once {rw}']:.2f})"
        if floor:
            medians[f"ratio to floor {rw}"] = medians[f"striped {rw}"] / medians[f"fio at once+hash {rw}"]
            line += f"; {medians[f'ratio to floor {rw}']:.2f}x the floor, fio at once while as many bytes are " \
                    f"hashed ({medians[f'fio at once+hash {rw}']:.2f}, hashing " \
                    f"{medians[f'hashed beside fio {rw}']:.2f}; per round median " \
                    f"{medians[f'striped / floor {rw}']:.2f}x)"
        print(line)
    return medians


if __name__ == "__main__":
    main()
