"""``python -m offload.generate --prompts-file prompts.jsonl --output answers.jsonl``: every prompt of the file
answered, in the file's order, batched (the prompts share each forward's read), a bad line named by its
number while the others are answered; ``--resume`` continues an output cut short."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_infer_batch import reference, write_chat_tokenizer
from test_infer_generate import (  # noqa: F401 - one_thread: the module's autouse fixture
    REPO, build_model, one_thread, save_checkpoint, scratch_dir)

from offload.infer import init_inference
from offload.infer.cli import main
from offload.infer.prompts_file import MAX_PADDING

LINES = [
    {"id": "a", "prompt": "w5 w17 w99 w3"},
    {"prompt": [7, 8, 9, 10, 11, 12, 13, 14, 15], "max_tokens": 3},
    "",                                               # blank: skipped, no record
    {"id": 4, "messages": [{"role": "user", "content": "w5 w17"}], "max_tokens": 6},
    "{not json",
    {"prompt": "w42", "max_tokens": 0},
    {"prompt": "w100 w101 w102", "temperature": 1.2, "seed": 3, "max_tokens": 4},
    {"prompt": "w3 w3 w3", "ignore_eos": True},
]
PROMPT_IDS = {1: [5, 17, 99, 3], 2: [7, 8, 9, 10, 11, 12, 13, 14, 15], 4: [1, 5, 17, 9], 8: [3, 3, 3]}


@pytest.fixture(scope="module")
def llama():
    root = scratch_dir("prompts-file-")
    model = build_model("llama")
    directory = save_checkpoint(model, root / "llama")
    tokenizer = write_chat_tokenizer(directory)
    yield directory, model, tokenizer
    shutil.rmtree(root, ignore_errors=True)


def write_lines(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(directory, prompts, output, *more):
    return main([str(directory), "--prompts-file", str(prompts), "--output", str(output), "--max-in-cpu", "0",
                 "--disk-gbps", "1", "--max-new-tokens", "5", "--batch-size", "3", *more], out=io.StringIO())


def expected_answer(model, tokenizer, line: int, new: int) -> tuple[str, list[int]]:
    """The greedy answer alone, cut at the end-of-sequence token as the file's answers are."""
    ids = reference(model, PROMPT_IDS[line], new)
    if 2 in ids:
        ids = ids[:ids.index(2) + 1]
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def test_every_line_answered_in_order_and_bad_lines_named(llama, tmp_path):
    directory, model, tokenizer = llama
    write_lines(tmp_path / "prompts.jsonl", LINES)
    figures = run(directory, tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl")
    records = read_records(tmp_path / "answers.jsonl")
    assert [r["line"] for r in records] == [1, 2, 4, 5, 6, 7, 8]
    by_line = {r["line"]: r for r in records}
    for line, new in ((1, 5), (2, 3), (4, 6)):
        text, ids = expected_answer(model, tokenizer, line, new)
        assert by_line[line]["text"] == text and by_line[line]["token_ids"] == ids
        assert by_line[line]["usage"] == {"prompt_tokens": len(PROMPT_IDS[line]), "completion_tokens": len(ids),
                                          "total_tokens": len(PROMPT_IDS[line]) + len(ids)}
    assert by_line[1]["id"] == "a" and by_line[4]["id"] == 4 and by_line[2]["id"] is None
    assert by_line[8]["token_ids"] == reference(model, PROMPT_IDS[8], 5) and by_line[8]["finish_reason"] == "length"
    assert len(by_line[7]["token_ids"]) <= 4
    assert by_line[5]["error"].startswith("line 5: not valid JSON")
    assert by_line[6]["error"] == "line 6: max_tokens: 0 is not allowed; ask for at least 1"
    assert figures["answered"] == 5 and figures["errors"] == 2 and figures["prompts"] == 7
    assert figures["largest_batch"] == 3
    assert figures["steps"] < figures["tokens"]  # the batch shared its forwards
    with init_inference(directory, max_in_cpu=0, disk_gbps=1.0) as engine:  # every forward reads the same bytes
        streamed = figures["steps"] * engine.plan.read_bytes_per_forward
        resident = sum(u.read_nbytes for u in engine.plan.units if u.name in engine.plan.resident)
    assert streamed <= figures["read_bytes"] <= streamed + resident  # + the resident weights' one read, if not done


def test_prompts_of_mixed_lengths_prefill_by_length_with_bounded_padding(llama, tmp_path):
    """Eight prompts of 1 to 13 tokens joining at once: two forwards by length (padding 4 positions, at most
    MAX_PADDING of the 56 real ones), not one padded to 13 (48); each answer is the prompt's alone."""
    directory, model, _ = llama
    prompts = [[20 + i] * n for i, n in enumerate((1, 13, 2, 12, 1, 13, 2, 12))]
    write_lines(tmp_path / "prompts.jsonl", [{"prompt": p, "ignore_eos": True, "max_tokens": 3} for p in prompts])
    figures = run(directory, tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl", "--batch-size", "8")
    assert figures["padding"] == 4 and figures["padding"] <= MAX_PADDING * 56
    assert figures["steps"] == 3 + 1 and figures["positions"] == 2 * 4 + 13 * 4 + 2 * 8  # the prefills, 2 decodes
    for record, prompt in zip(read_records(tmp_path / "answers.jsonl"), prompts):
        assert record["token_ids"] == reference(model, prompt, 3)


def test_resume_continues_an_output_cut_short(llama, tmp_path):
    directory, _, _ = llama
    write_lines(tmp_path / "prompts.jsonl", LINES)
    run(directory, tmp_path / "prompts.jsonl", tmp_path / "whole.jsonl")
    whole = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(whole[:2]) + whole[2][:10])  # two records, and a third cut off mid-line
    with pytest.raises(FileExistsError, match="--resume"):
        run(directory, tmp_path / "prompts.jsonl", cut)
    figures = run(directory, tmp_path / "prompts.jsonl", cut, "--resume")
    assert figures["skipped"] == 2 and figures["answered"] == 3
    assert cut.read_text() == "".join(whole)


def test_options_that_need_a_prompts_file(llama, tmp_path):
    directory, _, _ = llama
    with pytest.raises(SystemExit):
        main([str(directory), "--prompt-ids", "5", "--output", str(tmp_path / "a.jsonl")], out=io.StringIO())
    with pytest.raises(SystemExit):
        main([str(directory), "--prompts-file", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "a")],
             out=io.StringIO())
    write_lines(tmp_path / "p.jsonl", LINES[:1])
    with pytest.raises(ValueError, match=r"--micro-batch-size .* is not supported .*--kv-quantize"):
        run(directory, tmp_path / "p.jsonl", tmp_path / "a.jsonl", "--micro-batch-size", "1")


