"""Training with ``offload_param.max_in_cpu: "auto"``: the elements kept in memory follow the host's
available memory (a fake MemAvailable and cgroup limit) less the engine's other shares and a margin,
the engine trains as with that number, and the plan says from what."""

from __future__ import annotations

import pytest
from test_engine import engine_config, gpt2, gpt2_batches, gpt2_loss

import offload.train.sizing as sizing
from offload import EngineConfig, resolve_auto
from offload.device import HostMemory, host_memory
from offload.params import partition_numel
from offload.train.engine import initialize

GiB = 1 << 30


def fake_cgroup(tmp_path, *, limit: int, usage: int) -> HostMemory:
    """host_memory over a fake /proc (MemAvailable 20 GiB) and a cgroup v1 of ``limit`` using ``usage``."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {24 * GiB // 1024} kB\nMemAvailable: {20 * GiB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n")
    group = tmp_path / "cgroup" / "memory" / "job"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    (group / "memory.usage_in_bytes").write_text(str(usage))
    (group / "memory.stat").write_text("total_inactive_file 0\n")
    return host_memory(proc=proc, cgroup_root=tmp_path / "cgroup")


def config_for(disk_dir) -> dict:
    config = engine_config(disk_dir, "nvme", "none", micro=2)
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = "auto"
    return config


def usage_for(tmp_path, cfg: EngineConfig, numels: list[int], elements: int, limit: int) -> HostMemory:
    """The fake cgroup whose "auto" is ``elements``, within one element (bisection on the usage)."""
    low, high = 0, limit
    while high - low > 1:
        middle = (low + high) // 2
        path = tmp_path / str(middle)
        found = sizing.auto_max_in_cpu(cfg, numels, 4, fake_cgroup(path, limit=limit, usage=middle))[0]
        low, high = (middle, high) if found > elements else (low, middle)
    return fake_cgroup(tmp_path / "chosen", limit=limit, usage=high)


def test_auto_trains_as_the_number_it_took_and_says_from_what(disk_dir, tmp_path, monkeypatch):
    model = gpt2(dropout=0.0)
    numels = [partition_numel(p.numel(), 1) for p in model.parameters()]
    cfg = EngineConfig.from_dict(config_for(disk_dir), world_size=1)
    memory = usage_for(tmp_path, cfg, numels, 20000, GiB)
    monkeypatch.setattr(sizing, "host_memory", lambda: memory)
    engine, *_ = initialize(model=model, config=config_for(disk_dir))
    plan = engine.plan
    assert 19000 <= plan.max_in_cpu <= 20000 and plan.in_memory[0] > 0 and plan.on_disk[0] > 0
    text = plan.describe()
    assert f"max_in_cpu {plan.max_in_cpu:,} elements = \"auto\":" in text and "cgroup v1 " in text
    assert "kept gradients (at most 1/4)" in text and "I/O buffer pool (1/16)" in text and "margin" in text
    same_config = config_for(disk_dir)
    same_config["zero_optimization"]["offload_param"]["max_in_cpu"] = plan.max_in_cpu
    same, *_ = initialize(model=gpt2(dropout=0.0), config=same_config)
    assert [r.on_disk for r in same.records] == [r.on_disk for r in engine.records]
    losses = []
    for run in (engine, same):
        out = []
        for batch in gpt2_batches(3, 2):
            loss = gpt2_loss(run, batch)
            run.backward(loss)
            run.step()
            out.append(loss.item())
        losses.append(out)
        run.close()
    assert losses[0] == losses[1]


def test_auto_on_a_host_too_small_keeps_every_partition_on_nvme(disk_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "host_memory", lambda: fake_cgroup(tmp_path, limit=GiB, usage=GiB - (64 << 20)))
    engine, *_ = initialize(model=gpt2(), config=config_for(disk_dir))
    assert engine.plan.max_in_cpu == 0 and engine.plan.in_memory[0] == 0  # 1 byte: no partition fits
    engine.close()


def test_auto_is_accepted_where_written_and_a_misspelling_is_refused(disk_dir):
    config = config_for(disk_dir)
    assert resolve_auto(config)["zero_optimization"]["offload_param"]["max_in_cpu"] == "auto"
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = "Auto"
    with pytest.raises(ValueError, match="offload_param.max_in_cpu: 'Auto' is not allowed; use an integer >= 0 "
                                         "\\(elements\\) or \"auto\""):
        EngineConfig.from_dict(config, world_size=1)


@pytest.mark.simulated
def test_auto_on_a_device_loads_its_runtime_before_it_reads_the_room(disk_dir, tmp_path, monkeypatch):
    """A GPU's math libraries take host memory at their first call (an H200 run was killed for it):
    "auto" reads the available memory only after the compute device has loaded them."""
    from offload.device import SimulatedDevice

    events = []
    memory = fake_cgroup(tmp_path, limit=4 * GiB, usage=GiB)
    monkeypatch.setattr(sizing, "host_memory", lambda: events.append("memory read") or memory)

    class Device(SimulatedDevice):
        def load_runtime(self, dtype):
            events.append(f"runtime loaded ({dtype})")

    with Device() as device:
        engine, *_ = initialize(model=gpt2(dropout=0.0), config=config_for(disk_dir), compute_device=device)
        engine.close()
    assert events[:2] == ["runtime loaded (torch.float32)", "memory read"]
