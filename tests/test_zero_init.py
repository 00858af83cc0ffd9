"""offload.zero: models built partition by partition equal models built whole (weights, then training),
GatheredParameters reads and modifies partitions, external parameters are gathered, pretrained
weights load into the partitions, and building stays within its memory bound."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from torch import nn

from offload import zero
from offload.device import DeviceSyncError, SimulatedDevice
from offload.params.partition import owned_numel, partition_bounds
from offload.train.engine import initialize
from ranks import run_ranks
from test_engine import LR, WD, engine_config, gpt2, gpt2_batches, gpt2_loss, llama, reference, train
from tests.torchrun import torchrun

BUILDERS = {"gpt2": gpt2, "llama": llama}


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_init_builds_the_same_weights_and_trains_the_same(disk_dir, kind, device):
    build = BUILDERS[kind]
    batches = gpt2_batches(5)
    ref_losses, ref_params = reference(build(), batches, gpt2_loss, 1)
    config = engine_config(disk_dir, device if device == "nvme" else "cpu", "nvme")
    plain = {name: p.detach().clone() for name, p in build().named_parameters()}
    with zero.Init(config_dict_or_path=config):
        model = build()
    if device == "nvme":  # nothing of the model is left in memory but placeholders
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())
    built = _gathered(model)
    assert built.keys() == plain.keys()
    for name in plain:
        assert torch.equal(built[name], plain[name]), name
    engine, *_ = initialize(model=model, config=config)
    losses = train(engine, batches, gpt2_loss)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, tensor in engine.full_parameters():
        torch.testing.assert_close(tensor, ref_params[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    engine.close()


def test_init_disabled_builds_the_model_whole(disk_dir):
    with zero.Init(config_dict_or_path=engine_config(disk_dir, "nvme", "nvme"), enabled=False):
        model = gpt2()
    assert all(p.numel() == p.untyped_storage().nbytes() // p.element_size() for p in model.parameters())


def test_gathered_parameters_modify_and_write_back_and_read_only_drops_changes(disk_dir):
    config = engine_config(disk_dir, "nvme", "nvme")
    with zero.Init(config_dict_or_path=config):
        model = gpt2()
    weight = model.transformer.h[0].mlp.c_fc.weight
    with zero.GatheredParameters(weight):  # read only: a change is not kept
        assert weight.shape == (32, 128) and weight.stride() == (128, 1)
        weight.data.fill_(3.0)
    with zero.GatheredParameters([weight]):
        assert not torch.all(weight == 3.0)
    with zero.GatheredParameters(weight, modifier_rank=0):
        weight.data.fill_(0.5)
    assert weight.untyped_storage().nbytes() <= weight.element_size()  # partitioned again
    engine, *_ = initialize(model=model, config=config)
    assert torch.all(dict(engine.full_parameters())["transformer.h.0.mlp.c_fc.weight"] == 0.5)
    with zero.GatheredParameters(weight, modifier_rank=0):  # after initialize: the engine's partitions
        weight.data.fill_(-1.0)
    assert torch.all(dict(engine.full_parameters())["transformer.h.0.mlp.c_fc.weight"] == -1.0)
    train(engine, gpt2_batches(1), gpt2_loss)
    engine.close()


class _HeldWrite:
    """A swap-file write that starts only when it is waited for: a disk slower than everything after it."""

    def __init__(self, start) -> None:
        self._start, self._future = start, None

    def _started(self):
        if self._future is None:
            self._future = self._start()
        return self._future

    def done(self) -> bool:
        return self._future is not None and self._future.done()

    def exception(self):
        return self._started().exception()

    def result(self):
        return self._started().result()


def test_gathered_parameters_inside_init_wait_for_the_builds_writes(disk_dir, monkeypatch):
    """Inside zero.Init with parameters on NVMe, GatheredParameters on a parameter whose first write to the
    swap file is still in flight (held until waited for) reads it only once that write has landed, and
    its write-back is not overwritten by it later: the values read are the built ones, those kept the
    modifier's."""
    from offload.storage import SwapFile

    start = SwapFile.write
    monkeypatch.setattr(SwapFile, "write", lambda self, tensor, offset: _HeldWrite(lambda: start(self, tensor, offset)))
    config = engine_config(disk_dir, "nvme", "nvme")
    config["zero_optimization"]["offload_param"]["buffer_size"] = 64
    built = torch.randn(64, generator=torch.Generator().manual_seed(3))
    with zero.Init(config_dict_or_path=config):
        module = nn.Module()
        module.first = nn.Parameter(built.clone())
        module.second = nn.Parameter(torch.zeros(64))  # over the limit: first is placed, its write held
        assert module.first.untyped_storage().nbytes() <= module.first.element_size()
        with zero.GatheredParameters(module.first):
            assert torch.equal(module.first, built)
        with zero.GatheredParameters(module.first, modifier_rank=0):
            module.first.data.fill_(0.5)
    assert torch.equal(_gathered(module)["first"], torch.full((64,), 0.5))


