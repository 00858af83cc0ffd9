"""The engine's config layer: DeepSpeed-format files load, "auto" resolves, every bad value is named."""

import copy
import json
import os
import pathlib
import warnings

import pytest

from offload.config import (
    EngineConfig,
    check_against_model,
    check_nvme_paths,
    resolve_auto,
    world_size_from_env,
)

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("zero*.json"))  # training configs (inference_*.json: test_first_hour.py)
MANUAL = [path for path in ALL_CONFIGS if "auto" not in path.read_text() and "manual" in path.name]
SHIPPED = [path for path in ALL_CONFIGS if "auto" not in path.read_text() and "manual" not in path.name]
"""The configs that run as they are (issue 27): tests/test_first_hour.py trains with each."""

# Sample training arguments as Hugging Face's Trainer would pass them (bf16 run, GPT-2-small-sized model).
ARGS = dict(
    micro_batch_size=4, gradient_accumulation_steps=2, hidden_size=768, lr=5e-5, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01, warmup_steps=100, total_steps=1000, max_grad_norm=1.0, fp16=False, bf16=True,
)

# The same arguments for the manual files, agreeing with what they write out (Hugging Face refuses a mismatch).
MANUAL_ARGS = dict(
    micro_batch_size=4, gradient_accumulation_steps=2, hidden_size=768, lr=3e-5, betas=(0.8, 0.999), eps=1e-8,
    weight_decay=3e-7, warmup_steps=500, fp16=True, bf16=False,
)

# A small, valid stage-3 config that the error tests below break one key at a time.
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_size": 1000},
        "offload_optimizer": {"device": "cpu"},
    },
}


