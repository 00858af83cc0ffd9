"""Every ```python snippet of README.md and docs/*.md runs (issue 27), found generically so that new
pages are covered as they come.

Each file's snippets run top to bottom in one namespace, in a fresh process (forked from a server that
imported torch and transformers, tests/ranks.py) whose working directory is a scratch directory on the
disk, as a reader would paste them in turn. The namespace starts with what the snippets take as given:
``model`` (a tiny GPT-2), ``loader`` / ``data`` (a few token batches), ``tensor`` (a page-aligned
buffer), ``fd`` (an open scratch file), ``offset`` (0) and ``fn`` (a callback).

What differs from the page is the explicit, minimal list `SUBSTITUTIONS`: the user's NVMe drive
becomes a scratch directory, sizes that name a big model or buffer become tiny ones, paths of the
user's checkpoints become tiny checkpoints made here. A snippet that cannot run here (a pattern
around the reader's own code) is preceded on the page by the marker line

    <!-- snippet: skip (the reason) -->
"""

from __future__ import annotations

import json
import os
import re
import traceback
import sys
from pathlib import Path

import pytest
from ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*snippet:\s*skip\b.*-->\s*$")

SUBSTITUTIONS = [
    ("/nvme/", "{scratch}/nvme/"),                       # the user's NVMe drive: a scratch directory here
    ('"configs/', '"{repo}/configs/'),                   # the shipped configs, read from the clone
    ("n_layer=26, n_embd=3072, n_head=24", "n_layer=2, n_embd=64, n_head=2"),   # a 3.1 B GPT-2: a tiny one
    ("1 << 28", "1 << 20"),                              # a 1 GiB buffer: 4 MiB
    ("path/to/checkpoint", "{scratch}/pretrained"),      # the user's pretrained checkpoint: a tiny GPT-2's
    ("max_new_tokens=40", "max_new_tokens=8"),           # the KV-cache-on-NVMe examples: 8 steps take the same path
]

PRELUDE = '''
import os, torch, transformers, tensorio
torch.manual_seed(0)
_gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
model = transformers.GPT2LMHeadModel(_gpt2)
loader = data = [torch.randint(0, 128, (1, 8)) for _ in range(2)]
tensor = tensorio.aligned_tensor(1 << 16, torch.uint8)
fn = lambda future: None
offset = 0
os.makedirs("{scratch}/nvme/swap", exist_ok=True)
os.makedirs("{scratch}/nvme/cache", exist_ok=True)  # the quantized cache's directory (docs/inference.md)
fd = os.open("{scratch}/nvme/scratch.bin", os.O_RDWR | os.O_CREAT, 0o600)
os.pwrite(fd, bytes(1 << 16), 0)
transformers.GPT2LMHeadModel(_gpt2).save_pretrained("{scratch}/pretrained")
transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=5000, max_position_embeddings=64)).save_pretrained("{scratch}/nvme/models/llama-13b")
'''

def run_page(spec: str, scratch: str, log: str) -> None:
    """Run the prelude and a page's snippets (``spec``, a JSON file) in one namespace, in ``scratch``, their
    output and any traceback in ``log``; exit status 1 naming the snippet that failed."""
    os.chdir(scratch)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = sys.stderr = open(out, "w", buffering=1, closefd=False)
    snippets = json.load(open(spec, encoding="utf-8"))
    namespace = {"__name__": "__snippets__"}
    exec(compile(snippets["prelude"], "prelude", "exec"), namespace)
    for where, code in snippets["code"]:
        print(f"--- running {where}", flush=True)
        try:
            exec(compile(code, where, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"snippet {where} failed", flush=True)
            sys.exit(1)


def snippets(page: Path) -> list[tuple[int, str, bool]]:
    """(line of the opening fence, code, skipped) for each ```python block of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            skipped = i > 0 and bool(SKIP.match(lines[i - 1].strip()))
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            found.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", skipped))
            i = end
        i += 1
    return found


def substitute(code: str, scratch: Path) -> str:
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new.format(scratch=scratch, repo=REPO))
    return code


def test_snippets_are_found_and_the_marker_skips(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n<!-- snippet: skip (no GPU) -->\n```python\nb = 2\n```\n"
                    "```bash\nls\n```\n")
    assert snippets(page) == [(2, "a = 1\n", False), (6, "b = 2\n", True)]
    assert len([s for s in snippets(REPO / "README.md") if not s[2]]) >= 5


@pytest.mark.subprocess
@pytest.mark.parametrize("page", [p for p in PAGES if any(not skip for _, _, skip in snippets(p))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_snippet_runs(page, disk_dir):
    scratch = disk_dir / "scratch"
    scratch.mkdir()
    code = [(f"{page.relative_to(REPO)}:{line}", substitute(text, scratch))
            for line, text, skipped in snippets(page) if not skipped]
    spec = disk_dir / "snippets.json"
    spec.write_text(json.dumps({"prelude": PRELUDE.format(scratch=scratch), "code": code}))
    log = disk_dir / "snippets.log"
    try:
        run_ranks(run_page, [(str(spec), str(scratch), str(log))])
    except AssertionError as failed:
        raise AssertionError(log.read_text(errors="replace")[-6000:]) from failed
