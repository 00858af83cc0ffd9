"""Training sections of the config: ``fp16``, ``bf16``, ``optimizer`` and ``scheduler``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from offload.config.parse import boolean, build, choice, integral, number, section_values

OPTIMIZERS = ("Adam", "AdamW")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


@dataclass(kw_only=True, slots=True)
class Fp16Config:
    """Mixed precision with fp16 weights and a loss scale (``fp16``)."""

    _KEY: ClassVar[str] = "fp16"

    enabled: bool = False
    """Train in fp16."""

    loss_scale: float = 0.0
    """A fixed loss scale, or 0 for a dynamic one that starts at 2**initial_scale_power."""

    initial_scale_power: int = 16
    """The dynamic loss scale starts at 2 to this power. From 0 to 64."""

    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic loss scale doubles. At least 1."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale is halved. At least 1."""

    min_loss_scale: float = 1.0
    """The dynamic loss scale never drops below this. Greater than 0."""

    def __post_init__(self) -> None:
        key = self._KEY
        self.enabled = boolean(f"{key}.enabled", self.enabled)
        self.loss_scale = number(f"{key}.loss_scale", self.loss_scale, minimum=0)
        self.initial_scale_power = integral(f"{key}.initial_scale_power", self.initial_scale_power, minimum=0)
        if self.initial_scale_power > 64:
            raise ValueError(f"{key}.initial_scale_power: {self.initial_scale_power} is not allowed; use 0 to 64")
        self.loss_scale_window = integral(f"{key}.loss_scale_window", self.loss_scale_window, minimum=1)
        self.hysteresis = integral(f"{key}.hysteresis", self.hysteresis, minimum=1)
        self.min_loss_scale = number(f"{key}.min_loss_scale", self.min_loss_scale, minimum=0)
        if self.min_loss_scale == 0:
            raise ValueError(f"{key}.min_loss_scale: 0 is not allowed; use a number > 0 such as 1")


@dataclass(kw_only=True, slots=True)
class Bf16Config:
    """Mixed precision with bf16 weights and no loss scale (``bf16``, also spelled ``bfloat16``)."""

    _KEY: ClassVar[str] = "bf16"

    enabled: bool = False
    """Train in bf16."""

    def __post_init__(self) -> None:
        self.enabled = boolean(f"{self._KEY}.enabled", self.enabled)


