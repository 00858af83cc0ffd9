"""Gradient reduction across ranks: the engine at world size 1 and 2 (two CPU processes over gloo, on this
machine), with gradients reduced in buckets overlapped with backward or with one blocking call per parameter.

    python -m benchmarks.engine_dist --repeats 3
    python -m benchmarks.engine_dist --model-config '{"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}'

Every configuration trains the same global batch (``--batch`` sequences, split over the ranks) for
``--steps`` timed steps after ``--warmup``; each runs in its own processes, configurations interleaved
``--repeats`` times; medians are printed. Per configuration: the step time and the seconds per step
rank 0's backward spent blocked in gradient reductions (``GradReducer.comm_seconds``: the part of the
communication not hidden behind backward). The offload devices are "none" by default, so that the disk
does not blur the communication. Beside them, the floor of world size 2 on these cores: two world-size-1
processes at once, each with its share of the cores and half the batch, nothing exchanged; and the
collectives alone: two ranks that record every collective one step of world size 2 issues (their kinds,
shapes and dtypes, through wrappers around torch.distributed's functions) and then time replaying them one
after another with no model. Over gloo the collectives are copies and sums on the same cores that compute,
so on a machine whose cores the compute already fills they cannot hide behind it: the floor with the
communication is the two added. Headline: world size 2's blocked reduction time with buckets against
per-parameter calls, and its step time against world size 1's, the floor, and the floor + the collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks._common import free_port

CONFIGS = {  # name: (processes, reduce_bucket_size, overlap_comm, mode)
    "world 1": (1, None, True, "engine"),
    "world 2, per parameter": (2, 1, False, "engine"),
    "world 2, buckets": (2, None, True, "engine"),
    "floor: 2 alone": (2, None, True, "alone"),
    "collectives alone": (2, None, True, "replay"),
}
"""The floor of world 2 on these cores: two world-size-1 processes at once, each with its share of the cores
and half the global batch, nothing exchanged (what two ranks would take if communication cost nothing)."""
RECORDED = ("all_gather_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_single",
            "reduce_scatter_tensor", "broadcast")
"""The torch.distributed functions whose calls `CollectiveLog` records (those the engine's step issues)."""
DEFAULT_MODEL = {"n_layer": 6, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 256}


class CollectiveLog:
    """Records the collectives issued while ``recording`` (each function's name, its tensors' shapes and
    dtypes, its other arguments), by wrapping torch.distributed's `RECORDED` functions, and replays them."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.calls: list[tuple[str, list, dict]] = []
        self.recording = False
        for name in RECORDED:
            function = getattr(dist, name, None)
            if function is not None:
                setattr(dist, name, self._wrap(name, function, torch.Tensor))

    def _wrap(self, name, function, tensor_type):
        def recorded(*args, **kwargs):
            if self.recording:
                shapes = [("tensor", tuple(a.shape), a.dtype) if isinstance(a, tensor_type) else a for a in args]
                self.calls.append((name, shapes, {k: v for k, v in kwargs.items() if k in ("op", "src")}))
            return function(*args, **kwargs)
        return recorded

    def replay(self) -> None:
        """Every recorded call once more, in order, each waited for, on fresh tensors of the same shapes."""
        import torch
        import torch.distributed as dist

        for name, args, kwargs in self.calls:
            real = [torch.ones(a[1], dtype=a[2]) if isinstance(a, tuple) and a and a[0] == "tensor" else a for a in args]
            getattr(dist, name)(*real, **kwargs)


def _rank(rank: int, world: int, args: dict, out: str) -> None:
    import torch
    import transformers

    from offload import initialize

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the cores are shared by the ranks
    batch_size = args["batch"]
    log = CollectiveLog() if args["mode"] == "replay" else None
    if args["mode"] == "alone":  # the floor: a process of its own with its half of the batch, no process group
        batch_size, world_of_engine = args["batch"] // world, 1
    else:
        world_of_engine = world
    if world_of_engine > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**args["model"], resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0))
    zero = {"stage": 3, "offload_param": {"device": args["device"]}, "offload_optimizer": {"device": args["device"]},
            "overlap_comm": args["overlap"]}
    if args["bucket"] is not None:
        zero["reduce_bucket_size"] = args["bucket"]
    if args["device"] == "nvme":
        for key in ("offload_param", "offload_optimizer"):
            zero[key]["nvme_path"] = args["dir"]
    engine, *_ = initialize(model=model, config={
        "train_batch_size": batch_size, "train_micro_batch_size_per_gpu": args["batch"] // world,
        "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 0.0})  # the updates during backward, as the recorded figures ran
    gen = torch.Generator().manual_seed(1)
    vocab = args["model"]["vocab_size"]
    batches = [torch.randint(0, vocab, (args["batch"], args["seq"]), generator=gen)
               for _ in range(args["warmup"] + args["steps"])]
    times, comm = [], []
    if log is not None:  # one step recorded after the warm-up, then replayed without the model
        batches = batches[:args["warmup"] + 1]
    for i, batch in enumerate(batches):
        share = batch.chunk(world)[rank]
        if log is not None:
            log.recording = i == args["warmup"]
        if world_of_engine > 1:
            torch.distributed.barrier()
        blocked = engine.stats().comm_seconds
        start = time.perf_counter()
        loss = engine(share, labels=share).loss
        engine.backward(loss)
        engine.step()
        if i >= args["warmup"]:
            times.append(time.perf_counter() - start)
            comm.append(engine.stats().comm_seconds - blocked)
    if log is not None:
        log.recording, times, comm = False, [], []
        for _ in range(args["steps"]):
            torch.distributed.barrier()
            start = time.perf_counter()
            log.replay()
            times.append(time.perf_counter() - start)
            comm.append(times[-1])
    engine.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times), "comm_s": statistics.median(comm), "times": times,
                       "calls": len(log.calls) if log is not None else 0}, f)
    if world_of_engine > 1:
        torch.distributed.barrier()  # no rank tears its connections down while another still uses them
        torch.distributed.destroy_process_group()


def run_config(name: str, args: argparse.Namespace, directory: str) -> dict:
    """One configuration in fresh processes; its figures (rank 0's)."""
    import torch.multiprocessing as mp

    world, bucket, overlap, mode = CONFIGS[name]
    payload = {"model": args.model_config, "batch": args.batch, "seq": args.seq, "warmup": args.warmup,
               "steps": args.steps, "device": args.device, "dir": directory, "bucket": bucket, "overlap": overlap,
               "mode": mode}
    out = os.path.join(directory, "result.json")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.start_processes(_rank, args=(world, payload, out), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", type=json.loads, default=DEFAULT_MODEL, help="GPT2Config keys as JSON")
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", choices=["none", "cpu", "nvme"], default="none", help="offload_param/optimizer device")
    ap.add_argument("--dir", default=None, help="directory for swap files (device nvme) and results")
    args = ap.parse_args(argv)
    args.model_config = {**DEFAULT_MODEL, **args.model_config}
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dist-") as directory:
        print(f"model={json.dumps(args.model_config)} global batch={args.batch} seq={args.seq} warmup={args.warmup} "
              f"steps={args.steps} device={args.device} cpus={os.cpu_count()} repeats={args.repeats}", flush=True)
        for _ in range(args.repeats):
            for name in CONFIGS:
                runs[name].append(run_config(name, args, directory))
    results = {}
    for name, rs in runs.items():
        results[name] = {key: statistics.median(r[key] for r in rs) for key in ("step_s", "comm_s", "calls")}
        print(f"{name:24s} step {results[name]['step_s']:7.3f} s   blocked in reductions {results[name]['comm_s']:6.3f} s"
              f"   (steps: {', '.join(format(r['step_s'], '.2f') for r in rs)})")
    per_param, buckets, one = (results["world 2, per parameter"], results["world 2, buckets"], results["world 1"])
    floor, collectives = results["floor: 2 alone"], results["collectives alone"]
    with_comm = floor["step_s"] + collectives["step_s"]
    print(f"world 2: reductions block backward {buckets['comm_s']:.3f} s per step with buckets against "
          f"{per_param['comm_s']:.3f} s with one call per parameter; step {buckets['step_s'] / one['step_s']:.2f}x world 1's "
          f"({per_param['step_s'] / one['step_s']:.2f}x per parameter); the floor (two processes alone on these "
          f"cores, half the batch each) {floor['step_s'] / one['step_s']:.2f}x world 1's, so world 2 is "
          f"{buckets['step_s'] / floor['step_s']:.2f}x its floor; its collectives alone take {collectives['step_s']:.3f} s a "
          f"step, so with them on the same cores the floor is {with_comm:.3f} s and world 2 is "
          f"{buckets['step_s'] / with_comm:.2f}x that")
    return results


if __name__ == "__main__":
    main()
