"""benchmarks/serve.py at a tiny scale: it writes its checkpoint and tokenizer, starts ``python -m offload.serve``,
times one client, concurrent clients, the start to the first answer and a prompts file against a repeated prompt,
stops the server (exit status 0) and prints the table (the figures themselves mean nothing here)."""

from __future__ import annotations

import shutil

import pytest
from test_infer_generate import scratch_dir

from benchmarks.serve import main


@pytest.mark.bench
@pytest.mark.subprocess
def test_tiny_run_end_to_end(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    root = scratch_dir("serve-bench-")
    try:
        figures = main(["--dir", str(root), "--scale", "0.025", "--layers", "2", "--shards", "2", "--budget", "400KiB",
                        "--clients", "2", "--prompts", "4", "--new-tokens", "3", "--prompt-tokens", "4",
                        "--prompt-lengths", "2-6", "--repeats", "1", "--out", str(root / "figures.json")])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    printed = capsys.readouterr().out
    assert figures["server_exit"] == 0
    assert figures["one"]["served_s_per_token"] > 0 and figures["one"]["generate_s_per_token"] > 0
    assert figures["concurrent"]["rounds"][0]["tokens"] == 2 * 3  # every client got its tokens
    assert figures["offline"]["file_tokens_per_s"] > 0 and figures["offline"]["repeated_tokens_per_s"] > 0
    assert figures["start"]["to_first_answer_s"] >= figures["start"]["engine_build_s"] > 0
    assert "| (b) 2 clients, tokens/s |" in printed and "| (c) 4 prompts from a file, tokens/s |" in printed


def test_offline_only_with_online_only_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path), "--offline-only", "--online-only"])
    assert "leave nothing to measure" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before a checkpoint was written
