"""World size 2 (two CPU processes over gloo, started here) against world size 1 with the same global batch,
and a checkpoint written by both ranks and loaded back."""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch
from torch import nn

from offload.device import SimulatedDevice
from offload.train.engine import initialize

pytestmark = pytest.mark.multiprocess

transformers = pytest.importorskip("transformers")


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def batches(n: int = 6, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (batch, 16), generator=g) for _ in range(n)]


# eps 1e-6: the key bias of attention has a zero gradient up to rounding noise, which Adam with
# eps 1e-8 would amplify into lr-sized updates that differ with the summation order of the reduction.
def config(tmp: str, param: str, opt: str, world_size: int, gas: int, clip: float, bucket: int = 500_000_000,
           overlap: bool = True) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "sub_group_size": 4096,
            "reduce_bucket_size": bucket, "overlap_comm": overlap,
            "offload_param": {"device": param}, "offload_optimizer": {"device": opt}}
    if param == "nvme":
        zero["offload_param"].update(nvme_path=tmp, max_in_cpu=0, buffer_size=16384, buffer_count=2)
    if opt == "nvme":
        zero["offload_optimizer"].update(nvme_path=tmp)
    return {"train_batch_size": 4 * gas, "train_micro_batch_size_per_gpu": 4 // world_size,
            "gradient_accumulation_steps": gas, "zero_optimization": zero, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-6}}}


def run(rank: int, world_size: int, tmp: str, param: str, opt: str, gas: int, clip: float, out: str,
        bucket: int = 500_000_000, overlap: bool = True, simulated: bool = False) -> None:
    """Train on this rank's share of each global batch; rank 0 saves losses and full parameters.
    ``simulated``: compute on the simulated device (all-gathers and reductions of device buffers)."""
    if world_size > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: each rank takes simgpu:LOCAL_RANK
    device = SimulatedDevice(seed=rank, max_delay_s=0.0002) if simulated else "cpu"
    model = gpt2()
    seen = _record_devices(model, device) if simulated else None
    engine, *_ = initialize(model=model, config=config(tmp, param, opt, world_size, gas, clip, bucket, overlap),
                            compute_device=device)
    fast = opt == "nvme"  # the path under test: during backward without clipping, else in the next forward
    stats = engine.stats()
    assert stats.mode.value == ("after backward" if not fast else "in the next forward" if clip else "during backward")
    assert stats.reduction_buckets == (world_size > 1)
    losses = []
    for batch in batches(4 * gas):
        share = batch.chunk(world_size)[rank]
        loss = engine(share, labels=share).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world_size > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    if simulated:  # this rank's parameters, gradients, device buffers and activations: on its own index
        assert device.torch_device == torch.device("simgpu", rank)
        assert {kind: places for kind, places in seen.items()} == {
            kind: {device.torch_device} for kind in ("parameters", "gradients", "buffers", "activations")}, seen
    params = {n: t for n, t in engine.full_parameters()}
    # Every rank saves its partitions into one atomic checkpoint; a fresh engine loads them back.
    path = engine.save_checkpoint(os.path.join(tmp, f"ckpt{world_size}"), client_state={"rank0": rank == 0})
    engine.close()
    fresh, *_ = initialize(model=gpt2(), config=config(tmp, param, opt, world_size, gas, clip, bucket, overlap),
                           compute_device=device)
    loaded, client = fresh.load_checkpoint(os.path.join(tmp, f"ckpt{world_size}"))
    reloaded = {n: t for n, t in fresh.full_parameters()}
    fresh.close()
    assert loaded == path and client == {"rank0": rank == 0}
    assert all(torch.equal(reloaded[n], t) for n, t in params.items())
    if rank == 0:
        torch.save({"losses": losses, "params": params, "steps": engine.global_steps}, out)
    if simulated:
        device.synchronize()  # nothing left for its copy threads to run at exit
        device.raise_faults()
        device.close()  # its copy threads, before the process group goes
        del engine, fresh, device
        gc.collect()  # the device buffers collectives used, freed before gloo's teardown (docs/engine.md)
    if world_size > 1:
        torch.distributed.destroy_process_group()


def _record_devices(model: nn.Module, device: SimulatedDevice) -> dict[str, set]:
    """Where ``model``'s gathered parameters (at each module's forward), gradients (as autograd computes
    them), ``device``'s buffers (gathers, gradient buckets) and activations (module outputs) are made."""
    seen = {"parameters": set(), "gradients": set(), "buffers": set(), "activations": set()}

    def before(module, args):
        seen["parameters"].update(p.device for p in module.parameters(recurse=False) if p.numel())

    def after(module, args, output):
        seen["activations"].update(t.device for t in (output if isinstance(output, tuple) else (output,))
                                   if isinstance(t, torch.Tensor))

    for module in model.modules():
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    for param in model.parameters():
        param.register_hook(lambda grad: seen["gradients"].add(grad.device))
    empty = device.empty

    def recorded(*args, **kwargs):
        buffer = empty(*args, **kwargs)
        seen["buffers"].add(buffer.device)
        return buffer

    device.empty = recorded
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Clipping (with accumulation): the step in the next forward. Neither: the updates run during backward,
# the on-disk partitions written back from there. The optimizer state in memory: the chunked step after
# backward (docs/engine.md). Gradients are reduced in buckets (a tiny one: several buckets, the largest
# gradients alone, each waited for at once without overlap_comm).
@pytest.mark.parametrize("param,opt,gas,clip,bucket,overlap", [
    ("nvme", "nvme", 2, 0.5, 500_000_000, True), ("nvme", "nvme", 1, 0.0, 500_000_000, True),
    ("nvme", "nvme", 2, 0.0, 3000, False), ("nvme", "cpu", 2, 0.5, 3000, True)],
    ids=["step-in-next-forward", "updates-in-backward", "accumulation-small-buckets-no-overlap", "chunked-step"])
