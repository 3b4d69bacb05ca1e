"""How long ``dmi audit`` of 8 requests takes (issue 17: "seconds on this machine" for 135M parameters).

Workload: the model (default ``smollm2``, SmolLM2-135M-Instruct as ``dmi.load_model`` gives it,
float32; or a built-in one) generates greedily for ``--requests`` prompts of different lengths
(left-padded batches of 4, windows of a fixed English text, ``bench/_real_model.py``) with
``--new`` new tokens, captured with every hook but ``attn_pattern`` into a temporary store; the
capture is not timed. Then, in ``--rounds`` rounds:

* ``store.audit``: ``store.audit(model_id, model=model, requests=8)`` with the model already in
  memory: reads the sampled records, re-runs each request alone, compares every hook and layer
* ``dmi audit`` (CLI): ``dmi audit MODEL_ID --model NAME --requests 8`` in a fresh process, so
  also the imports and the model's load (from the DMI home's cache for ``smollm2``)

Reported: seconds per round (median and all), checks made, verdict, and the load average.

    python bench/bench_audit.py                        # smollm2, 8 requests, 3 rounds
    python bench/bench_audit.py --model tiny-llama     # a built-in model with random weights
    python bench/bench_audit.py --quick                # one round, 4 new tokens
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PROMPT_LENGTHS = (24, 9, 17, 31, 12, 5, 20, 14)


def capture(store, model, tokenizer, args) -> str:
    """Capture ``args.requests`` prompts in left-padded batches of 4; returns the model id."""
    import dmi
    from _real_model import TEXT

    words = TEXT.split()
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(args.requests)]
    prompts = [" ".join(words[3 * i: 3 * i + n]) for i, n in enumerate(lengths)]
    with dmi.capture(model, hooks="all_but_patterns token_ids", store=store, model_id=args.model) as cap:
        for start in range(0, len(prompts), 4):
            enc = tokenizer(prompts[start:start + 4], return_tensors="pt", padding=True)
            with torch.inference_mode():
                cap.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=args.new,
                             min_new_tokens=args.new, do_sample=False)
        return cap.model_id


def audit_in_process(store, model_id, model, n) -> tuple[float, int, bool]:
    started = time.perf_counter()
    report = store.audit(model_id, model=model, requests=n)
    return time.perf_counter() - started, len(report.checks), report.passed


def audit_cli(home, model_id, model_name, n) -> tuple[float, int, bool]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dmi.cli", "audit", model_id, "--model", model_name,
                           "--requests", str(n), "--home", home, "--json"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"dmi audit failed ({proc.returncode}): {proc.stderr.strip()}")
    return seconds, len(json.loads(proc.stdout)["checks"]), proc.returncode == 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or a built-in model name")
    parser.add_argument("--requests", type=int, default=8, help="requests captured and audited (default 8)")
    parser.add_argument("--new", type=int, default=8, help="new tokens per request (default 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, 4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.new = 1, 4

    import dmi

    loaded = dmi.load_model(args.model)  # converts smollm2 into the DMI home's cache the first time
    model, tokenizer = loaded.model, loaded.tokenizer
    results: dict[str, list] = {"store.audit": [], "dmi audit (CLI, fresh process)": []}
    with tempfile.TemporaryDirectory(prefix="dmi-bench-audit-") as home:
        with dmi.open(home=home) as store:
            model_id = capture(store, model, tokenizer, args)
        for r in range(args.rounds):
            with dmi.open(home=home) as store:
                results["store.audit"].append(audit_in_process(store, model_id, model, args.requests))
            results["dmi audit (CLI, fresh process)"].append(audit_cli(home, model_id, args.model, args.requests))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.1f}s" for k, v in results.items()), file=sys.stderr)

    config = model.config
    print(f"\n{args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {model.dtype}; "
          f"{args.requests} requests (prompts {', '.join(map(str, PROMPT_LENGTHS[:args.requests]))} words, "
          f"left-padded batches of 4), {args.new} new tokens, every hook but attn_pattern; {args.rounds} round(s)")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}; "
          f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print(f"| audit of {args.requests} requests | seconds (median) | every round | hook/layer checks | passed |")
    print("|---|---:|---|---:|---|")
    for name, rows in results.items():
        secs = [s for s, _, _ in rows]
        print(f"| {name} | {statistics.median(secs):.2f} | {', '.join(f'{s:.2f}' for s in secs)} | "
              f"{rows[-1][1]} | {all(ok for _, _, ok in rows)} |")


if __name__ == "__main__":
    main()
