"""The tuned aio section reaching the user's configs (bench/configfile.py): merged into every file in
configs/ without losing a key, read back by the engine that uses the file, never clobbering a whole
config, and `run --config` refusing a file without an aio section."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from bench.cli import DEFAULT_CONFIG_OUT, main
from bench.configfile import (TUNED_KEYS, check_config_out, check_merge_target, merge_aio, merge_into, read_aio_config,
                              write_aio_config)
from tensorio import AioConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.json") if p.name != DEFAULT_CONFIG_OUT.name)
"""The shipped configs: not the sweep's own output, which a run of tensorio-bench leaves there (git-ignored)."""
TUNED = AioConfig(block_size=256 << 10, queue_depth=4, thread_count=2, single_submit=True, overlap_events=False,
                  backend="threads", direct=True)
_RESOLVE_EVERY_AUTO = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=10, total_steps=100,
                           max_grad_norm=1.0, fp16=False, bf16=False)


def _without_aio(config: dict) -> dict:
    """The config less its aio section, wherever it is."""
    config = json.loads(json.dumps(config))
    config.pop("aio", None)
    if isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"].pop("aio", None)
    return config


def _engine_aio(path: Path) -> AioConfig:
    """The aio settings the engine that takes ``path`` reads from it: the inference engine's config for
    inference files, the training engine's (its "auto" values filled) for the rest."""
    if path.name.startswith("inference"):
        from offload.infer.config import InferenceConfig

        return InferenceConfig.from_dict(path).aio
    from offload.config import EngineConfig, resolve_auto

    extra = _RESOLVE_EVERY_AUTO if '"auto"' in path.read_text() else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stage 2 runs as stage 3: not this test's concern
        config = resolve_auto(path, micro_batch_size=1, gradient_accumulation_steps=1, hidden_size=64, **extra)
        return EngineConfig.from_dict(config, world_size=1).aio


@pytest.mark.parametrize("source", CONFIGS, ids=[p.name for p in CONFIGS])
def test_merge_keeps_every_key_of_every_shipped_config_and_the_engine_reads_the_tuned_section(source, tmp_path):
    path = tmp_path / "sub" / source.name
    path.parent.mkdir()
    shutil.copy(source, path)
    original_text = source.read_text()
    original = json.loads(original_text)

    backup = merge_into(path, TUNED)

    assert backup == path.with_name(source.name + ".bak") and backup.read_text() == original_text
    merged = json.loads(path.read_text())
    assert _without_aio(merged) == _without_aio(original)  # every other key, every value
    assert list(merged) == list(original) + ([] if list(merged) == list(original) else ["aio"])  # order kept
    for key in TUNED_KEYS:
        assert getattr(AioConfig.from_file(path), key) == getattr(TUNED, key), key
    assert _engine_aio(path) == AioConfig.from_file(path)  # the engine that takes the file reads what was tuned
    assert path.read_text().startswith('{\n    "')  # the file's own indentation


def test_merge_sets_the_section_where_the_file_has_it_and_keeps_its_other_keys():
    nested = {"zero_optimization": {"stage": 3, "aio": {"intra_op_parallelism": 4, "verify": False, "use_gds": False}}}
    merged = merge_aio(nested, TUNED)
    assert "aio" not in merged  # not a second section at the top, which the loader refuses
    section = merged["zero_optimization"]["aio"]
    assert section["intra_op_parallelism"] == 2 and "thread_count" not in section  # the file's spelling
    assert section["verify"] is False and section["use_gds"] is False  # untuned keys stay
    assert nested["zero_optimization"]["aio"]["intra_op_parallelism"] == 4  # the input is not changed
    bare = merge_aio({"block_size": 4096, "verify": False}, TUNED)
    assert bare["block_size"] == TUNED.block_size and bare["verify"] is False and "aio" not in bare


