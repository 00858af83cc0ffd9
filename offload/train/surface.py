"""The parts of DeepSpeed's engine surface that trainers call, kept out of the engine's core.

`initialize`'s DeepSpeed-only arguments (``args``, ``dist_init_required``, ``mpu``, ...), the mapping of
a client optimizer's (or ``model_parameters``') param groups onto the engine's partitions, and
``_zero3_consolidated_16bit_state_dict``. Hugging Face's Trainer, Accelerate and Lightning call these
on a DeepSpeed engine; `offload.train.engine.Engine` delegates to them.
"""

from __future__ import annotations

import collections
import functools
import logging
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch
from torch import nn

from offload.params import ParamRecord
from offload.train.step.failure import checksum_error_in

__all__ = ["check_distributed_arguments", "check_load_arguments", "config_from_arguments", "consolidated_state_dict",
           "engine_call", "guard_misuse", "in_optimizer_order", "optimizer_param_groups", "refuse_backward_outside",
           "refuse_forward_outside", "refuse_optimizer_step_outside", "save_pretrained_gathered", "step_scheduler"]

log = logging.getLogger("offload")

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""The keys of a param group that OffloadAdam's groups take over from a client's."""


def config_from_arguments(args: Any, config: Any, config_params: Any) -> Any:
    """The config `initialize` uses, found as DeepSpeed finds it: ``config``, else ``config_params``
    (its older name), else ``args.deepspeed_config`` (the path DeepSpeed's argument parser adds).

    Raises ValueError when two of them are given, or none.
    """
    if config is not None and config_params is not None:
        raise ValueError("config, config_params: both given; they are the same argument (config_params is "
                         "DeepSpeed's older name), pass one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ValueError(f"config: given to initialize() and as args.deepspeed_config ({from_args!r}); pass one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("config: missing; pass config=<dict or path of a DeepSpeed-format JSON config> "
                         "(or args with a deepspeed_config path)")
    return config


def check_distributed_arguments(dist_init_required: bool | None, mpu: Any, mesh_param: Any,
                                world_size_from_env: int) -> None:
    """Refuse, naming the argument, what `initialize` cannot do: model parallelism (``mpu``,
    ``mesh_param``), and ``dist_init_required=False`` when torchrun asks for several ranks but no
    process group exists (DeepSpeed would fail later, in its first collective)."""
    if mpu is not None:
        raise ValueError("mpu: model parallelism is not supported; the engine is data parallel only (pass mpu=None)")
    if mesh_param is not None:
        raise ValueError("mesh_param: model or sequence parallel meshes are not supported; the engine is data "
                         "parallel only (pass mesh_param=None)")
    if dist_init_required is False and world_size_from_env > 1 and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"dist_init_required=False: WORLD_SIZE is {world_size_from_env} but no process group "
                         f"exists; call torch.distributed.init_process_group first, or pass dist_init_required=None")


def optimizer_param_groups(trainable: list[ParamRecord], client: Any, model_parameters: Iterable[Any] | None
                           ) -> list[dict[str, Any]]:
    """The optimizer's param groups over the engine's partitions, as the caller grouped the model's parameters.

    The groups come from a client ``torch.optim.Adam``/``AdamW`` (its ``param_groups``), else from
    ``model_parameters`` when it holds dicts (DeepSpeed's way to give the config's optimizer several
    groups, e.g. decay and no decay), else one group of every trainable parameter. Each group keeps its
    own ``lr``, ``betas``, ``eps`` and ``weight_decay``; the rest come from the optimizer's defaults.

    Raises ValueError naming the parameter when a trainable parameter is in no group or in two, and
    naming the group for amsgrad or maximize (OffloadAdam has neither).
    """
    if isinstance(client, (torch.optim.Adam, torch.optim.AdamW)):
        source = client.param_groups
    elif model_parameters is not None:
        given = list(model_parameters)
        source = given if given and all(isinstance(g, Mapping) for g in given) else None
    else:
        source = None
    if source is None:  # one group: every trainable partition, in the records' order
        return [{"params": [rec.partition for rec in trainable]}]
    by_param = {id(rec.param): rec for rec in trainable}
    placed: dict[int, int] = {}
    groups = []
    for g, group in enumerate(source):
        if group.get("amsgrad") or group.get("maximize"):
            key = "amsgrad" if group.get("amsgrad") else "maximize"
            raise ValueError(f"param group {g}: {key}=True is not supported by the engine's OffloadAdam; use False")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        partitions = []
        for p in params:
            rec = by_param.get(id(p))
            if rec is None:  # a frozen parameter, or not one of the model's
                continue
            if id(p) in placed:
                raise ValueError(f"parameter {rec.name!r} is in param groups {placed[id(p)]} and {g}; put it in one")
            placed[id(p)] = g
            partitions.append(rec.partition)
        groups.append({"params": partitions, **{k: group[k] for k in _HYPERPARAMETERS if k in group}})
    missing = [rec.name for rec in trainable if id(rec.param) not in placed]
    if missing:
        raise ValueError(f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} are trainable but in no param "
                         f"group of the optimizer; add them to a group or set requires_grad=False")
    return [group for group in groups if group["params"]]


def in_optimizer_order(trainable: list[ParamRecord], groups: list[dict[str, Any]]) -> list[ParamRecord]:
    """``trainable``'s records in the order the optimizer built over ``groups`` numbers its parameters
    (group by group): the order the engine's parts that index the optimizer's parameters rely on."""
    by_partition = {id(rec.partition): rec for rec in trainable}
    return [by_partition[id(p)] for group in groups for p in group["params"]]


def consolidated_state_dict(module: nn.Module, full_parameters: Iterable[tuple[str, torch.Tensor]], *,
                            rank: int, exclude_frozen_parameters: bool = False
                            ) -> "collections.OrderedDict[str, torch.Tensor] | None":
    """The whole model's state dict from ``full_parameters`` (the engine's gathered copies, in the
    training dtype) plus the module's persistent buffers, as DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict``: on rank 0; None on the other ranks, which must iterate
    too (each gather is a collective). Tied parameters share one tensor under each of their names."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state: collections.OrderedDict[str, torch.Tensor] | None = collections.OrderedDict() if rank == 0 else None
    for name, full in full_parameters:
        if state is not None and not (exclude_frozen_parameters and name in frozen):
            state[name] = full
    if state is not None:
        for prefix, sub in module.named_modules():
            for name, buffer in sub.named_buffers(recurse=False):
                if buffer is not None and name not in sub._non_persistent_buffers_set:
                    state[f"{prefix}.{name}" if prefix else name] = buffer.detach().clone()
    return state