def load(config, world_size=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # stage < 3 warns; tested on its own below
        return EngineConfig.from_dict(config, world_size=world_size)


def changed(path, value):
    """BASE with the dotted ``path`` set to ``value`` (or removed when value is ...)."""
    config = copy.deepcopy(BASE)
    *parents, name = path.split(".")
    node = config
    for parent in parents:
        node = node.setdefault(parent, {})
    if value is ...:
        del node[name]
    else:
        node[name] = value
    return config


def test_configs_directory_is_populated():
    names = {path.name for path in ALL_CONFIGS}
    assert {"zero2_auto.json", "zero3_auto.json", "zero3_nvme_offload_auto.json", "zero2_bfloat16_auto.json"} <= names
    assert {path.name for path in MANUAL} == {"zero2_manual.json", "zero3_manual.json"}
    assert {path.name for path in SHIPPED} == {"zero3_nvme_offload.json", "zero3_bf16_nvme_offload.json",
                                               "zero3_cpu_optimizer.json"}


@pytest.mark.parametrize("path", [path for path in ALL_CONFIGS if path not in SHIPPED], ids=lambda p: p.name)
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_example_config_loads_after_resolving_auto(path, world_size):
    raw = resolve_auto(path, **(MANUAL_ARGS if path in MANUAL else ARGS))
    assert "auto" not in json.dumps(raw)
    config = load(raw, world_size)
    assert config.world_size == world_size
    assert config.train_micro_batch_size_per_gpu == 4
    assert config.gradient_accumulation_steps == 2
    assert config.train_batch_size == 4 * 2 * world_size
    zero = config.zero_optimization
    if zero.stage == 3:
        assert zero.stage3_param_persistence_threshold in (10 * 768, 10_000)
    assert config.fp16.enabled == (path in MANUAL)
    assert config.bf16.enabled == (path not in MANUAL)  # bf16=True enables it even where the file has no bf16


def test_manual_args_that_contradict_the_file_are_refused():
    with pytest.raises(ValueError, match=r"^fp16\.enabled: the config says True but fp16=False"):
        resolve_auto(CONFIGS / "zero3_manual.json", fp16=False)
    with pytest.raises(ValueError, match=r"^optimizer\.params\.lr: the config says 3e-05 but lr=5e-05"):
        resolve_auto(CONFIGS / "zero3_manual.json", lr=5e-5)


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: p.name)
def test_manual_configs_load_without_resolution(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        config = EngineConfig.from_file(path, world_size=2)
    assert config.fp16.enabled and config.fp16.loss_scale == 0 and config.fp16.initial_scale_power == 16
    assert config.optimizer.type == "AdamW" and config.optimizer.params.betas == (0.8, 0.999)
    assert config.optimizer.params.lr == 3e-5 and config.optimizer.params.weight_decay == 3e-7
    assert config.scheduler.type == "WarmupLR" and config.scheduler.params.warmup_num_steps == 500
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.steps_per_print == 2000
    # no batch keys in the file: micro batch 1, no accumulation, as many samples per step as ranks
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (2, 1, 1)


def test_zero3_manual_values_are_integers():
    zero = EngineConfig.from_file(CONFIGS / "zero3_manual.json", world_size=1).zero_optimization
    assert zero.sub_group_size == 10**9 and type(zero.sub_group_size) is int
    assert zero.reduce_bucket_size == 1_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.stage3_prefetch_bucket_size == 940_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize(
    "name, key",
    [("zero3_auto.json", "gradient_accumulation_steps"), ("zero2_auto.json", "gradient_accumulation_steps"),
     ("zero3_nvme_offload_auto.json", "zero_optimization.reduce_bucket_size")],
)
def test_auto_configs_need_resolution(name, key):
    with pytest.raises(ValueError, match=rf'^{key}: "auto" is not resolved; call offload\.resolve_auto'):
        EngineConfig.from_file(CONFIGS / name, world_size=1)


def test_nvme_example_with_aio_inside_zero_optimization():
    config = load(resolve_auto(CONFIGS / "zero3_nvme_offload_auto.json", hidden_size=1024), world_size=1)
    zero = config.zero_optimization
    assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == "/local_nvme"
    assert zero.offload_param.buffer_size == 100_000_000 and zero.offload_param.max_in_cpu == 10**9
    assert zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.buffer_count == 4
    # the guide's aio settings are read, not silently dropped as DeepSpeed drops them there
    assert (config.aio.block_size, config.aio.queue_depth, config.aio.thread_count) == (262144, 32, 1)
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert zero.stage3_param_persistence_threshold == 10 * 1024
    assert config.optimizer is None and config.scheduler is None


def test_aio_at_top_level_is_read():
    config = load({**BASE, "aio": {"block_size": 4096, "intra_op_parallelism": 4}})
    assert (config.aio.block_size, config.aio.thread_count) == (4096, 4)
    assert load(BASE).aio.block_size == 1 << 20


def test_aio_in_both_places_is_refused():
    config = changed("zero_optimization.aio", {"block_size": 4096})
    config["aio"] = {"block_size": 4096}
    with pytest.raises(ValueError, match=r"^zero_optimization\.aio: .*both at the top level and inside"):
        load(config)


def test_aio_errors_inside_zero_optimization_name_that_place():
    with pytest.raises(ValueError, match=r"^zero_optimization\.aio\.block_size: 1000 is not allowed"):
        load(changed("zero_optimization.aio", {"block_size": 1000}))
    with pytest.raises(ValueError, match=r"^zero_optimization\.aio\.use_direct: unknown key"):
        load(changed("zero_optimization.aio", {"use_direct": True}))
    with pytest.raises(ValueError, match=r"^aio\.queue_depth: "):
        load({**BASE, "aio": {"queue_depth": 0}})


def test_bfloat16_spelling():
    config = load(resolve_auto(CONFIGS / "zero2_bfloat16_auto.json", **ARGS))
    assert config.bf16.enabled and not config.fp16.enabled
    assert load({**BASE, "bfloat16": {"enabled": True}}).bf16.enabled
    assert load({**BASE, "bf16": {"enabled": True}}).bf16.enabled
    with pytest.raises(ValueError, match=r"^bfloat16\.enabled: expected true or false"):
        load({**BASE, "bfloat16": {"enabled": "yes"}})
    with pytest.raises(ValueError, match=r"^bfloat16\.immediate_grad_update: unknown key"):
        load({**BASE, "bfloat16": {"enabled": True, "immediate_grad_update": True}})
    with pytest.raises(ValueError, match=r'^bfloat16: given as both "bf16" and "bfloat16"'):
        load({**BASE, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ValueError, match=r'^bfloat16\.enabled: "auto" needs a value; pass bf16='):
        resolve_auto(CONFIGS / "zero2_bfloat16_auto.json", **{**ARGS, "bf16": None})


def test_integral_floats_where_integers_are_meant():
    config = load(resolve_auto(CONFIGS / "zero2_bfloat16_auto.json", **ARGS))
    assert config.steps_per_print == 100_000 and type(config.steps_per_print) is int
    assert config.zero_optimization.allgather_bucket_size == 200_000_000
    assert load({**BASE, "train_micro_batch_size_per_gpu": 2.0}).train_micro_batch_size_per_gpu == 2
    with pytest.raises(ValueError, match=r"^steps_per_print: expected an integer, got 1000\.5"):
        load({**BASE, "steps_per_print": 1000.5})
    with pytest.raises(ValueError, match=r"^zero_optimization\.sub_group_size: expected an integer, got 1e-05"):
        load(changed("zero_optimization.sub_group_size", 1e-5))


def test_placeholder_nvme_path_parses_and_is_checked_at_start(tmp_path):
    config = load(BASE)
    assert config.zero_optimization.offload_param.nvme_path == "/local_nvme"
    missing = tmp_path / "not_there"
    with pytest.raises(FileNotFoundError, match=rf"^zero_optimization\.offload_param\.nvme_path: '{missing}' does"):
        check_nvme_paths(load(changed("zero_optimization.offload_param.nvme_path", str(missing))))
    usable = changed("zero_optimization.offload_param.nvme_path", str(tmp_path))
    check_nvme_paths(load(usable))
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    usable["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(a_file)}
    with pytest.raises(NotADirectoryError, match=r"^zero_optimization\.offload_optimizer\.nvme_path: .* not a dir"):
        check_nvme_paths(load(usable))
    assert not missing.exists()  # never created


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_nvme_path_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=r"^zero_optimization\.offload_param\.nvme_path: .* not writable"):
            check_nvme_paths(load(changed("zero_optimization.offload_param.nvme_path", str(tmp_path))))
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("zero_optimizations", {}, r"^zero_optimizations: unknown key; allowed keys are aio, bf16, bfloat16"),
        ("amp", {"enabled": True}, r"^amp: unknown key"),
        ("zero_optimization.offload_param.buffersize", 5, r"^zero_optimization\.offload_param\.buffersize: unknown"),
        ("zero_optimization.stage3_gather_fp16_weights_on_model_save", True,
         r"^zero_optimization\.stage3_gather_fp16_weights_on_model_save: unknown key; allowed keys are .*"
         r"stage3_gather_16bit_weights_on_model_save"),
        ("optimizer.params.torch_adam", True, r"^optimizer\.params\.torch_adam: unknown key"),
        ("fp16.auto_cast", True, r"^fp16\.auto_cast: unknown key"),
        ("zero_optimization", [], r"^zero_optimization: expected a JSON object"),
        ("zero_optimization.overlap_comm", "true", r"^zero_optimization\.overlap_comm: expected true or false"),
        ("zero_optimization.offload_param.pin_memory", 1, r"^zero_optimization\.offload_param\.pin_memory: expected"),
        ("zero_optimization.stage", 4, r"^zero_optimization\.stage: 4 is not allowed; use 0, 1, 2 or 3"),
        ("zero_optimization.stage", "3", r"^zero_optimization\.stage: expected an integer"),
        ("zero_optimization.offload_param.device", "disk",
         r"^zero_optimization\.offload_param\.device: 'disk' is not allowed; use one of 'none', 'cpu', 'nvme'"),
        ("zero_optimization.offload_param.nvme_path", ...,
         r'^zero_optimization\.offload_param\.nvme_path: device is "nvme" but nvme_path is missing; add "nvme_path"'),
        ("zero_optimization.offload_param.nvme_path", "", r"^zero_optimization\.offload_param\.nvme_path: expected a"),
        ("zero_optimization.offload_optimizer", {"device": "nvme"},
         r"^zero_optimization\.offload_optimizer\.nvme_path: .* add \"nvme_path\""),
        ("zero_optimization.offload_param.buffer_count", 0,
         r"^zero_optimization\.offload_param\.buffer_count: 0 is not allowed; use an integer >= 1"),
        ("zero_optimization.offload_param.buffer_size", 0, r"^zero_optimization\.offload_param\.buffer_size: 0 is"),
        ("zero_optimization.offload_param.max_in_cpu", -1, r"^zero_optimization\.offload_param\.max_in_cpu: -1 is"),
        ("zero_optimization.offload_optimizer.buffer_count", 2.5,
         r"^zero_optimization\.offload_optimizer\.buffer_count: expected an integer, got 2\.5"),
        ("zero_optimization.offload_optimizer.ratio", 1.5,
         r"^zero_optimization\.offload_optimizer\.ratio: 1\.5 is not allowed; use a number >= 0 and <= 1"),
        ("zero_optimization.offload_optimizer.pipeline_read", True,
         r'^zero_optimization\.offload_optimizer\.pipeline_read: true only applies to device "nvme"'),
        ("zero_optimization.sub_group_size", 0, r"^zero_optimization\.sub_group_size: 0 is not allowed"),
        ("zero_optimization.reduce_bucket_size", -5, r"^zero_optimization\.reduce_bucket_size: -5 is not allowed"),
        ("zero_optimization.stage3_max_live_parameters", -1, r"^zero_optimization\.stage3_max_live_parameters: -1"),
        ("zero_optimization.stage3_prefetch_bucket_size", "auto",
         r'^zero_optimization\.stage3_prefetch_bucket_size: "auto" is not resolved; call offload\.resolve_auto\('
         r"config, hidden_size=\.\.\.\)"),
        ("zero_optimization.allgather_bucket_size", "auto",
         r'^zero_optimization\.allgather_bucket_size: "auto" is not supported for this key; write a value'),
        ("optimizer.type", "SGD", r"^optimizer\.type: 'SGD' is not supported; use one of Adam, AdamW"),
        ("optimizer.type", ..., r'^optimizer\.type: missing; add "type": "AdamW"'),
        ("optimizer.params.betas", [0.9], r"^optimizer\.params\.betas: expected a list of two numbers"),
        ("optimizer.params.betas", [0.9, 1.0], r"^optimizer\.params\.betas: \[0\.9, 1\.0\] is not allowed"),
        ("optimizer.params.lr", -1, r"^optimizer\.params\.lr: -1 is not allowed"),
        ("optimizer.params.adam_w_mode", False, r'^optimizer\.params\.adam_w_mode: false contradicts type "AdamW"'),
        ("scheduler", {"type": "OneCycle"}, r"^scheduler\.type: 'OneCycle' is not allowed; use one of 'WarmupLR'"),
        ("scheduler", {"type": "WarmupDecayLR"}, r"^scheduler\.params\.total_num_steps: missing"),
        ("scheduler", {"type": "WarmupLR", "params": {"total_num_steps": 10}},
         r"^scheduler\.params\.total_num_steps: WarmupLR does not decay"),
        ("scheduler", {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 50}},
         r"^scheduler\.params\.total_num_steps: 50 is less than warmup_num_steps \(100\)"),
        ("scheduler", {"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
         r"^scheduler\.params\.warmup_type: 'cosine' is not allowed"),
        ("fp16", {"enabled": True, "loss_scale": -1}, r"^fp16\.loss_scale: -1 is not allowed"),
        ("fp16", {"enabled": True, "min_loss_scale": 0}, r"^fp16\.min_loss_scale: 0 is not allowed"),
        ("fp16", {"enabled": True, "hysteresis": 0}, r"^fp16\.hysteresis: 0 is not allowed"),
        ("fp16", {"enabled": "auto"}, r'^fp16\.enabled: "auto" is not resolved; call offload\.resolve_auto\(config, '
         r"fp16=\.\.\.\)"),
        ("gradient_clipping", -1.0, r"^gradient_clipping: -1\.0 is not allowed"),
        ("gradient_clipping", "1.0", r"^gradient_clipping: expected a finite number"),
        ("gradient_clipping", float("nan"), r"^gradient_clipping: expected a finite number, got nan"),
        ("optimizer.params.lr", float("inf"), r"^optimizer\.params\.lr: expected a finite number, got inf"),
        ("steps_per_print", 0, r"^steps_per_print: 0 is not allowed"),
        ("wall_clock_breakdown", "false", r"^wall_clock_breakdown: expected true or false"),
        ("train_micro_batch_size_per_gpu", 0, r"^train_micro_batch_size_per_gpu: 0 is not allowed"),
        ("gradient_accumulation_steps", True, r"^gradient_accumulation_steps: expected an integer, got True"),
    ],
)
def test_bad_values_name_the_key(path, value, message):
    with pytest.raises(ValueError, match=message):
        load(changed(path, value))


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ValueError, match=r"^fp16\.enabled, bf16\.enabled: both are true"):
        load({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_communication_data_type_defaults_to_the_training_dtype():
    """DeepSpeed's top-level key: the training dtype under fp16 / bf16 when absent, fp32 otherwise; any case."""
    import torch

    assert load(BASE).communication_dtype == torch.float32
    assert load({**BASE, "bf16": {"enabled": True}}).communication_dtype == torch.bfloat16
    assert load({**BASE, "fp16": {"enabled": True}}).communication_dtype == torch.float16
    wide = load({**BASE, "bf16": {"enabled": True}, "communication_data_type": "FP32"})
    assert wide.communication_data_type == "fp32" and wide.communication_dtype == torch.float32
    assert load({**BASE, "communication_data_type": "bf16"}).communication_dtype == torch.bfloat16
    for bad in ("fp8", 16, "bfloat16"):
        with pytest.raises(ValueError, match=r"^communication_data_type: .* is not allowed; use one of 'fp32', "
                                             r"'fp16', 'bf16', or leave it out"):
            load({**BASE, "communication_data_type": bad})


@pytest.mark.parametrize(
    "section, message",
    [
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
         r'^zero_optimization\.offload_optimizer\.device: "nvme" needs zero_optimization\.stage 3 \(stage is 2\); '
         r'set stage to 3 or the device to "cpu" or "none"'),
        ({"stage": 1, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
         r'^zero_optimization\.offload_param\.device: "nvme" needs zero_optimization\.stage 3 \(stage is 1\)'),
        ({"stage": 2, "offload_param": {"device": "cpu"}},
         r'^zero_optimization\.offload_param\.device: "cpu" needs zero_optimization\.stage 3'),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}},
         r'^zero_optimization\.offload_optimizer\.device: "cpu" needs zero_optimization\.stage 3 \(stage is 0\); '
         r'set stage to 3 or the device to "none"'),
    ],
)
def test_offload_below_stage_3_that_deepspeed_ignores_is_refused(section, message):
    with pytest.raises(ValueError, match=message):
        load({"zero_optimization": section})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_below_3_run_as_stage_3_with_a_warning(stage):
    with pytest.warns(UserWarning, match=rf"^zero_optimization\.stage: {stage} runs as stage 3"):
        config = EngineConfig.from_dict({"zero_optimization": {"stage": stage}}, world_size=1)
    assert config.zero_optimization.stage == stage