class _SharedScale(nn.Module):
    """The second block reads the first block's weight in its forward: an external parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)) + x @ self.first.weight.t()


class _SecondUsesFirst(nn.Module):
    def __init__(self, owner: nn.Linear) -> None:
        super().__init__()
        self.owner = [owner]  # not a submodule: its weight is external to this module
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + x @ self.owner[0].weight.t()


class _External(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 16)
        self.second = _SecondUsesFirst(self.first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_an_external_parameter_is_gathered_once_registered(disk_dir):
    config = engine_config(disk_dir, "nvme", "nvme")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    expected = _External()(x)
    model = _External()
    engine, *_ = initialize(model=model, config=config)
    with pytest.raises(RuntimeError):  # the weight is an empty placeholder in second's forward
        engine(x)
    zero.register_external_parameter(model.second, model.first.weight)
    torch.testing.assert_close(engine(x), expected)
    engine.close()
    with zero.Init(config_dict_or_path=config):  # registered before initialize: picked up by it
        built = _External()
        zero.register_external_parameter(built.second, built.first.weight)
    engine, *_ = initialize(model=built, config=config)
    torch.testing.assert_close(engine(x), expected)
    engine.close()


class _WeightOf(nn.Module):
    """Hands out its weight instead of using it, as some embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self) -> torch.Tensor:
        return self.weight


class _ReturnsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 16)
        self.table = _WeightOf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) @ self.table().t()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_parameter_a_forward_returns_is_detected_as_external(disk_dir, clip):
    """As in DeepSpeed, a parameter returned by a module's forward is registered as an external parameter
    of the module that called it, with no call to register_external_parameter: training matches plain
    PyTorch (the weight read from NVMe in the caller's forward and gathered again for backward)."""
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def loss_fn(model, batch):
        return model(batch).pow(2).mean()

    ref_losses, ref_params = reference(_ReturnsWeight(), batches, loss_fn, 1, clip=clip)
    model = _ReturnsWeight()
    engine, *_ = initialize(model=model, config=engine_config(disk_dir, "nvme", "nvme", gradient_clipping=clip))
    assert all(rec.on_disk for rec in engine.records)
    losses = train(engine, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = dict(engine.full_parameters())
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-7)
    assert engine.stats().forwards_under_way == 0  # every forward that began has ended
    engine.close()


def test_pretrained_weights_load_into_partitions_as_from_pretrained_does(disk_dir, tmp_path):
    source = gpt2()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(1.5)  # not the random init: the load must be what changes the weights
    source.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    expected = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt")
    config = engine_config(disk_dir, "nvme", "nvme", gradient_clipping=0.0)
    model = zero.from_pretrained(tmp_path / "ckpt", config)
    loaded = _gathered(model)
    for name, p in expected.named_parameters():
        assert torch.equal(loaded[name], p.detach()), name
    # engine.load_pretrained on a model built any way, then the 16-bit save round-trips
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = initialize(model=gpt2(), config=config)
    assert engine.load_pretrained(tmp_path / "ckpt") == []
    every_name = dict(expected.named_parameters(remove_duplicate=False))
    for name, tensor in engine.full_parameters():
        assert torch.equal(tensor, every_name[name].detach()), name
    engine.save_16bit_model(tmp_path / "out")
    json.dump(expected.config.to_dict(), open(tmp_path / "out" / "config.json", "w"))
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    for name, p in expected.named_parameters():
        assert torch.equal(dict(again.named_parameters())[name], p), name
    engine.close()


def test_pretrained_errors_name_the_tensor(disk_dir, tmp_path):
    gpt2().save_pretrained(tmp_path / "ckpt")
    config = engine_config(disk_dir, "nvme", "nvme")
    other = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=80, n_positions=16)
    with zero.Init(config_dict_or_path=config):
        model = transformers.GPT2LMHeadModel(other)
    engine, *_ = initialize(model=model, config=config)
    with pytest.raises(ValueError, match=r"tensor 'transformer\.wte\.weight' has shape \[64, 32\], the model's "
                                         r"parameter \[80, 32\]"):
        engine.load_pretrained(tmp_path / "ckpt")
    engine.close()