def check_load_arguments(config: Any, *, load_optimizer_states: bool, load_module_only: bool,
                         custom_load_fn: Any) -> bool:
    """Whether `Engine.load_checkpoint` loads the optimizer's state. Raises ValueError naming the
    argument for ``custom_load_fn`` (DeepSpeed's hook for its own module format) and for skipping the
    optimizer's state under fp16/bf16, where the fp32 master weights are part of it (the parameters
    would load and the next step would overwrite them from the old master copies)."""
    if custom_load_fn is not None:
        raise ValueError("custom_load_fn: not supported; checkpoints are safetensors files read by the engine")
    load_optimizer = load_optimizer_states and not load_module_only
    if not load_optimizer and (config.fp16.enabled or config.bf16.enabled):
        raise ValueError("load_optimizer_states=False / load_module_only=True: not supported with fp16 or bf16, "
                         "whose fp32 master weights are optimizer state; load the whole checkpoint, or the "
                         "weights alone with engine.load_pretrained")
    return load_optimizer


def save_pretrained_gathered(engine: Any) -> None:
    """Make ``save_pretrained`` of ``engine.module`` and of every submodule that has one (a transformers
    model inside a LightningModule) write the real weights: called without ``state_dict``, it is given
    the engine's consolidated one (the submodule's part of it; every rank must call it, as with
    DeepSpeed's). Without this, the partitioned parameters' empty tensors would be written, silently.
    After ``engine.close()`` it raises RuntimeError naming `save_16bit_model`."""
    ref = weakref.ref(engine)
    for prefix, module in engine.module.named_modules():
        original = getattr(module, "save_pretrained", None)
        if callable(original):
            module.save_pretrained = _gathered_save(ref, original, prefix)