def test_world_size_two_matches_one(disk_dir, param, opt, gas, clip, bucket, overlap, monkeypatch):
    two_ranks_match_one(disk_dir, monkeypatch, (str(disk_dir), param, opt, gas, clip), (bucket, overlap), simulated=False)


def two_ranks_match_one(disk_dir, monkeypatch, setting: tuple, rest: tuple, *, simulated: bool) -> None:
    """`run` at world size one, then at two, on the CPU (or both on the simulated device where
    ``simulated``: its kernels are not the CPU engine's): the same losses, and parameters within Adam's
    amplification of last-bit differences."""
    one, two = str(disk_dir / "one.pt"), str(disk_dir / "two.pt")
    run(0, 1, *setting, one, *rest, simulated)
    if simulated:  # a node of two simulated devices, one per rank (simgpu:0 and simgpu:1)
        monkeypatch.setenv("OFFLOAD_SIMGPU_COUNT", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    from ranks import run_ranks  # here: tests/two_node_worker.py imports this module as tests.test_engine_dist

    run_ranks(run, [(r, 2, *setting, two, *rest, simulated) for r in range(2)], timeout=120)
    a, b = torch.load(one), torch.load(two)
    assert a["steps"] == b["steps"] == 4
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=0)
    # Parameters: Adam divides by sqrt(v), so elements with tiny gradients turn the last-bit differences
    # of a different reduction order into differences of about 1e-6 (weights are about 2e-2); on the
    # simulated device, as on a GPU, autograd runs backward on its device thread, whose order of summing
    # a tensor's several gradients differs again (up to about 1.3e-5 on one element here).
    atol = 2e-5 if simulated else 1e-5
    for name, ref in a["params"].items():
        torch.testing.assert_close(b["params"][name], ref, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.simulated
@pytest.mark.parametrize("param,opt,gas,clip,bucket", [("cpu", "nvme", 1, 0.0, 3000), ("nvme", "nvme", 2, 0.5, 500_000_000)],
                         ids=["updates-in-backward-small-buckets", "params-on-disk-clipping-accumulation"])
def test_world_size_two_on_the_simulated_device_matches_one(disk_dir, param, opt, gas, clip, bucket, monkeypatch):
    """Two ranks computing on the simulated device (partitions all-gathered and gradients all-reduced as
    device buffers, as NCCL needs them) give world size one's results on that device. As torchrun launches
    them, on a node of two devices: each rank's parameters, gradients, device buffers and activations are
    on its own index, simgpu:LOCAL_RANK."""
    two_ranks_match_one(disk_dir, monkeypatch, (str(disk_dir), param, opt, gas, clip), (bucket, True), simulated=True)


def _check_with_rank_1_corrupt(rank: int, world_size: int, out: str) -> None:
    """Rank 1's failure state is corrupt (a checksum mismatch on its swap file); every rank checks before a save."""
    from offload.train.step.failure import FailureState
    from tensorio import ChecksumError

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        failure = FailureState()
        if rank == 1:
            failure.corrupt(ChecksumError(path="/nvme/offload-params-1.swp", offset=0, length=4096, expected=1,
                                          actual=2, what="parameter 'w'"))
        try:
            failure.check_all_ranks("save a checkpoint", group=None, world_size=world_size, rank=rank)
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        with open(f"{out}.{rank}", "w", encoding="utf-8") as file:
            file.write(refused)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_a_save_after_one_rank_failed_is_refused_on_every_rank(disk_dir, monkeypatch):
    """The ranks agree before a save (one all-reduce of a flag): rank 1 cannot save, so rank 0 refuses too,
    naming rank 1, instead of entering the save's collectives alone; rank 2 likewise."""
    from ranks import run_ranks

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    out = str(disk_dir / "refused")
    run_ranks(_check_with_rank_1_corrupt, [(r, 3, out) for r in range(3)], timeout=60)
    zero, one, two = (open(f"{out}.{r}", encoding="utf-8").read() for r in range(3))
    assert zero == two and zero.startswith("cannot save a checkpoint: rank 1 cannot (a step there failed part way")
    assert one.startswith("cannot save a checkpoint: a swap file returned corrupt bytes")
