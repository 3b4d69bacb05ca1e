"""Every ``python`` example in the README and ``docs/`` runs, or says on the line above it why not.

A doc example the code contradicts is a defect a user meets first, so each page's examples run
here in order, in one namespace, against real parts: a 16-layer Llama-style model of the
built-in geometry (random weights), a fresh DMI home with an embedded catalog, and one capture
already in it under the model id the examples use (``llama-3.2-1b``). The names an example
takes from the reader's own code (``model``, ``input_ids``, ``train_step``, ...) are set up
before each example (``_reader_setup``).

An example that cannot run on one CPU machine (several processes under ``torch.distributed``,
a ClickHouse server or cluster, vLLM, S3) or that lists signatures rather than a program is
preceded by ``<!-- not run: REASON -->``; the reason is required.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import dmi
from dmi._models import BuiltinModel, _build_builtin
from dmi.catalog import HOME_ENV

from ._real_model import smollm2

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
EXAMPLE = re.compile(r"(?:<!-- not run: (?P<reason>[^\n]*?) -->\n[ \t]*)?```python\n(?P<code>.*?)```", re.S)
MODEL_ID = "llama-3.2-1b"
pytestmark = pytest.mark.slow


@dataclass(frozen=True, slots=True)
class Example:
    """One ``python`` block: its page, the line of its opening fence, its code, why it is not run."""

    page: Path
    line: int
    code: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def examples(page: Path) -> list[Example]:
    text = page.read_text()
    return [
        Example(page, text.count("\n", 0, m.start("code")), textwrap.dedent(m["code"]), m["reason"])
        for m in EXAMPLE.finditer(text)
    ]


def _pages_that_run_examples() -> list[Path]:
    return [page for page in PAGES if any(e.not_run is None for e in examples(page))]


def test_every_example_not_run_says_why():
    """A bare ``<!-- not run: -->`` would hide an example from the test without a reason."""
    bare = [e.where for page in PAGES for e in examples(page) if e.not_run is not None and not e.not_run.strip()]
    assert bare == []
    assert sum(e.not_run is None for page in PAGES for e in examples(page)) >= 12  # most of them run


def _reader_setup(home: Path, page: Path, tmp_path_factory) -> dict:
    """What a reader of ``page`` has before each example: their model and inputs, an open store
    holding one capture of the model (``token_ids`` and ``resid_post``), and their own functions."""
    loaded = _build_builtin(BuiltinModel(MODEL_ID, 64, 176, 16, 4, 2))  # 16 layers: the examples go up to 8
    model, tok = loaded.model, loaded.tokenizer  # a model of its own per page: one example compiles it
    enc = tok(["The quick brown fox", "How are you?"], return_tensors="pt", padding=True)
    if page.name == "quickstart.md":  # its first example loads the real model: from the test session's cache
        (home / "models").mkdir(parents=True)
        (home / "models" / "smollm2").symlink_to(smollm2(tmp_path_factory).home / "models" / "smollm2")
    Path("plan.yaml").write_text("version: 1\nhooks: [resid_post]\nlayers: 0:4\n")
    store = dmi.open()
    with torch.inference_mode(), dmi.capture(model, hooks="token_ids,resid_post", store=store) as cap:
        request_ids, _ = cap.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=4)
    return {
        "model": model, "tok": tok, "enc": enc,
        "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "mask": enc["attention_mask"],
        "store": store, "catalog": store.catalog, "model_id": cap.model_id, "request_ids": request_ids,
        "train_ids": request_ids, "node": "node-0", "attempt": 0,
        "train_step": lambda *batch: None, "time_to_checkpoint": lambda: True,
    }


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # the examples' workers, on few cores
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("page", _pages_that_run_examples(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_examples_of_a_page_run(page, tmp_path, monkeypatch, tmp_path_factory):
    """The page's examples in order, in one namespace: each sees the names the examples before it
    defined, except the reader's setup, which is set again before each one."""
    home = tmp_path / "home"
    monkeypatch.setenv(HOME_ENV, str(home))
    monkeypatch.chdir(tmp_path)
    setup = _reader_setup(home, page, tmp_path_factory)
    assert setup["model_id"] == MODEL_ID
    namespace: dict = {}
    ran = []
    try:
        for example in examples(page):
            if example.not_run is not None:
                continue
            namespace.update(setup)
            try:
                exec(compile(example.code, example.where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"the example at {example.where} failed: {exc!r}") from exc
            ran.append(example.where)
    finally:
        setup["store"].close()
    assert ran, f"{page.name}: every example is marked not run"