def test_a_quantized_kv_cache_answers_what_generate_answers_with_it(llama, tmp_path):
    """``--kv-quantize int8`` in a file's batch: each answer is ``offload.generate --prompt-ids ... --kv-quantize
    int8``'s, token for token (generate stops at the end-of-sequence token; the file's lines ignore it)."""
    directory, _, _ = llama
    lines = [{"prompt": PROMPT_IDS[n], "ignore_eos": True} for n in (1, 2, 8)]
    write_lines(tmp_path / "p.jsonl", lines)
    run(directory, tmp_path / "p.jsonl", tmp_path / "a.jsonl", "--kv-quantize", "int8")
    records = read_records(tmp_path / "a.jsonl")
    for line, record in zip(lines, records):
        alone = main([str(directory), "--prompt-ids", ",".join(map(str, line["prompt"])), "--max-in-cpu", "0",
                      "--disk-gbps", "1", "--max-new-tokens", "5", "--kv-quantize", "int8"], out=io.StringIO())["tokens"]
        assert record["token_ids"][:len(alone)] == alone and len(record["token_ids"]) == 5
        assert len(alone) == 5 or alone[-1] == 2


@pytest.mark.subprocess
def test_the_module_entry_with_relative_paths_from_another_directory(llama, tmp_path):
    directory, model, tokenizer = llama
    write_lines(tmp_path / "prompts.jsonl", LINES[:2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "offload.generate", os.path.relpath(directory, tmp_path),
                           "--prompts-file", "prompts.jsonl", "--output", "answers.jsonl", "--max-in-cpu", "0",
                           "--disk-gbps", "1", "--max-new-tokens", "5", "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["answered"] == 2 and "answered 2 of 2 prompts into answers.jsonl" in done.stderr
    records = read_records(tmp_path / "answers.jsonl")
    assert [r["text"] for r in records] == [expected_answer(model, tokenizer, 1, 5)[0],
                                            expected_answer(model, tokenizer, 2, 3)[0]]
