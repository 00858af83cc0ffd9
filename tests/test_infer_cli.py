"""``python -m offload.generate``: the plan, the tokens as they come, and the figures at the end."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_infer_generate import (
    PAD,
    REPO,
    saved_model,
    tight_budget,
    write_tokenizer,
)

from offload.infer.cli import main


@pytest.fixture(scope="module")
def gpt2():
    yield from saved_model("gpt2")


def _expected(model, ids: list[int], new: int) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             pad_token_id=PAD)
    return out[0, len(ids):].tolist()


def test_prompt_ids_stream_and_figures(gpt2):
    directory, model = gpt2
    out = io.StringIO()
    figures = main([str(directory), "--prompt-ids", "5,17,99,3", "--max-new-tokens", "6", "--batch-size", "2",
                    "--max-in-cpu", tight_budget(directory, 2), "--disk-gbps", "1.5"], out=out)
    text = out.getvalue()
    expected = _expected(model, [5, 17, 99, 3], 6)
    assert figures["tokens"] == expected
    assert " ".join(map(str, expected)) in text  # streamed as they came
    assert "placement:" in text and "streamed:" in text and "KV cache:" in text
    assert "time to first token:" in text and "seconds per token:" in text
    assert "of the disk's 1.50 GB/s (given)" in text and "the disk's bound" in text
    assert figures["s_per_token"] > 0 and figures["read_bytes"] >= 5 * figures["read_bytes_per_forward"] > 0


def test_prompt_text_needs_a_tokenizer(gpt2):
    directory, _ = gpt2
    with pytest.raises(SystemExit):
        main([str(directory), "--prompt", "hello"], out=io.StringIO())


@pytest.mark.subprocess
def test_module_entry_with_a_tokenizer(gpt2, tmp_path):
    directory, model = gpt2
    with_tokenizer = tmp_path / "ckpt"
    shutil.copytree(directory, with_tokenizer)
    tokenizer = write_tokenizer(with_tokenizer)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "offload.generate", str(with_tokenizer), "--prompt", "w5 w17 w99 w3",
                           "--max-new-tokens", "5", "--max-in-cpu", "1GiB"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    expected = tokenizer.decode(_expected(model, [5, 17, 99, 3], 5), skip_special_tokens=True)
    assert expected in done.stdout
    assert "streamed: nothing" in done.stdout and "read: nothing streamed" in done.stdout
