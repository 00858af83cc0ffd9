"""``python -m offload.serve``: OpenAI's endpoints over the batcher, reached as users reach them: FastAPI's
TestClient for the bodies and the errors, a real uvicorn server on a free port (started in this process,
waited for by an event) with concurrent httpx clients and the `openai` package, and the command itself in
a child process with curl and SIGTERM.

A tiny random Llama (context 128 tokens) with every decoder layer streamed, and a word-level tokenizer with
a chat template ("<s> CONTENT " per message, then "w9"): "w5 w17" is token ids 5, 17.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_infer_batch import PROMPTS, reference, write_chat_tokenizer
from test_infer_generate import (  # noqa: F401 - one_thread: the module's autouse fixture
    REPO, build_model, one_thread, save_checkpoint, scratch_dir)

fastapi = pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="the test extra: pip install -e '.[test]'")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra: pip install -e '.[serve]'")
from fastapi.testclient import TestClient  # noqa: E402

from offload.infer import init_inference  # noqa: E402
from offload.infer.batch import Batcher  # noqa: E402
from offload.serve import create_app  # noqa: E402
from offload.serve.cli import INSTALL_HINT, main  # noqa: E402

NAME = "tiny-llama"
CONTEXT = 128


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def llama():
    """(checkpoint directory with a chat tokenizer, the in-memory model, the tokenizer)."""
    root = scratch_dir("serve-")
    model = build_model("llama")
    directory = save_checkpoint(model, root / NAME)
    tokenizer = write_chat_tokenizer(directory)
    yield directory, model, tokenizer
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(llama):
    with init_inference(llama[0], max_in_cpu=0, disk_gbps=1.0) as engine:
        engine.wait_loaded()
        yield engine


def make_app(engine, tokenizer, **options):
    batcher = Batcher(engine, tokenizer, **options)
    return batcher, create_app(batcher, name=NAME, context=CONTEXT, vocab_size=256)


@pytest.fixture(scope="module")
def client(engine, llama):
    batcher, app = make_app(engine, llama[2])
    with batcher, TestClient(app) as client:
        yield client


def events(lines) -> list[dict | str]:
    """The server-sent events of a stream: each ``data:`` line's JSON, or "[DONE]"."""
    found = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


# ---- the endpoints --------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [NAME]
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/v2/nothing").status_code == 404


