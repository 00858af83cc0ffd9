"""Training: the ZeRO stage-3 engine and what it is made of.

`engine` assembles and runs it (`initialize`, `Engine`); `checkpoint` saves and loads its state;
`grads` reduces gradients to their partitions; `writeback` writes partitions updated during
backward; `loss_scaler`, `schedulers`, `clip` and `timers` are the DeepSpeed features of the same
names.
"""

from offload.train.engine import Engine, initialize
from offload.train.grads.clip import clip_grad_norm_, grad_norm
from offload.train.grads.loss_scaler import DynamicLossScaler, LossScaler, StaticLossScaler, build_loss_scaler
from offload.train.schedulers import WarmupDecayLR, WarmupLR, build_scheduler
from offload.train.step.agree import RanksFailed
from offload.train.step.stop import RanksStopped
from offload.train.timers import PhaseTimers

__all__ = [
    "DynamicLossScaler",
    "Engine",
    "LossScaler",
    "PhaseTimers",
    "RanksFailed",
    "RanksStopped",
    "StaticLossScaler",
    "WarmupDecayLR",
    "WarmupLR",
    "build_loss_scaler",
    "build_scheduler",
    "clip_grad_norm_",
    "grad_norm",
    "initialize",
]