@pytest.mark.parametrize(("text", "message"), [
    ('{"aio": {"queue_depth": 2}, "zero_optimization": {"aio": {"queue_depth": 4}}}', "both at the top level"),
    ('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}', "key 'fp16' is given twice"),
    ('{"aio": {"bogus": 1}}', "aio.bogus: unknown key"),
    ('[1, 2]', "expected a JSON object"),
    ('{"aio": ', "not valid JSON"),
])
def test_a_file_the_section_cannot_be_merged_into_is_refused_before_the_sweep(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        check_merge_target(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(FileNotFoundError, match="no such file; give an existing config"):
        check_merge_target(tmp_path / "missing.json")


def test_a_backup_is_never_overwritten(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8}')
    first = merge_into(path, AioConfig(queue_depth=2))
    second = merge_into(path, TUNED)
    assert (first.name, second.name) == ("ds.json.bak", "ds.json.bak.1")
    assert first.read_text() == '{"train_batch_size": 8}'  # the file as it was before any merge
    assert json.loads(second.read_text())["aio"]["queue_depth"] == 2
    assert json.loads(path.read_text()) == {"train_batch_size": 8, "aio": {k: TUNED.to_dict()[k] for k in TUNED_KEYS}}
    assert path.read_text() == json.dumps(json.loads(path.read_text()))  # one line stays one line


@pytest.mark.parametrize("source", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_out_refuses_a_file_with_other_sections(source, tmp_path):
    path = tmp_path / source.name
    shutil.copy(source, path)
    with pytest.raises(ValueError, match=r"holds other sections \(.*\).*use --merge-into") as raised:
        check_config_out(path)
    assert "zero_optimization" in str(raised.value)
    assert path.read_text() == source.read_text()


def test_config_out_replaces_an_aio_file_or_writes_a_new_one(tmp_path):
    check_config_out(tmp_path / "new.json")
    write_aio_config(tmp_path / "new.json", TUNED)
    check_config_out(tmp_path / "new.json")  # an earlier sweep's output
    (tmp_path / "bare.json").write_text('{"block_size": 4096}')
    check_config_out(tmp_path / "bare.json")
    assert AioConfig.from_file(tmp_path / "new.json") == TUNED
    (tmp_path / "notes.json").write_text("not json")
    with pytest.raises(ValueError, match="exists and is not an aio config"):
        check_config_out(tmp_path / "notes.json")
    with pytest.raises(ValueError, match="is a directory"):
        check_config_out(tmp_path)


def test_sweep_merges_into_a_copy_of_a_training_config_and_refuses_to_clobber_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --config-out would land
    disk = tmp_path / "disk"
    disk.mkdir()
    config = tmp_path / "train.json"
    shutil.copy(REPO / "configs" / "zero3_nvme_offload.json", config)
    before = config.read_text()
    tiny = ["--quick", "--size", "2M", "--request-size", "1M", "--repeats", "1", "--no-progress", "--no-fio",
            "--backend", "threads"]

    # The case: --config-out onto a whole config rewrote it with the aio section alone.
    status = main(["sweep", str(disk), *tiny, "--out-dir", str(tmp_path / "r"), "--config-out", str(config)])
    err = capsys.readouterr().err
    assert status == 2 and "holds other sections (train_micro_batch_size_per_gpu" in err and "--merge-into" in err
    assert config.read_text() == before and list(disk.iterdir()) == [] and not (tmp_path / "r").exists()

    status = main(["sweep", str(disk), *tiny, "--out-dir", str(tmp_path / "r"), "--merge-into", str(config)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"merged the aio section into {config}, every other key kept" in out
    assert not (tmp_path / "configs").exists()  # --merge-into alone writes no aio_tuned.json beside it
    merged = json.loads(config.read_text())
    assert _without_aio(merged) == _without_aio(json.loads(before))
    chosen = json.loads((tmp_path / "r" / "sweep.json").read_text())["chosen"]["aio"]
    assert AioConfig.from_file(config) == AioConfig.from_dict(chosen)
    assert (tmp_path / "train.json.bak").read_text() == before


def test_run_config_without_an_aio_section_says_so(tmp_path, capsys):
    whole = tmp_path / "train.json"
    shutil.copy(REPO / "configs" / "zero3_manual.json", whole)
    assert main(["run", str(tmp_path), "--size", "1M", "--config", str(whole)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tensorio-bench run: error: --config {whole} has no aio section (its keys: fp16,")
    assert "--merge-into" in err and len(err.splitlines()) == 1
    (tmp_path / "empty.json").write_text("{}")
    assert main(["run", str(tmp_path), "--size", "1M", "--config", str(tmp_path / "empty.json")]) == 2
    assert "has no aio section (its keys: none)" in capsys.readouterr().err


def test_read_aio_config_reads_a_whole_config_holding_one(tmp_path):
    path = tmp_path / "auto.json"
    shutil.copy(REPO / "configs" / "zero3_nvme_offload_auto.json", path)
    assert read_aio_config(path).block_size == 262144  # inside zero_optimization
    (tmp_path / "bad.json").write_text('{"aio": {"queue_depth": 0}}')
    with pytest.raises(ValueError, match=r"bad.json: aio.queue_depth: 0 is not allowed"):
        read_aio_config(tmp_path / "bad.json")
