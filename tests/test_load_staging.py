"""What the verified checkpoint load stages through, without a disk: `host_copy` (one thread's memcpy, any
dtype), the optimizer's `fill` (every element of a sub-group's state written, whatever the buffer held before,
in the order the read-ahead planned), and the reader's buffer size classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offload.optim.state_io import fill, load_reads
from offload.optim.subgroups import ParamSpec, plan_subgroups
from offload.storage.host_copy import host_copy
from offload.train.checkpoint.reader import READ_BUFFER_BYTES, buffer_bytes
from tensorio import DIRECT_ALIGN

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 4095, 4096 * 10 + 1])
def test_host_copy_copies_every_dtype_bit_for_bit(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    src = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=g).view(dtype)
    dst = torch.zeros(numel, dtype=dtype)
    assert host_copy(dst, src) is dst
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))  # bytes: NaN payloads included


def test_host_copy_into_a_slice_leaves_the_rest():
    dst = torch.full((10,), -1.0, dtype=torch.bfloat16)
    host_copy(dst[3:7], torch.arange(4, dtype=torch.bfloat16))
    assert dst.tolist() == [-1, -1, -1, 0, 1, 2, 3, -1, -1, -1]


def test_host_copy_takes_copy_s_way_for_what_a_memcpy_cannot_do():
    wide = torch.arange(12, dtype=torch.float32).view(3, 4)
    dst = torch.zeros(4, 3)
    host_copy(dst, wide.t())  # strided source
    assert torch.equal(dst, wide.t())
    half = torch.zeros(5, dtype=torch.bfloat16)
    host_copy(half, torch.arange(5, dtype=torch.float32))  # a conversion
    assert half.tolist() == [0, 1, 2, 3, 4]
    row = torch.zeros(2, 3)
    host_copy(row, torch.tensor([1.0, 2.0, 3.0]))  # broadcast, as copy_ does
    assert row.tolist() == [[1, 2, 3], [1, 2, 3]]
    with pytest.raises(RuntimeError):
        host_copy(torch.zeros(4), torch.zeros(5))


def test_fill_writes_every_element_of_a_buffer_that_held_garbage():
    # awkward sizes: members padded to 16 elements inside a region padded to whole pages, one split across two
    specs = [ParamSpec(5, False), ParamSpec(4095, False), ParamSpec(1, False), ParamSpec(3000, False)]
    plans = plan_subgroups([specs], 4096, 1.0)
    steps = {0: 1.0, 1: 1.0, 3: 2.0}  # parameter 2 has no state: zeros
    layout = {f"{i}.{key}": spec.numel for i, spec in enumerate(specs) if i in steps
              for key in ("exp_avg", "exp_avg_sq")}
    params = [SimpleNamespace(param=torch.zeros(spec.numel)) for spec in specs]

    def values(index, key, start, stop):
        return torch.arange(start, stop, dtype=torch.float32) + 1000 * index + (0.5 if key == "exp_avg_sq" else 0)

    for plan, planned in zip(plans, load_reads(plans, steps, layout)):
        asked = []

        def get(index, key, start, stop):
            asked.append((f"{index}.{key}", start, stop))
            return values(index, key, start, stop)
        regions = list(torch.full((plan.regions * plan.region,), float("nan")).split(plan.region))
        fill(plan, regions, steps, get, params)
        assert asked == planned  # the order `ReadAhead` started them in
        for key, region in zip(("exp_avg", "exp_avg_sq"), regions):
            expected = torch.zeros(plan.region)
            for member in plan.members:
                if member.param in steps:
                    run = values(member.param, key, member.start, member.start + member.numel)
                    expected[member.offset:member.offset + member.numel] = run
            assert torch.equal(region, expected), f"sub-group {plan.index} {key}: padding or a run not written"


def test_read_buffers_come_in_a_few_size_classes():
    slack = 2 * DIRECT_ALIGN
    classes = {buffer_bytes(n) for n in range(0, 70 << 20, 1 << 18)}
    assert len(classes) <= 8  # 1, 2, 4, ... 64 MiB and one multiple of 64 MiB in this range
    for n in (0, 1, 4095, (1 << 20) + slack, (1 << 20) + slack + 1, (9 << 20) + 3, 64 << 20, READ_BUFFER_BYTES,
              READ_BUFFER_BYTES + 1, 3 * READ_BUFFER_BYTES - 1):
        size = buffer_bytes(n)
        assert size >= n
        assert size < max(2 * n, (1 << 20) + slack) + slack  # never more than about twice the read
        assert size - slack in {1 << k for k in range(20, 26 + 1)} or size % READ_BUFFER_BYTES == 0