def test_stage_3_loads_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig.from_file(CONFIGS / "zero3_manual.json", world_size=1)


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
         (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 3, (45, 3, 5)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
        ({"gradient_accumulation_steps": 4}, 2, (8, 1, 4)),
        ({}, 5, (5, 1, 1)),
    ],
)
def test_batch_sizes_are_derived_as_deepspeed_does(given, world_size, expected):
    config = load(given, world_size)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected


@pytest.mark.parametrize(
    "given, world_size, message",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
         r"^train_batch_size \(32\) must equal train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps "
         r"\(2\) x world size \(2\) = 16;"),
        # no accumulation is made up (issue 27: 7 with micro batch 2 reported an accumulation of 3)
        ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}, 1,
         r"^train_batch_size \(7\) is not a multiple of train_micro_batch_size_per_gpu \(2\) x world size \(1\) = 2, "
         r"so no whole gradient_accumulation_steps makes them multiply out; set train_batch_size to a multiple of 2 "
         r"\(such as 6\) or set gradient_accumulation_steps too$"),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 1,
         r"^train_batch_size \(30\) is not a multiple of train_micro_batch_size_per_gpu \(4\) x world size \(1\) = 4"),
        ({"train_batch_size": 3}, 2,
         r"^train_batch_size \(3\) is not a multiple of gradient_accumulation_steps \(1\) x world size \(2\) = 2"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, 1,
         r"^train_batch_size \(2\) is not a multiple of train_micro_batch_size_per_gpu \(4\)"),
    ],
)
def test_batch_sizes_that_do_not_multiply_out_are_refused(given, world_size, message):
    with pytest.raises(ValueError, match=message):
        load(given, world_size)