def test_initialize_refuses_a_config_that_disagrees_with_the_build(disk_dir):
    with zero.Init(config_dict_or_path=engine_config(disk_dir, "nvme", "nvme")):
        model = gpt2()
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_param\.device: 'none', but the model was "
                                         r"built under zero\.Init with its parameters on NVMe"):
        initialize(model=model, config=engine_config(disk_dir, "none", "none"))


BUILD_CHILD = textwrap.dedent("""
    import json, sys, psutil, threading, torch, transformers
    from offload import zero
    peak = [0]; done = threading.Event()
    def sample():
        process = psutil.Process()
        while not done.wait(0.002):
            peak[0] = max(peak[0], process.memory_info().rss)
    config = json.loads(sys.argv[1]); enabled = sys.argv[2] == "1"
    hf = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=64)
    # import what building a GPT-2 imports (lazily) before the baseline: only the build is measured
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=4))
    base = psutil.Process().memory_info().rss
    thread = threading.Thread(target=sample, daemon=True); thread.start()
    try:
        with zero.Init(config_dict_or_path=config, enabled=enabled):
            model = transformers.GPT2LMHeadModel(hf)
    finally:
        done.set(); thread.join()
    weights = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    print(json.dumps({"growth": peak[0] - base, "weights": weights, "largest": largest}))
""")


@pytest.mark.subprocess
def test_building_under_init_stays_within_one_module_and_the_budget(disk_dir):
    """A model several times the budget: the build's peak RSS growth stays under twice the largest
    parameter (as built, and its page-aligned copy on its way to the disk) plus the budget
    (buffer_size elements) plus a fixed allowance for tensorio's staging buffers and the interpreter's
    own allocations; built whole, the same model grows by its full weights."""
    config = engine_config(disk_dir, "nvme", "nvme")
    config["zero_optimization"]["offload_param"]["buffer_size"] = 1 << 20  # 4 MiB of fp32
    results = {}
    for enabled in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", BUILD_CHILD, json.dumps(config), enabled], check=True,
                             capture_output=True, text=True).stdout
        results[enabled] = json.loads(out.strip().splitlines()[-1])
    under, whole = results["1"], results["0"]
    assert under["weights"] > 8 * (4 << 20)  # several times the budget
    bound = 2 * under["largest"] + (4 << 20) + (24 << 20)
    assert under["growth"] < bound, (under, bound)
    assert whole["growth"] > under["weights"] * 0.9 > under["growth"]


# ---- compute on a device with its own memory (the simulated one; docs/gpu.md) ---------------------------------

#: offload_param placements: in page-locked memory, all on NVMe, the first partitions in memory and the rest on
#: NVMe (max_in_cpu), and "none" (every parameter kept gathered on the device).
DEVICE_PLACEMENTS = ["cpu", "nvme", pytest.param("nvme-mixed", marks=pytest.mark.slow), "none"]


def _device_config(disk_dir, placement: str) -> dict:
    """engine_config with persistent layer norms (kept on the device) and, for "nvme-mixed", max_in_cpu."""
    config = engine_config(disk_dir, "nvme" if placement.startswith("nvme") else placement, "nvme", micro=2)
    zero_config = config["zero_optimization"]
    zero_config["stage3_param_persistence_threshold"] = 100
    if placement == "nvme-mixed":
        zero_config["offload_param"]["max_in_cpu"] = 20000
    return config