def test_completion_is_the_greedy_answer_with_usage(client, llama):
    _, model, tokenizer = llama
    response = client.post("/v1/completions", json={"model": NAME, "prompt": words(PROMPTS[0]), "max_tokens": 6,
                                                    "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = reference(model, PROMPTS[0], 6)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == NAME
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def test_chat_goes_through_the_chat_template(client, llama):
    _, model, tokenizer = llama
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": [{"type": "text", "text": "w5 w17"}]}]
    prompt = [1, 3, 1, 5, 17, 9]  # "<s> w3 <s> w5 w17 w9"
    assert tokenizer.apply_chat_template(messages[:1] + [{"role": "user", "content": "w5 w17"}],
                                         add_generation_prompt=True, return_dict=False) == prompt
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0}).json()
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(reference(model, prompt, 5), skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 w17"}]}),
    ("/v1/completions", {"prompt": words(PROMPTS[1])}),
])
def test_a_stream_is_the_same_answer_in_chunks(client, path, body):
    body = {**body, "max_tokens": 7, "temperature": 0}
    whole = client.post(path, json=body).json()
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        found = events(stream.iter_lines())
    assert found[-1] == "[DONE]"
    chunks, usage = found[:-2], found[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    if path.endswith("chat/completions"):
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_stop_and_seed(client):
    base = {"prompt": words(PROMPTS[0]), "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = " ".join(full.split()[3:5])
    cut = client.post("/v1/completions", json={**base, "stop": [stop, "w255 w255"]}).json()["choices"][0]
    assert cut == {"index": 0, "text": full[:full.index(stop)], "finish_reason": "stop", "logprobs": None}
    sampled = {**base, "temperature": 1.3, "top_p": 0.95, "seed": 5}
    first, again = (client.post("/v1/completions", json=sampled).json()["choices"][0]["text"] for _ in range(2))
    assert first == again


# ---- bad input --------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b'{"prompt": "w5",', None, "not valid JSON"),
    ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, "model", "'gpt-4' is not served here"),
    ("/v1/chat/completions", {"model": NAME}, "messages", "messages: missing"),
    ("/v1/completions", {"max_tokens": 4}, "prompt", "prompt: missing"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": -1}, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 10**9}, "max_tokens",
     "the prompt's 1 tokens + max_tokens 1000000000 = 1000000001 exceed the model's context of 128 tokens"),
    ("/v1/completions", {"prompt": words([5] * 130)}, "prompt", "130 tokens, and the model's context is 128 tokens"),
    ("/v1/completions", {"prompt": "w5", "temperature": 5}, "temperature", "outside [0, 2]"),
    ("/v1/completions", {"prompt": "w5", "top_p": 0}, "top_p", "outside (0, 1]"),
    ("/v1/completions", {"prompt": "w5", "stop": [3]}, "stop", "non-empty string"),
    ("/v1/completions", {"prompt": "w5", "frobnicate": 1}, "frobnicate", "unknown field"),
    ("/v1/completions", {"prompt": "w5", "n": 2}, "n", "not supported"),
    ("/v1/completions", {"prompt": [5, 999]}, "prompt", "token id 999 is outside the model's vocabulary of 256"),
    ("/v1/completions", {"prompt": ["w5", "w6"]}, "prompt", "one prompt per request"),
    ("/v1/completions", {"prompt": "w5", "stream": "yes"}, "stream", "true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a string"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w5"}]}, "messages[0].role", "not one of"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty list"),
    ("/v1/chat/completions", [1, 2], None, "must be a JSON object"),
]


@pytest.mark.parametrize("path, body, param, message", BAD, ids=[f"{p or 'body'}-{i}" for i, (_, _, p, _) in
                                                                   enumerate(BAD)])
def test_bad_input_is_400_naming_the_field_and_the_server_goes_on(client, path, body, param, message):
    response = (client.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
                else client.post(path, json=body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
    assert client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1}).status_code == 200


def test_a_request_whose_cache_cannot_fit_even_alone_is_400_naming_max_tokens(llama):
    directory, _, tokenizer = llama
    with init_inference(directory, max_in_cpu="1GiB", disk_gbps=1.0) as probe:
        must = sum(u.nbytes for u in probe.units if not u.streamable)
        room = probe.kv_bytes(1, 16)
    with init_inference(directory, max_in_cpu=f"{must + room}B", disk_gbps=1.0) as engine:
        batcher, app = make_app(engine, tokenizer)
        with batcher, TestClient(app) as client:
            response = client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 100})
            with client.stream("POST", "/v1/completions", json={"prompt": "w5", "max_tokens": 100,
                                                                 "stream": True}) as stream:
                found = events(stream.iter_lines())
            fits = client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 10})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert "the KV cache of batch 1 x 102 tokens" in response.json()["error"]["message"]
    assert found[0]["error"]["param"] == "max_tokens" and found[-1] == "[DONE]"
    assert fits.status_code == 200


def test_a_failed_read_is_500_and_the_server_goes_on(client, llama):
    from tensorio.testing import Fail, inject_faults

    _, model, tokenizer = llama
    with inject_faults(Fail(errno.EIO)):  # every read of the streamed layers fails
        response = client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["message"].startswith("generation failed: ")
    after = client.post("/v1/completions", json={"prompt": words(PROMPTS[0]), "max_tokens": 3, "temperature": 0})
    assert after.json()["choices"][0]["text"] == tokenizer.decode(reference(model, PROMPTS[0], 3),
                                                                  skip_special_tokens=True)
    assert client.get("/health").json()["status"] == "ok"


