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


@pytest.fixture(scope="module")
def with_chat_tokenizer(gpt2, tmp_path_factory):
    """(a copy of the checkpoint with a word-level tokenizer that has a chat template, the model, the tokenizer)."""
    from test_infer_batch import write_chat_tokenizer

    directory, model = gpt2
    target = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(directory, target)
    return target, model, write_chat_tokenizer(target)


def test_chat_top_p_repetition_penalty_and_stop_are_transformers(with_chat_tokenizer):
    """--chat wraps --prompt in the checkpoint's chat template; --repetition-penalty, --top-p (with --do-sample and
    --seed) and --stop give what transformers' generate gives with the same settings on the same ids."""
    directory, model, tokenizer = with_chat_tokenizer
    messages = [{"role": "user", "content": "w5 w17 w99"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    base = [str(directory), "--prompt", "w5 w17 w99", "--chat", "--max-new-tokens", "8", "--max-in-cpu", "1GiB",
            "--disk-gbps", "1.0"]

    def transformers_tokens(**kwargs):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, pad_token_id=PAD, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    penalized = main(base + ["--repetition-penalty", "1.3"], out=io.StringIO())
    assert penalized["tokens"] == transformers_tokens(do_sample=False, repetition_penalty=1.3)
    sampled = main(base + ["--do-sample", "--top-p", "0.5", "--top-k", "0", "--seed", "7"], out=io.StringIO())
    torch.manual_seed(7)
    assert sampled["tokens"] == transformers_tokens(do_sample=True, top_p=0.5, top_k=0, temperature=1.0)
    greedy = transformers_tokens(do_sample=False)
    stop = tokenizer.decode(greedy[2:3])
    stopped = main(base + ["--stop", stop], out=io.StringIO())
    assert stopped["tokens"] == greedy[:greedy.index(greedy[2]) + 1]  # ends with the first token that makes the text


def test_chat_without_a_template_and_stop_without_a_tokenizer_are_refused(gpt2, tmp_path, capsys):
    directory, _ = gpt2
    plain = tmp_path / "plain"
    shutil.copytree(directory, plain)
    write_tokenizer(plain)
    with pytest.raises(SystemExit):
        main([str(plain), "--prompt", "w5", "--chat"], out=io.StringIO())
    assert "--chat: the tokenizer in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(directory), "--prompt-ids", "5,17", "--stop", "w3"], out=io.StringIO())
    assert "--stop needs a tokenizer in" in capsys.readouterr().err


class _Terminal(io.StringIO):
    """Typed input: a terminal, so the command shows its ``> `` prompt."""

    def isatty(self) -> bool:
        return True


def _conversation(model, tokenizer, turns: list[str], new: int) -> list[dict[str, str]]:
    """transformers' greedy answers to ``turns``, each on the whole conversation so far in the chat template."""
    messages = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 pad_token_id=PAD)
        messages.append({"role": "assistant", "content": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)})
    return messages


def test_chat_without_a_prompt_holds_a_conversation_from_stdin(with_chat_tokenizer, monkeypatch):
    """--chat alone: each stdin line a user turn, answered (streamed, after a ``> `` prompt on a terminal) with the
    greedy tokens transformers gives the templated conversation so far; an empty line ends it (what follows is
    never read)."""
    directory, model, tokenizer = with_chat_tokenizer
    monkeypatch.setattr(sys, "stdin", _Terminal("w5 w17 w99\n  w42 w3 \n\nw7\n"))
    out = io.StringIO()
    figures = main([str(directory), "--chat", "--max-new-tokens", "6", "--max-in-cpu", "0", "--disk-gbps", "1"], out=out)
    expected = _conversation(model, tokenizer, ["w5 w17 w99", "w42 w3"], 6)
    assert figures == {"messages": expected, "turns": 2}
    assert expected[1]["content"] and expected[3]["content"]
    assert out.getvalue().endswith(f"> {expected[1]['content']}\n> {expected[3]['content']}\n> ")


def test_chat_ends_on_exit_ctrl_c_and_end_of_input():
    from offload.infer.chat import converse

    replies = iter(["first", "second"])
    answer = lambda messages: next(replies)  # noqa: E731
    assert converse(answer, io.StringIO("hi\n/exit\nnot read\n"), io.StringIO()) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "first"}]

    class Interrupted(io.StringIO):
        def readline(self, *args):
            if self.tell():
                raise KeyboardInterrupt
            return super().readline(*args)

    out = io.StringIO()
    assert len(converse(answer, Interrupted("again\nmore\n"), out)) == 2 and out.getvalue() == "\n"
    assert converse(answer, io.StringIO(""), io.StringIO()) == []


@pytest.mark.subprocess
def test_chat_conversation_through_the_module_with_piped_stdin(with_chat_tokenizer, tmp_path):
    """``echo ... | python -m offload.generate DIR --chat`` from another directory, a relative path: no ``> `` prompt
    (stdin is no terminal), the answers on stdout, exit status 0 at the end of input."""
    directory, model, tokenizer = with_chat_tokenizer
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "offload.generate", os.path.relpath(directory, tmp_path), "--chat",
                           "--max-new-tokens", "5", "--max-in-cpu", "0", "--disk-gbps", "1", "--json"],
                          input="w5 w17 w99\nw42 w3\n", capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout) == {"messages": _conversation(model, tokenizer, ["w5 w17 w99", "w42 w3"], 5),
                                       "turns": 2}
    assert "> " not in done.stderr.split("a conversation:")[1]


def test_chat_alone_needs_a_template_and_a_prompt_is_required(gpt2, capsys):
    directory, _ = gpt2
    with pytest.raises(SystemExit):
        main([str(directory), "--max-new-tokens", "2"], out=io.StringIO())
    assert "give a prompt: --prompt TEXT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(directory), "--chat"], out=io.StringIO())
    assert "--chat: a conversation needs a tokenizer with a chat template" in capsys.readouterr().err
