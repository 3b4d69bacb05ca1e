"""What keeping token strings costs: capture with ``tokenizer=`` vs without, on the demo model.

Workload: the built-in ``tiny-llama`` (what ``dmi demo`` runs: 4 layers, hidden 64, bf16,
byte-level tokenizer of 259 tokens), the demo's 4 prompts left-padded in one batch, greedy
``generate`` with ``--new`` new tokens, on CPU, into a fresh embedded store each time.
Configurations, interleaved round by round so that drift on a shared machine hits all alike:

* ``ids``      ``hooks="resid_post token_ids"``, no tokenizer
* ``strings``  ``hooks="resid_post"``, ``tokenizer=`` (which adds ``token_ids``, and cuts
               ``token_text`` / ``prompt_text`` records from it on the drain thread)

Reported per configuration (median over rounds): model-thread seconds inside DMI's hooks
(``stats["hook_seconds"]``), drain-thread busy seconds, wall seconds of ``generate`` plus the
final flush, records. Then the pieces alone: building the vocabulary table at attach (the
demo tokenizer, and a synthetic 128k-word tokenizer), and cutting one record's strings
(one decode token, a 512-token prompt), and decoding a 512-token prompt's text.

    python bench/bench_token_text.py            # 5 rounds, 16 new tokens
    python bench/bench_token_text.py --quick    # 1 round, 4 new tokens
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import timeit

import torch


def capture_once(loaded, enc, new: int, with_strings: bool) -> dict[str, float]:
    import dmi

    options = {"hooks": "resid_post", "tokenizer": loaded.tokenizer} if with_strings else {
        "hooks": "resid_post token_ids"}
    with tempfile.TemporaryDirectory() as home, dmi.open(home=home) as store:
        with dmi.capture(loaded.model, store=store, model_id="bench", **options) as cap:
            started = time.perf_counter()
            with torch.inference_mode():
                cap.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=new, do_sample=False,
                             pad_token_id=loaded.tokenizer.pad_token_id)
            cap.flush()
            wall = time.perf_counter() - started
            stats = cap.stats
    return {"hook_s": stats["hook_seconds"], "drain_s": stats["drain_busy_seconds"], "wall_s": wall,
            "records": stats["records"]}


def big_tokenizer(words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"wörd{i}": i for i in range(1, words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def pieces(loaded) -> None:
    from dmi.capture._token_text import TokenStrings

    demo = loaded.tokenizer
    print(f"\nattach: vocabulary table, demo tokenizer ({len(demo)} tokens): "
          f"{min(timeit.repeat(lambda: TokenStrings(demo), number=1, repeat=5)) * 1e3:.2f} ms")
    big = big_tokenizer(128_000)
    print(f"attach: vocabulary table, 128,000-word tokenizer: "
          f"{min(timeit.repeat(lambda: TokenStrings(big), number=1, repeat=3)) * 1e3:.1f} ms")
    table = TokenStrings(demo)
    one, prompt = torch.tensor([42]), torch.randint(3, len(demo), (512,))
    for name, ids in (("one decode token", one), ("512-token prompt", prompt)):
        n, best = 2000, min(timeit.repeat(lambda: table.token_record(ids), number=2000, repeat=3))
        print(f"drain: token_text of {name}: {best / n * 1e6:.1f} us per record")
    best = min(timeit.repeat(lambda: table.prompt_record(prompt), number=200, repeat=3))
    print(f"drain: prompt_text of a 512-token prompt (tokenizer.decode): {best / 200 * 1e6:.1f} us per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=16, help="new tokens per prompt")
    parser.add_argument("--quick", action="store_true", help="1 round, 4 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.new = 1, 4
    from dmi._capture_cli import _quiet_transformers
    from dmi._demo import DEMO_PROMPTS
    from dmi._models import load_model

    _quiet_transformers()
    loaded = load_model("tiny-llama")
    enc = loaded.tokenizer(list(DEMO_PROMPTS), return_tensors="pt", padding=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"workload: tiny-llama bf16, batch {enc['input_ids'].shape[0]} x {enc['input_ids'].shape[1]} tokens "
          f"(left-padded), {args.new} new tokens, greedy, {args.rounds} rounds (+1 warm-up)")
    capture_once(loaded, enc, args.new, True)  # warm-up: imports, first chDB open
    results: dict[str, list[dict[str, float]]] = {"ids": [], "strings": []}
    for _ in range(args.rounds):
        for name in results:
            results[name].append(capture_once(loaded, enc, args.new, name == "strings"))
    print(f"\n{'config':<10} {'model-thread s':>15} {'drain busy s':>13} {'wall s':>8} {'records':>8}")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:<10} {med['hook_s']:>15.4f} {med['drain_s']:>13.4f} {med['wall_s']:>8.3f} "
              f"{int(med['records']):>8}")
    pieces(loaded)


if __name__ == "__main__":
    main()