def test_a_chat_without_a_template_is_refused(engine, llama, tmp_path):
    from test_infer_generate import write_tokenizer

    batcher, app = make_app(engine, write_tokenizer(tmp_path))
    with batcher, TestClient(app) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "no chat template" in response.json()["error"]["message"]


# ---- a real server, concurrent clients ------------------------------------------------------------------

class Gate:
    """The batcher as the app sees it, submitting for real, and telling when ``count`` requests are in (the
    test then starts the batcher: they run together from the first step) or a request was cancelled before
    its answer was complete."""

    def __init__(self, batcher: Batcher, count: int) -> None:
        self.batcher, self.tokenizer, self.count = batcher, batcher.tokenizer, count
        self.all_in, self.cancelled = threading.Event(), threading.Semaphore(0)
        self._lock = threading.Lock()

    def stats(self):
        return self.batcher.stats()

    def submit(self, prompt, params, sink):
        finished = threading.Event()

        def watched(update):
            if update.last:
                finished.set()
            sink(update)
        ticket = self.batcher.submit(prompt, params, watched)
        with self._lock:
            self.count -= 1
            if self.count == 0:
                self.all_in.set()
        gate = self

        class Counted:
            def cancel(self):  # the app cancels every request when it is done with it; count those unfinished
                ticket.cancel()
                if not finished.is_set():
                    gate.cancelled.release()
        return Counted()


class Server:
    """uvicorn serving ``app`` on 127.0.0.1 on a free port, in a thread; `url` is ready once started."""

    def __init__(self, app) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)  # connections queue here until the server takes them: no wait needed
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]})

    def __enter__(self) -> "Server":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.socket.close()


def test_beyond_the_queue_limit_429_with_retry_after(engine, llama):
    batcher, app = make_app(engine, llama[2], max_queue=1, start=False)
    with batcher, Server(app) as server:
        body = {"prompt": "w5 w6", "max_tokens": 3, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as queued:  # not started
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "w5", "max_tokens": 1}, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error" and "--max-queue 1" in refused.text
            batcher.start()
            assert events(queued.iter_lines())[-1] == "[DONE]"


def test_concurrent_requests_share_each_read_and_get_their_answers_alone(engine, llama):
    """16 requests from 16 client threads, run together: as many forwards as the longest answer, each reading
    the streamed layers once (one generation's reads, not 16), and every answer the greedy answer alone."""
    _, model, tokenizer = llama
    requests = [(PROMPTS[i % len(PROMPTS)], 4 + i % 5) for i in range(16)]
    batcher = Batcher(engine, tokenizer, start=False)
    gate = Gate(batcher, len(requests))
    app = create_app(gate, name=NAME, context=CONTEXT, vocab_size=256)

    def ask(request):
        prompt, new = request
        body = {"model": NAME, "prompt": words(prompt), "max_tokens": new, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    per_forward = engine.plan.read_bytes_per_forward
    with batcher, Server(app) as server, ThreadPoolExecutor(len(requests)) as pool:
        start = engine.io_bytes()
        answers = [pool.submit(ask, request) for request in requests]
        assert gate.all_in.wait(60)
        batcher.start()
        answers = [answer.result() for answer in answers]
        reads, stats = engine.io_bytes() - start, batcher.stats()
    longest = max(new for _, new in requests)
    assert stats["steps"] == longest and stats["largest_batch"] == len(requests)
    assert reads == longest * per_forward  # alone, each would read new * per_forward: 16 requests, 100 forwards
    for (prompt, new), body in zip(requests, answers):
        assert body["choices"][0]["text"] == tokenizer.decode(reference(model, prompt, new), skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == new


def test_the_openai_client(engine, llama):
    openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
    _, model, tokenizer = llama
    batcher, app = make_app(engine, tokenizer)
    with batcher, Server(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [NAME]
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w5 w17"}],
                                              max_tokens=5, temperature=0)
        expected = tokenizer.decode(reference(model, [1, 5, 17, 9], 5), skip_special_tokens=True)
        assert chat.choices[0].message.content == expected and chat.usage.completion_tokens == 5
        stream = client.completions.create(model=NAME, prompt=words(PROMPTS[2]), max_tokens=6, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == tokenizer.decode(
            reference(model, PROMPTS[2], 6), skip_special_tokens=True)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=NAME, prompt="w5", max_tokens=0)
        assert refused.value.body["param"] == "max_tokens"


def test_clients_that_go_away_mid_stream_are_cancelled(engine, llama):
    """Five chat streams abandoned after their first chunk (the batcher not started yet, so they are surely
    unfinished): each request is cancelled, none runs, and the server answers the next one."""
    _, model, tokenizer = llama
    batcher = Batcher(engine, tokenizer, start=False)
    gate = Gate(batcher, 1 << 30)
    with batcher, Server(create_app(gate, name=NAME, context=CONTEXT, vocab_size=256)) as server:
        for _ in range(5):
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "user", "content": "w5"}], "max_tokens": 50, "stream": True}) as response:
                assert json.loads(next(response.iter_lines())[len("data: "):])["choices"][0]["delta"]["role"]
            assert gate.cancelled.acquire(timeout=60)
        batcher.start()
        after = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": words(PROMPTS[0]), "max_tokens": 4, "temperature": 0}).json()
        assert after["choices"][0]["text"] == tokenizer.decode(reference(model, PROMPTS[0], 4), skip_special_tokens=True)
        stats = batcher.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["tokens"] == 4 and stats["steps"] == 4


