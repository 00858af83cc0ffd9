"""A worker of tests/test_zero_init.py's two-rank test: `offload.zero.GatheredParameters` inside a
`offload.zero.Init` block, on the CPU over gloo, as Hugging Face's weight init and
``resize_token_embeddings`` use it. Each case changes a parameter on every rank inside the block, the
modifier rank to known values and the others to junk; each rank reports, per case, its partition after
the Init block and the values that must be kept (the modifier's, or with ``modifier_rank=None`` those
gathered before the change)."""

import sys

import torch
from torch import nn

from tests.torchrun import finish, report

LIMIT = 600
"""offload_param.buffer_size: when the cases below start, the build has placed the first parameters and
holds the last five in memory as built (pending)."""


def config(placement: str, nvme_path: str) -> dict:
    offload_param = {"device": placement, "buffer_size": LIMIT, "buffer_count": 2}
    if placement == "nvme":
        offload_param.update(nvme_path=nvme_path, max_in_cpu=0)
    return {"train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 8, "offload_param": offload_param,
                                  "offload_optimizer": {"device": "none"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(16, 8), nn.Linear(8, 8))


def change(p: nn.Parameter, rank: int, modifier: int | None, salt: float) -> list[float]:
    """Inside the block: the modifier rank writes known values, the others junk. Returns what must be kept."""
    if rank == modifier:
        p.data.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) * 0.25 + salt)
        return p.detach().flatten().tolist()
    before = p.detach().flatten().tolist()
    p.data.fill_(-1000.0 - rank)
    return before if modifier is None else []


def main(placement: str, nvme_path: str) -> None:
    import torch.distributed as dist

    from offload import zero
    from offload.params.construct import built_store
    from offload.params.store import find_record

    kept: dict[str, list[float]] = {}
    with zero.Init(config_dict_or_path=config(placement, nvme_path)):
        model = build()
        rank = dist.get_rank()
        cases = [  # (case, parameter, modifier_rank): the state each parameter is in when its block starts
            ("pending, modifier 0", model[3].weight, 0),
            ("pending, modifier 1", model[2].bias, 1),
            ("pending persistent, modifier 0", model[3].bias, 0),
            ("pending, read only", model[4].weight, None),
            ("placed, modifier 0", model[0].weight, 0),
            ("placed, modifier 1", model[2].weight, 1),
            ("placed, read only", model[0].bias, None),
            ("gathered by the build, modifier 0", model[1].weight, 0),
        ]
        assert all(find_record(p) is None for _, p, _ in cases[:4]), "expected pending parameters"
        assert all(p.untyped_storage().nbytes() <= p.element_size() for _, p, _ in cases[4:])  # placeholders
        for salt, (case, p, modifier) in enumerate(cases):
            if case.startswith("gathered"):
                nn.init.constant_(p, 0.5)  # a re-initialisation of a placed weight: the build gathers it back
            with zero.GatheredParameters(p, modifier_rank=modifier):
                kept[case] = change(p, rank, modifier, float(salt))
    store = built_store(model)
    partitions = {case: store.read_partition(find_record(p)[1]).tolist() for case, p, _ in cases}
    report({"kept": kept, "partitions": partitions, "numel": {case: p.numel() for case, p, _ in cases},
            "modifier": {case: modifier for case, _, modifier in cases}})
    del model, store
    finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
