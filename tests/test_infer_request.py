"""A request read from JSON (offload/infer/request.py, sampling.py, prompt.py): what is taken, and every
refusal naming its field. Pure: no model, no disk."""

from __future__ import annotations

import pytest

from offload.infer.prompt import context_length, fit_context
from offload.infer.request import parse_request
from offload.infer.sampling import RequestError, SamplingParams


def refused(body, kind: str = "completion") -> RequestError:
    with pytest.raises(RequestError) as error:
        parse_request(body, kind)
    return error.value


def test_openai_bodies_as_clients_send_them():
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ann"}],
                          "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 3,
                          "stream": True, "stream_options": {"include_usage": True}, "n": 1, "logprobs": False,
                          "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u-1"}, "chat")
    assert chat.messages == [{"name": "ann", "role": "user", "content": "hi"}] and chat.model == "m"
    assert chat.sampling == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, stop=("END",), seed=3)
    assert chat.stream and chat.include_usage
    completion = parse_request({"prompt": ["w5 w6"], "max_tokens": None, "logprobs": None, "echo": False}, "completion")
    assert completion.prompt == "w5 w6" and completion.sampling.max_tokens is None and not completion.stream
    assert parse_request({"prompt": [5, 6]}, "completion").prompt == [5, 6]


def test_a_prompts_file_line_takes_either_prompt_or_messages_and_an_id():
    line = parse_request({"id": {"any": "json"}, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}], "ignore_eos": True}, "line")
    assert line.messages == [{"role": "user", "content": "a b"}] and line.id == {"any": "json"}
    assert line.sampling.ignore_eos
    assert refused({"prompt": "a", "messages": []}, "line").param == "prompt"
    assert refused({"prompt": "a", "stream": True}, "line").param == "stream"  # not a line's field


@pytest.mark.parametrize("body, kind, param, words", [
    ({"prompt": "a", "n": True}, "completion", "n", "not supported"),  # true is not 1
    ({"prompt": "a", "best_of": 3}, "completion", "best_of", "not supported"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "chat", "tools", "not supported"),
    ({"prompt": "a", "max_completion_tokens": 3}, "completion", "max_completion_tokens", "unknown field"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "max_completion_tokens": 3}, "chat",
     "max_completion_tokens", "differs from max_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "completion", "stream_options", "only with stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"usage": 1}}, "completion", "stream_options", "include_usage"),
    ({"prompt": "a", "seed": True}, "completion", "seed", "64-bit integer"),
    ({"prompt": "a", "seed": 2**64}, "completion", "seed", "64-bit integer"),
    ({"prompt": "a", "top_k": -1}, "completion", "top_k", "at least 0"),
    ({"prompt": "a", "max_tokens": 2.5}, "completion", "max_tokens", "expected an integer"),
    ({"prompt": "a", "temperature": "hot"}, "completion", "temperature", "expected a number"),
    ({"prompt": "a", "temperature": float("nan")}, "completion", "temperature", "expected a number"),
    ({"prompt": "a", "stop": [""]}, "completion", "stop", "non-empty string"),
    ({"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, "completion", "stop", "at most 16"),
    ({"prompt": "a", "model": 3}, "completion", "model", "expected a string"),
    ({"prompt": []}, "completion", "prompt", "non-empty list"),
    ({"prompt": [1, True]}, "completion", "prompt", "expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "chat", "messages[0].content", "text only"),
    ({"messages": ["hi"]}, "chat", "messages[0]", "expected an object"),
    ("a string", "completion", None, "must be a JSON object"),
])
def test_refusals_name_the_field(body, kind, param, words):
    error = refused(body, kind)
    assert error.param == param and words in str(error)
    assert param is None or str(error).startswith(param)


def test_the_context_bounds_the_prompt_and_max_tokens():
    assert fit_context(10, None, 128) == 118  # what the context leaves
    assert fit_context(10, 20, None) == 20 and fit_context(10, None, None, default=7) == 7
    with pytest.raises(RequestError, match=r"prompt: 128 tokens, and the model's context is 128 tokens; shorten "
                                           r"the prompt to at most 127 tokens") as error:
        fit_context(128, 1, 128)
    assert error.value.param == "prompt"
    with pytest.raises(RequestError, match=r"the prompt's 100 tokens \+ max_tokens 29 = 129 exceed the model's "
                                           r"context of 128 tokens; ask for at most 28"):
        fit_context(100, 29, 128)


def test_context_length_from_the_families_configs():
    import transformers

    assert context_length(transformers.LlamaConfig(max_position_embeddings=77)) == 77
    assert context_length(transformers.GPT2Config(n_positions=55)) == 55