# ---- the command ------------------------------------------------------------------------------------

def test_without_fastapi_the_command_says_what_to_install(monkeypatch, llama):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "offload.serve.app")  # imported again: it imports FastAPI
    with pytest.raises(SystemExit) as exit_:
        main([str(llama[0])])
    assert exit_.value.code == INSTALL_HINT and "\n" not in INSTALL_HINT and "[serve]" in INSTALL_HINT


def test_the_command_refuses_what_it_cannot_serve(llama, tmp_path, capsys):
    with pytest.raises(ValueError, match="--kv-offload nvme"):
        main([str(llama[0]), "--kv-offload", "nvme"])
    bare = tmp_path / "bare"
    shutil.copytree(llama[0], bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    with pytest.raises(ValueError, match="has no tokenizer"):
        main([str(bare), "--max-in-cpu", "0"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError, match=f"--port {taken.getsockname()[1]}: cannot listen there"):
            main([str(llama[0]), "--port", str(taken.getsockname()[1]), "--max-in-cpu", "0"])


@pytest.mark.subprocess
def test_the_command_serves_curl_and_exits_0_on_sigterm_after_the_answers_running(llama):
    directory, model, tokenizer = llama
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "offload.serve", str(directory), "--port", "0", "--max-in-cpu", "0",
                              "--disk-gbps", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=REPO)
    try:
        for line in child.stdout:  # the plan, then the line with the address
            if "serving" in line:
                break
        else:
            pytest.fail(f"the server did not start: {child.stderr.read()}")
        url = line.split(" on ")[1].split()[0]
        assert line.startswith("ready in") and f"serving {NAME} on http://127.0.0.1:" in line
        done = subprocess.run(["curl", "-sS", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json",
                               "-d", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "w5 w17"}],
                                                 "max_tokens": 4, "temperature": 0})],
                              capture_output=True, text=True, timeout=60, check=True)
        body = json.loads(done.stdout)
        expected = tokenizer.decode(reference(model, [1, 5, 17, 9], 4), skip_special_tokens=True)
        assert body["choices"][0]["message"]["content"] == expected
        body = {"prompt": words(PROMPTS[1]), "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()
            first = next(lines)
            child.send_signal(signal.SIGTERM)  # while the answer streams: it is finished before the server stops
            found = events([first, *lines])
        assert found[-1] == "[DONE]" and found[-2]["choices"][0]["finish_reason"] == "length"
        assert child.wait(timeout=60) == 0, child.stderr.read()
        assert "stopped" in child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