def test_world_size_is_checked():
    with pytest.raises(ValueError, match=r"^world_size: 0 is not allowed"):
        EngineConfig.from_dict(BASE, world_size=0)
    with pytest.raises(ValueError, match=r"^world_size: unknown key"):
        load({**BASE, "world_size": 4})


def test_resolve_auto_follows_hugging_face():
    source = json.loads((CONFIGS / "zero3_auto.json").read_text())
    raw = resolve_auto(source, **ARGS)
    assert source["optimizer"]["params"]["lr"] == "auto"  # the input is not modified
    assert raw["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert raw["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 5e-5, "warmup_num_steps": 100}
    assert raw["gradient_clipping"] == 1.0
    assert raw["fp16"]["enabled"] is False
    assert "train_batch_size" not in raw  # derived by from_dict with the world size
    zero = raw["zero_optimization"]
    assert zero["reduce_bucket_size"] == 768 * 768
    assert zero["stage3_prefetch_bucket_size"] == 530841 and type(zero["stage3_prefetch_bucket_size"]) is int
    assert zero["stage3_param_persistence_threshold"] == 7680
    assert zero["sub_group_size"] == 1e9  # written values stay as written


def test_resolve_auto_fills_warmup_decay_total_steps():
    config = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    raw = resolve_auto(config, warmup_steps=10, total_steps=500)
    assert raw["scheduler"]["params"] == {"warmup_num_steps": 10, "total_num_steps": 500}
    assert load(raw).scheduler.params.total_num_steps == 500
    with pytest.raises(ValueError, match=r'^scheduler\.params\.total_num_steps: "auto" needs a value; pass total_st'):
        resolve_auto(config, warmup_steps=10)


