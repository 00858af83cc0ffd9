"""Training through the trainers people already use, on the stage-3 engine (docs/trainer_hf.md,
docs/lightning.md, docs/accelerate.md).

One module per trainer; each imports its trainer only when it is imported itself, so that
``import offload`` never needs transformers' Trainer, Lightning or Accelerate:

- `offload.integrations.transformers`: `OffloadTrainer`, a ``transformers.Trainer`` subclass;
- `offload.integrations.lightning`: `OffloadStrategy`, registered as "offload_stage_3" and
  "offload_stage_3_nvme";
- `offload.integrations.accelerate`: `OffloadAccelerator`, an ``accelerate.Accelerator`` subclass.
"""

from offload.integrations.config import trainer_config

__all__ = ["trainer_config"]