@pytest.mark.simulated
@pytest.mark.parametrize("schedule", ["random", pytest.param("late", marks=pytest.mark.slow)])
@pytest.mark.parametrize("placement", DEVICE_PLACEMENTS)
def test_init_on_a_device_trains_as_the_plain_model_on_the_cpu(disk_dir, placement, schedule):
    """A model built under zero.Init, computing on a device with its own memory: its in-memory partitions
    move to page-locked buffers, persistent parameters stay on the device, NVMe partitions are read into
    page-locked pool buffers; the losses and parameters equal those of the same model built plainly and
    trained by the engine on the same device (tolerance of the CPU tests above: the device's kernels are
    not the CPU engine's)."""
    build = lambda: gpt2(dropout=0.0)  # noqa: E731 - no dropout: the same numbers on any device
    batches = gpt2_batches(4)
    config = _device_config(disk_dir, placement)
    plain_device = SimulatedDevice(seed=5, schedule=schedule, max_delay_s=0.0005)
    cpu_engine, *_ = initialize(model=build(), config=config, compute_device=plain_device)
    ref_losses = train(cpu_engine, batches, gpt2_loss)
    ref_params = {name: tensor.cpu() for name, tensor in cpu_engine.full_parameters()}
    cpu_engine.close()
    plain_device.close()

    device = SimulatedDevice(seed=11, schedule=schedule, max_delay_s=0.0005)
    with zero.Init(config_dict_or_path=config):
        model = build()
    engine, *_ = initialize(model=model, config=config, compute_device=device)
    assert engine.device.separate_memory
    in_memory = [rec for rec in engine.records if not rec.on_disk]
    assert all(device.is_pinned(rec.partition.data) for rec in in_memory)
    persistent = [rec for rec in engine.records if rec.numel <= 100]
    assert persistent and all(rec.keep_full and device.owns(rec.full) for rec in persistent)
    if placement == "none":
        assert all(rec.keep_full and device.owns(rec.full) for rec in engine.records)
    else:  # only persistent parameters are kept whole; the others are gathered onto the device per use
        assert all(p.numel() == 0 for p, rec in zip(engine.module.parameters(), engine.records) if rec.numel > 100)
    if placement == "nvme-mixed":
        assert any(rec.on_disk for rec in engine.records) and any(rec.numel > 100 for rec in in_memory)
    losses = train(engine, batches, gpt2_loss)
    params = {name: tensor.cpu() for name, tensor in engine.full_parameters()}
    engine.close()
    device.raise_faults()
    device.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert params.keys() == ref_params.keys()
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, ref_params[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.simulated
@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_init_on_a_device_catches_a_gather_that_does_not_wait_for_its_copy(disk_dir, monkeypatch, placement):
    """A model built under zero.Init, with copies as late as possible: compute that skips the wait for a
    partition's copy reads a buffer the copy has not filled, and the simulated device raises."""
    config = _device_config(disk_dir, placement)
    with zero.Init(config_dict_or_path=config):
        model = gpt2(dropout=0.0)
    device = SimulatedDevice(schedule="late")
    engine, *_ = initialize(model=model, config=config, compute_device=device)
    monkeypatch.setattr(device.compute_stream, "wait_event", lambda event: None)
    with pytest.raises(DeviceSyncError, match="partition"):
        gpt2_loss(engine, gpt2_batches(1)[0])
    monkeypatch.undo()
    engine.close()
    device.close()


PIN_CHILD = textwrap.dedent("""
    import json, sys, psutil, threading, torch, transformers
    from offload import zero
    from offload.params.construct import built_store
    from offload.params.placement import pin_partition
    from tensorio import locked_tensor
    with zero.Init(config_dict_or_path=json.loads(sys.argv[1])):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8,
                                                                     vocab_size=8192, n_positions=64))
    records = built_store(model).records
    peak = [0]; done = threading.Event()
    def sample():
        process = psutil.Process()
        while not done.wait(0.002):
            peak[0] = max(peak[0], process.memory_info().rss)
    base = psutil.Process().memory_info().rss
    thread = threading.Thread(target=sample, daemon=True); thread.start()
    try:
        for rec in records:
            pin_partition(rec, locked_tensor, persistent=False)
    finally:
        done.set(); thread.join()
    after = psutil.Process().memory_info().rss
    print(json.dumps({"growth": max(peak[0], after) - base, "after": after - base,
                      "weights": sum(rec.partition_numel * 4 for rec in records),
                      "largest": max(rec.partition_numel * 4 for rec in records)}))
""")


@pytest.mark.subprocess
def test_moving_built_partitions_to_page_locked_memory_holds_one_extra_partition(disk_dir):
    """What initialize does for a model built under zero.Init (in memory) with compute on a device of its
    own memory: the partitions move into page-locked buffers one by one, so the peak RSS growth stays under
    the largest partition plus a fixed allowance (never a second copy of the model), and after the move the
    weights are held once."""
    config = engine_config(disk_dir, "cpu", "nvme")
    out = subprocess.run([sys.executable, "-c", PIN_CHILD, json.dumps(config)], check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    bound = result["largest"] + (24 << 20)
    assert result["weights"] > 2 * bound  # a second copy of the model would break the bound
    assert result["growth"] < bound, (result, bound)
    assert result["after"] < bound, (result, bound)


# ---- several ranks with compute on a device (the simulated one: its collectives take device buffers, as NCCL's) ----


def _build_on_a_rank(rank: int, tmp: str, out: str) -> None:
    """A rank of a two-rank build under zero.Init for compute on the simulated device, as torchrun
    launches it (zero.Init starts the process group): a placed weight re-initialised, a bias changed on
    rank 0 (GatheredParameters with modifier_rank), then one training step of the engine on the device.
    Rank 0 saves the built weights and the collectives the device checked."""
    import gc
    import os

    import torch.distributed as dist

    from test_engine import mlp, mlp_batches, mlp_loss

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", OFFLOAD_SIMGPU_COUNT="2")  # simgpu:LOCAL_RANK
    device = SimulatedDevice(seed=rank, max_delay_s=0.0002)
    checked: list[str] = []
    check = device.check_collective
    device.check_collective = lambda *tensors, op="collective", **kw: (checked.append(op), check(*tensors, op=op, **kw))[1]
    config = engine_config(tmp, "cpu", "none", micro=2)
    with zero.Init(config_dict_or_path=config, compute_device=device):
        model = mlp()
        nn.init.constant_(model[0].weight, 0.5)  # a re-initialisation touching a placed weight: gathered
    with zero.GatheredParameters(model[0].bias, modifier_rank=0):
        if rank == 0:  # changed on rank 0 only: broadcast to the others
            model[0].bias.data.fill_(0.25)
    assert dist.get_backend() == device.collective_backend  # started by zero.Init for that compute
    built = _gathered(model)
    build_ops = list(checked)
    engine, *_ = initialize(model=model, config=config, compute_device=device)
    x, y = mlp_batches(1)[0]
    loss = mlp_loss(engine, (x.chunk(2)[rank], y.chunk(2)[rank]))  # this rank's share of the batch
    engine.backward(loss)
    engine.step()
    engine.close()
    if rank == 0:
        torch.save({"built": built, "checked": build_ops}, out)
    device.synchronize()
    device.close()
    del engine, device
    gc.collect()  # the collectives' device buffers, freed before gloo's teardown
    dist.destroy_process_group()


@pytest.mark.simulated
@pytest.mark.multiprocess
def test_two_ranks_build_under_init_for_compute_on_a_device(disk_dir, tmp_path, monkeypatch):
    """zero.Init on two ranks for compute on a device with its own memory: it starts the process group
    for that device (NCCL for CUDA; the simulated device's transport here), its build's all-gathers and
    broadcasts run on tensors where that backend needs them (the simulated device's check: device
    buffers, as NCCL), the weights equal the model built whole with the same change, and the engine
    trains on the group."""
    import socket

    from test_engine import mlp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    out = str(tmp_path / "rank0.pt")
    run_ranks(_build_on_a_rank, [(r, str(disk_dir), out) for r in range(2)], timeout=120)
    saved = torch.load(out)
    expected = mlp()
    with torch.no_grad():
        expected[0].weight.fill_(0.5)
        expected[0].bias.fill_(0.25)
    for name, tensor in expected.named_parameters():
        assert torch.equal(saved["built"][name], tensor), name
    assert {op.split(" of ")[0] for op in saved["checked"]} == {"all_gather", "broadcast"}  # under zero.Init's names


# ---- several ranks on the CPU (gloo, through torchrun) ----------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_gathered_parameters_inside_init_keep_the_modifier_ranks_values_on_every_rank(disk_dir, placement):
    """GatheredParameters with modifier_rank inside zero.Init on two ranks (as Hugging Face's weight init
    and resize_token_embeddings use it): on exit every rank's partition holds the modifier rank's values,
    whatever state the parameter is in (pending as built, persistent, placed, gathered back by the build);
    with modifier_rank=None every rank's changes are dropped (tests/zero_init_dist_worker.py)."""
    ranks = torchrun("tests.zero_init_dist_worker", placement, str(disk_dir))
    first = ranks[0]
    wrong = []
    for case, modifier in first["modifier"].items():
        kept = ranks[0 if modifier is None else modifier]["kept"][case]
        numel = first["numel"][case]
        for rank, got in ranks.items():
            start, _ = partition_bounds(numel, len(ranks), rank)
            owned = owned_numel(numel, len(ranks), rank)
            if got["partitions"][case][:owned] != kept[start:start + owned]:
                wrong.append(f"{case}: rank {rank}'s partition {got['partitions'][case][:4]}... is not rank "
                             f"{0 if modifier is None else modifier}'s {kept[start:start + 4]}...")
    assert not wrong, "\n".join(wrong)