@pytest.mark.parametrize(
    "missing, key",
    [
        ("micro_batch_size", "train_micro_batch_size_per_gpu"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("hidden_size", "zero_optimization.reduce_bucket_size"),
        ("lr", "optimizer.params.lr"),
        ("betas", "optimizer.params.betas"),
        ("eps", "optimizer.params.eps"),
        ("weight_decay", "optimizer.params.weight_decay"),
        ("warmup_steps", "scheduler.params.warmup_num_steps"),
        ("max_grad_norm", "gradient_clipping"),
        ("fp16", "fp16.enabled"),
    ],
)
def test_unresolvable_auto_names_key_and_argument(missing, key):
    args = {**ARGS, missing: None}
    with pytest.raises(ValueError, match=rf'^{key}: "auto" needs a value; pass {missing}=\.\.\. to resolve_auto'):
        resolve_auto(CONFIGS / "zero3_auto.json", **args)


def test_auto_train_batch_size_needs_the_micro_batch():
    with pytest.raises(ValueError, match=r'^train_batch_size: "auto" is micro batch .*pass micro_batch_size='):
        resolve_auto({"train_batch_size": "auto"})
    raw = resolve_auto({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 3})
    assert load(raw, world_size=4).train_batch_size == 24


def test_auto_on_a_key_no_argument_fills_is_refused():
    with pytest.raises(ValueError, match=r'^zero_optimization\.sub_group_size: "auto" is not supported'):
        resolve_auto({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, **ARGS)


def test_batch_arguments_fill_missing_keys_and_others_do_not():
    raw = resolve_auto({"train_batch_size": 16, "optimizer": {"type": "Adam"}}, micro_batch_size=4, lr=0.1)
    assert raw["train_micro_batch_size_per_gpu"] == 4
    assert "params" not in raw["optimizer"]
    assert load(raw, world_size=2).gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match=r"^train_batch_size \(16\) must equal .*\(4\) x .*\(1\) x world size \(2\)"):
        load(resolve_auto({"train_batch_size": 16}, micro_batch_size=4, gradient_accumulation_steps=1), world_size=2)
    with pytest.raises(ValueError, match=r"^train_micro_batch_size_per_gpu: the config says 2 but micro_batch_size=4"):
        resolve_auto({"train_micro_batch_size_per_gpu": 2}, micro_batch_size=4)


def test_precision_arguments():
    assert resolve_auto({}, bf16=True, fp16=False) == {"bf16": {"enabled": True}}
    assert resolve_auto({"bfloat16": {}}, bf16=True) == {"bfloat16": {"enabled": True}}
    assert resolve_auto({}, bf16=False, fp16=False) == {}
    with pytest.raises(ValueError, match=r"^fp16\.enabled: the config says False but fp16=True"):
        resolve_auto({"fp16": {"enabled": False}}, fp16=True)


def test_resolve_auto_checks_hidden_size():
    with pytest.raises(ValueError, match=r"^hidden_size: 0 is not allowed"):
        resolve_auto(CONFIGS / "zero3_auto.json", **{**ARGS, "hidden_size": 0})


def test_adam_follows_deepspeed_adam_w_mode():
    adam = load(changed("optimizer", {"type": "adam", "params": {"weight_decay": 0.1}})).optimizer
    assert adam.type == "Adam" and adam.decoupled_weight_decay  # DeepSpeed's "Adam" is AdamW by default
    plain = load(changed("optimizer", {"type": "Adam", "params": {"adam_w_mode": False}})).optimizer
    assert not plain.decoupled_weight_decay
    assert load(changed("optimizer.type", "ADAMW")).optimizer.type == "AdamW"


def test_check_against_model(tmp_path):
    config = load(BASE, world_size=4)  # buffer_size 1000 elements
    check_against_model(config, {"wte": 4000, "ln.bias": 768})
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_param\.buffer_size: 1000 elements cannot hold "
                                         r"the partition of 'wte' \(4001 elements over 4 ranks: 1001 per rank\); "
                                         r"set buffer_size to at least 1001"):
        check_against_model(config, {"ln.bias": 768, "wte": 4001})
    with pytest.raises(ValueError, match=r"at least 1024"):
        check_against_model(config, {"wte": 4000}, alignment=512)
    cpu = load(changed("zero_optimization.offload_param", {"device": "cpu"}), world_size=4)
    check_against_model(cpu, {"wte": 10**9})  # buffer_size is only used for NVMe