def _gathered_save(ref: Any, original: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_pretrained(*args: Any, state_dict: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> Any:
        if state_dict is None:
            live = ref()
            if live is None or live.closed:
                raise RuntimeError("save_pretrained: the model's parameters are partitioned and their engine is "
                                   "closed; save with engine.save_16bit_model(dir) or "
                                   "engine._zero3_consolidated_16bit_state_dict() before closing it")
            state_dict = live._zero3_consolidated_16bit_state_dict()
            if live.rank != 0:
                return None
            if prefix:  # a submodule's own names
                state_dict = {name[len(prefix) + 1:]: tensor for name, tensor in state_dict.items()
                              if name.startswith(prefix + ".")}
        return original(*args, state_dict=state_dict, **kwargs)

    return save_pretrained


_ORDER_WARNINGS = r"(Detected call of `lr_scheduler\.step\(\)` before|Seems like `optimizer\.step\(\)` has been overridden)"
"""torch's checks that ``optimizer.step()`` ran before ``lr_scheduler.step()``: the engine runs the update
itself (during backward, in the next forward or in chunks), not always through ``optimizer.step()``."""


def step_scheduler(scheduler: Any, lr_kwargs: Mapping[str, Any]) -> None:
    """Step the engine's learning-rate schedule after an update, without torch's call-order warnings
    (they do not apply: the update the schedule follows has been handed over or run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ORDER_WARNINGS, category=UserWarning)
        scheduler.step(**lr_kwargs)


def refuse_forward_outside(engine: Any) -> None:
    """Refuse, with an error saying what to call, a forward with gradients of ``engine.module`` that does
    not go through the engine: its parameters are partitioned, and only the engine's forward lets the
    backward gather them again (it would fail deep inside autograd: "mat2 must be a matrix"). Forwards
    under ``torch.no_grad()`` (evaluation, ``generate``) are let through."""
    ref = weakref.ref(engine)

    def check(module: nn.Module, args: Any) -> None:
        live = ref()
        if torch.is_grad_enabled() and (live is None or not live.forwarding):
            raise RuntimeError("a forward with gradients of engine.module outside the engine: its parameters are "
                               "partitioned, and only the engine's forward lets backward gather them; call "
                               "engine(...) (and engine.backward(loss)), or run under torch.no_grad() to evaluate; "
                               "with a trainer, use offload.integrations (OffloadTrainer for Hugging Face's Trainer, "
                               "OffloadStrategy, OffloadAccelerator)")

    engine.module.register_forward_pre_hook(check)


_Method = TypeVar("_Method", bound=Callable[..., Any])

_STOPPING = ("forward", "backward", "step")
"""The engine's calls whose errors not agreed by the ranks stop every rank (`engine._stop`)."""


def engine_call(method: _Method) -> _Method:
    """Mark an `Engine` method as one of the engine's own calls (forward, backward, step, a settle):
    while one runs, gradients may arrive and the engine's optimizer may step (``engine._calls`` counts
    them; `refuse_backward_outside` and `refuse_optimizer_step_outside` refuse both outside them). Refuses
    every call once the ranks stopped; an error of forward, backward or step that the ranks did not agree
    stops them (``engine._stop``, `offload.train.step.stop.RankStop`)."""

    name = method.__name__
    stops = name in _STOPPING

    @functools.wraps(method)
    def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
        engine._failure.check_stopped(f"call {name}()")  # every rank stopped: the process group is closed
        engine._calls += 1
        try:
            return method(engine, *args, **kwargs)
        except BaseException as error:
            # Several ranks: an error the ranks did not agree stops every rank (offload/train/step/stop.py).
            raised = engine._stop.after(error, where=name, step=engine.global_steps + 1) if stops else error
            corrupt = checksum_error_in(error)
            if corrupt is not None:  # given up as any failure above; then nothing on disk is trusted
                engine._failure.corrupt(corrupt)
            if getattr(raised, "needs_load", False):  # `RanksFailed`: another rank needs a load, so every rank does
                engine._failure.another_rank(str(raised))
            if raised is not error:
                raise raised from error
            raise
        finally:
            engine._calls -= 1

    return call  # type: ignore[return-value]


def refuse_backward_outside(engine: Any) -> None:
    """Refuse, with an error saying what to call, a backward of the engine's model that does not go
    through ``engine.backward`` (``loss.backward()``, or a trainer's own backward): the engine must begin
    the step its gradients feed (with clipping or fp16 that step would otherwise be left under way, and a
    later call would fail with "a step is under way"). Raised at the first gradient, before any is taken."""
    ref = weakref.ref(engine)

    def check(grad: torch.Tensor) -> None:
        live = ref()
        if live is not None and not live._calls:
            live._store.end_backward()  # what the backward gathered before reaching this gradient
            raise RuntimeError("a backward of the engine's model outside the engine (loss.backward(), or a "
                               "trainer's own backward): call engine.backward(loss), which reduces the gradients "
                               "to their partitions and runs or hands over the update, then engine.step()")

    for rec in engine.records:
        if rec.accumulator is not None:  # the parameter's own hook: autograd may replace its AccumulateGrad node
            rec.param.register_hook(check)


def refuse_optimizer_step_outside(engine: Any) -> None:
    """Refuse, with an error saying what to call, ``engine.optimizer.step()`` called by anyone but the
    engine: the engine steps its optimizer in ``engine.step()`` (or hands the update to the next forward),
    and a second, direct step would end that step early (silently wrong parameters with clipping, or a
    later "a step is under way"). A trainer that calls ``optimizer.step()`` itself must be given a no-op
    (Accelerate's ``DeepSpeedOptimizerWrapper``, as `OffloadTrainer` and `OffloadAccelerator` do)."""
    optimizer = engine.optimizer
    step = optimizer.step
    ref = weakref.ref(engine)

    def guarded_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        live = ref()
        if live is not None and not live._calls and not live.closed:
            raise RuntimeError("engine.optimizer.step() called directly: the engine steps its optimizer in "
                               "engine.step() (after engine.backward(loss), at each gradient accumulation boundary); "
                               "call engine.step() instead, and make a trainer's own optimizer.step() a no-op "
                               "(accelerate.utils.DeepSpeedOptimizerWrapper)")
        self._opt_called = True  # what torch's schedulers track (a scheduler rebound onto this optimizer too)
        return step(*args, **kwargs)

    # Marked as torch's schedulers mark the step they wrap, so that a scheduler moved onto this optimizer
    # (Lightning, Accelerate) does not warn that the step was overridden.
    guarded_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(guarded_step, optimizer)


def guard_misuse(engine: Any) -> None:
    """Make misuse of a new engine a clear error or the right result: ``save_pretrained`` writes the
    gathered weights (`save_pretrained_gathered`); a forward with gradients, a backward and an optimizer
    step outside the engine are refused (`refuse_forward_outside`, `refuse_backward_outside`,
    `refuse_optimizer_step_outside`). Starts the counters they read: ``engine.forwarding`` (forwards
    running through the engine) and ``engine._calls`` (the engine's own calls under way, `engine_call`)."""
    engine.forwarding = 0
    engine._calls = 0
    save_pretrained_gathered(engine)
    refuse_forward_outside(engine)
    refuse_backward_outside(engine)
    refuse_optimizer_step_outside(engine)
