"""A pack writer's start in a fresh process: what making the writer costs, and what its first
seal costs, with pyarrow's lazy imports run when the writer is made (today) and left to the
first seal (before stop 31). The first seal runs on a capture's drain thread beside the model,
holding the GIL while it imports; making the writer happens before the model runs.

    python bench/bench_first_seal.py [--rounds 5]

Each round is a new interpreter (``sys.executable``) that imports ``dmi.storage``, makes a
writer, then appends one 64 x 512 float32 record and seals, twice; median (min–max) seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time, torch
from dmi.storage import PackStore, PackWriter, RecordKey, _writer
if sys.argv[2] == "at the first seal":
    _writer._run_arrow_lazy_imports = lambda: None
record = torch.ones(64, 512)
t0 = time.perf_counter()
writer = PackWriter(PackStore.local(sys.argv[1]))
t1 = time.perf_counter()
seals = []
for n in range(2):
    t = time.perf_counter()
    writer.append(RecordKey("model", "run", f"req-{n}", "resid_post", 0, 0, 64), record)
    writer.seal()
    seals.append(time.perf_counter() - t)
print(json.dumps({"make": t1 - t0, "first": seals[0], "second": seals[1], "pandas": "pandas" in sys.modules}))
"""

MODES = ("when the writer is made", "at the first seal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="dmi-first-seal-") as tmp:
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(tmp, f"{r}-{len(runs[mode])}"), mode],
                                     capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout))
    print(f"{args.rounds} rounds, a fresh interpreter each; load average {os.getloadavg()[0]:.2f} at the end")
    print("| pyarrow's lazy imports run | writer made, s | first seal, s | second seal, s | pandas imported |")
    print("|---|---:|---:|---:|---|")
    for mode, rows in runs.items():
        cells = []
        for k in ("make", "first", "second"):
            v = [row[k] for row in rows]
            cells.append(f"{statistics.median(v):.4f} ({min(v):.4f}–{max(v):.4f})")
        print(f"| {mode} | {' | '.join(cells)} | {'yes' if all(r['pandas'] for r in rows) else 'no'} |")


if __name__ == "__main__":
    main()