def test_world_size_from_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_size_from_env() == 1
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert world_size_from_env() == 8
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=r"^WORLD_SIZE: "):
            world_size_from_env()


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        EngineConfig.from_file(bad, world_size=1)
    bad.write_text("[]")
    with pytest.raises(ValueError, match=r"bad\.json: expected a JSON object"):
        EngineConfig.from_file(bad, world_size=1)
    with pytest.raises(FileNotFoundError):
        EngineConfig.from_file(tmp_path / "missing.json", world_size=1)



def _inference(config=None, **overrides):
    from offload.infer import InferenceConfig

    return InferenceConfig.from_dict(config, **overrides)


def _aio(section):
    from tensorio import AioConfig

    return AioConfig.from_dict(section)


@pytest.mark.parametrize("build, message", [
    (lambda: load(changed("zero_optimization.offload_param.nvme_pth", "/nvme")),
     r"^zero_optimization\.offload_param\.nvme_pth: unknown key; allowed keys are .*; did you mean nvme_path\?$"),
    (lambda: load(changed("zero_optimisation", {})),
     r"^zero_optimisation: unknown key; allowed keys are .*; did you mean zero_optimization\?$"),
    (lambda: load(changed("zero_optimization.offload_param.gibberish", 1)),
     r"^zero_optimization\.offload_param\.gibberish: unknown key; allowed keys are [a-z_, ]*$"),  # nothing close
    (lambda: _aio({"queue_dpth": 8}), r"^aio\.queue_dpth: unknown key; allowed keys are .*; did you mean queue_depth\?$"),
    (lambda: _inference(nvme_pth="/nvme"), r"^nvme_pth: unknown setting; allowed are .*; did you mean nvme_path\?$"),
    (lambda: _inference({"zero_optimization": {"offload_param": {"nvme_pth": "/nvme"}}}),
     r"^zero_optimization\.offload_param\.nvme_pth: unknown key; allowed keys are .*; did you mean nvme_path\?$"),
])
def test_an_unknown_key_names_the_closest_known_one(build, message):
    """A misspelt key (nvme_pth) names the key it is closest to, as the integrations' keywords do; a key
    close to none lists the allowed ones only."""
    with pytest.raises(ValueError, match=message):
        build()