@dataclass(kw_only=True, slots=True)
class AdamParams:
    """Hyperparameters of Adam and AdamW (``optimizer.params``)."""

    _KEY: ClassVar[str] = "optimizer.params"

    lr: float = 1e-3
    """Learning rate. At least 0."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates, each in [0, 1)."""

    eps: float = 1e-8
    """Added to the denominator for numerical stability. At least 0."""

    weight_decay: float = 0.0
    """Weight decay. At least 0."""

    adam_w_mode: bool = True
    """For type "Adam": decouple weight decay from the gradient as AdamW does. DeepSpeed's default is true,
    so its "Adam" is AdamW unless this is false; false gives torch.optim.Adam's L2 penalty."""

    def __post_init__(self) -> None:
        key = self._KEY
        self.lr = number(f"{key}.lr", self.lr, minimum=0)
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"{key}.betas: expected a list of two numbers such as [0.9, 0.999], got {betas!r}")
        beta1, beta2 = (number(f"{key}.betas", beta, minimum=0) for beta in betas)
        if beta1 >= 1 or beta2 >= 1:
            raise ValueError(f"{key}.betas: {list(betas)!r} is not allowed; each beta must be in [0, 1)")
        self.betas = (beta1, beta2)
        self.eps = number(f"{key}.eps", self.eps, minimum=0)
        self.weight_decay = number(f"{key}.weight_decay", self.weight_decay, minimum=0)
        self.adam_w_mode = boolean(f"{key}.adam_w_mode", self.adam_w_mode)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer the engine steps on the partitions (``optimizer``)."""

    _KEY: ClassVar[str] = "optimizer"

    type: str
    """"Adam" or "AdamW" (any letter case, as DeepSpeed reads it); stored in the spelling shown here."""

    params: AdamParams = field(default_factory=AdamParams)
    """Hyperparameters."""

    def __post_init__(self) -> None:
        spelled = {name.lower(): name for name in OPTIMIZERS}
        if not isinstance(self.type, str) or self.type.lower() not in spelled:
            raise ValueError(
                f"{self._KEY}.type: {self.type!r} is not supported; use one of {', '.join(OPTIMIZERS)}"
            )
        self.type = spelled[self.type.lower()]
        if self.type == "AdamW" and not self.params.adam_w_mode:
            raise ValueError(
                f'{self._KEY}.params.adam_w_mode: false contradicts type "AdamW"; use type "Adam" for '
                f"L2 weight decay, or remove adam_w_mode"
            )

    @property
    def decoupled_weight_decay(self) -> bool:
        """True when weight decay is applied as AdamW does (type "AdamW", or "Adam" with adam_w_mode)."""
        return self.type == "AdamW" or self.params.adam_w_mode

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "OptimizerConfig":
        """Build from an ``optimizer`` section. Raises ValueError naming the dotted key of a bad entry."""
        values = section_values(section, cls._KEY, {f.name for f in fields(cls)})
        if "type" not in values:
            raise ValueError(f'{cls._KEY}.type: missing; add "type": "AdamW" (or "Adam")')
        if "params" in values:
            values["params"] = build(AdamParams, values["params"])
        return cls(**values)


@dataclass(kw_only=True, slots=True)
class WarmupParams:
    """Learning-rate schedule parameters (``scheduler.params``)."""

    _KEY: ClassVar[str] = "scheduler.params"

    warmup_min_lr: float = 0.0
    """Learning rate at step 0. At least 0."""

    warmup_max_lr: float = 1e-3
    """Learning rate at the end of the warm-up. At least 0."""

    warmup_num_steps: int = 1000
    """Steps of the warm-up. At least 0."""

    warmup_type: str = "log"
    """Shape of the warm-up: "log" (DeepSpeed's default) or "linear"."""

    total_num_steps: int | None = None
    """WarmupDecayLR only, and required there: step at which the rate has decayed linearly to 0."""

    def __post_init__(self) -> None:
        key = self._KEY
        self.warmup_min_lr = number(f"{key}.warmup_min_lr", self.warmup_min_lr, minimum=0)
        self.warmup_max_lr = number(f"{key}.warmup_max_lr", self.warmup_max_lr, minimum=0)
        self.warmup_num_steps = integral(f"{key}.warmup_num_steps", self.warmup_num_steps, minimum=0)
        self.warmup_type = choice(f"{key}.warmup_type", self.warmup_type, ("log", "linear"))
        if self.total_num_steps is not None:
            self.total_num_steps = integral(f"{key}.total_num_steps", self.total_num_steps, minimum=1)


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """The learning-rate schedule (``scheduler``)."""

    _KEY: ClassVar[str] = "scheduler"

    type: str
    """"WarmupLR" (warm up, then hold) or "WarmupDecayLR" (warm up, then decay linearly to 0)."""

    params: WarmupParams = field(default_factory=WarmupParams)
    """Schedule parameters."""

    def __post_init__(self) -> None:
        key = self._KEY
        self.type = choice(f"{key}.type", self.type, SCHEDULERS)
        total = self.params.total_num_steps
        if self.type == "WarmupLR" and total is not None:
            raise ValueError(
                f"{key}.params.total_num_steps: WarmupLR does not decay, so it has no total_num_steps; "
                f'remove it or use type "WarmupDecayLR"'
            )
        if self.type == "WarmupDecayLR":
            if total is None:
                raise ValueError(f"{key}.params.total_num_steps: missing; WarmupDecayLR needs it")
            if total < self.params.warmup_num_steps:
                raise ValueError(
                    f"{key}.params.total_num_steps: {total} is less than warmup_num_steps "
                    f"({self.params.warmup_num_steps}); make it at least that"
                )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "SchedulerConfig":
        """Build from a ``scheduler`` section. Raises ValueError naming the dotted key of a bad entry."""
        values = section_values(section, cls._KEY, {f.name for f in fields(cls)})
        if "type" not in values:
            raise ValueError(f'{cls._KEY}.type: missing; add "type": "WarmupLR" (or "WarmupDecayLR")')
        if "params" in values:
            values["params"] = build(WarmupParams, values["params"])
        return cls(**values)
