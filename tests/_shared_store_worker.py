"""A capture process for tests/test_shared_store.py: ``python -m tests._shared_store_worker``.

Arguments: home model_id run_id tp_rank tp_size batches [step]. Captures ``resid_post`` of a
tiny GPT-2 into the store at ``home`` (every TP rank writes its copy: ``tp_replicas="all"``),
one forward of three requests per batch, flushing (seal + publish) after each, and prints ``BATCH <n> <request ids as JSON>``. With ``step``
it then waits for a line on stdin before the next batch, so the test decides when the
capture goes on; otherwise it runs straight through. Prints ``DONE`` at the end.
"""

from __future__ import annotations

import json
import sys

import dmi
from tests._models import left_padded_batch, tiny


def main(argv: list[str]) -> int:
    home, model_id, run_id, tp_rank, tp_size, batches = argv[:6]
    step = len(argv) > 6 and argv[6] == "step"
    model = tiny("gpt2")
    with dmi.open(home=home) as store:
        with dmi.capture(model, store=store, hooks="resid_post", model_id=model_id, run_id=run_id,
                         tp_rank=int(tp_rank), tp_size=int(tp_size), tp_replicas="all") as cap:
            for batch in range(int(batches)):
                ids, mask = left_padded_batch(seed=batch + 1)
                request_ids, _ = cap.forward(ids, attention_mask=mask)
                cap.flush()
                print("BATCH", batch, json.dumps(list(request_ids)), flush=True)
                if step:
                    sys.stdin.readline()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