def test_a_list_of_nvme_paths_spreads_the_nodes_ranks_and_each_is_checked(tmp_path, monkeypatch):
    """Several NVMe drives: ``nvme_path`` as a list gives local rank r the directory r modulo the list (the
    node's ranks spread over the drives); every directory of it is checked at the start, this rank's or not."""
    from offload.config import EngineConfig, check_nvme_paths

    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for drive in drives:
        drive.mkdir()
    section = {"device": "nvme", "nvme_path": [str(d) for d in drives]}
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "offload_param": dict(section), "offload_optimizer": dict(section)}}
    for local, expected in (("0", drives[0]), ("1", drives[1]), ("3", drives[1])):
        monkeypatch.setenv("LOCAL_RANK", local)
        zero = EngineConfig.from_dict(config, world_size=4).zero_optimization
        assert zero.offload_param.nvme_path == zero.offload_optimizer.nvme_path == str(expected)
        assert zero.offload_param.nvme_paths == tuple(str(d) for d in drives)
    monkeypatch.setenv("LOCAL_RANK", "0")
    drives[1].rmdir()  # another rank's drive is missing: named at the start here too
    with pytest.raises(FileNotFoundError, match=r"zero_optimization\.offload_param\.nvme_path: '.*nvme1' does not exist"):
        check_nvme_paths(EngineConfig.from_dict(config, world_size=4))
    with pytest.raises(ValueError, match=r"offload_param\.nvme_path: expected a directory path or a non-empty list"):
        EngineConfig.from_dict({**config, "zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": []}}}, world_size=1)
