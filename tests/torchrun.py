"""Two-rank tests of the trainer integrations: launch a worker module with torchrun or ``accelerate launch``
(gloo on the CPU) and collect what each rank reports; the workers' side of it (`report`, `finish`)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def torchrun(module: str, *args: str, ranks: int = 2) -> dict[int, Any]:
    """Run ``python -m module *args`` on ``ranks`` processes through torchrun; return each rank's `report`.
    Fails the test with the end of the workers' error output when the launch fails."""
    from benchmarks._common import free_port

    return _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--master_port", str(free_port()), "-m", module, *args], ranks)


def accelerate_launch(module: str, *args: str, ranks: int = 2) -> dict[int, Any]:
    """Run ``python -m module *args`` on ``ranks`` processes through ``accelerate launch`` (its
    ``--multi_gpu`` launcher, which starts CPU processes too: the workers' ``Accelerator(cpu=True)``
    picks gloo; ``--cpu`` with several processes needs mpirun); return each rank's `report`.
    Every setting is a flag, so that no accelerate config file of the machine changes the launch."""
    from benchmarks._common import free_port

    return _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--main_process_port", str(free_port()), "-m", module, *args], ranks)


def _launch(command: list[str], ranks: int) -> dict[int, Any]:
    with tempfile.TemporaryDirectory() as reports:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OFFLOAD_TEST_REPORTS": reports}
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)  # a process group of the test process itself is not the workers'
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        found = {int(name[4:-5]): Path(reports, name) for name in os.listdir(reports)}
        assert sorted(found) == list(range(ranks)), done.stderr[-3000:]
        return {rank: json.loads(path.read_text()) for rank, path in found.items()}


def report(value: Any) -> None:
    """A worker's result, as JSON in the folder `torchrun` reads (``rank<N>.json``)."""
    path = Path(os.environ["OFFLOAD_TEST_REPORTS"], f"rank{os.environ['RANK']}.json")
    path.write_text(json.dumps(value))


def finish() -> None:
    """End a worker's process group before the interpreter's shutdown frees what its collectives used
    (gloo's teardown may otherwise abort: docs/engine.md, engine.close())."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
