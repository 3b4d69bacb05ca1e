"""What loading the real model costs once its cache exists: ``dmi.load_model("smollm2")``
against what a user would otherwise run, and the checks inside it alone.

Every load of ``smollm2`` hashes its cache (``model.safetensors`` and the small files) and the
installed package's GGUF file, so that a damaged cache is never loaded and an upgraded package
is converted anew (``docs/quickstart.md``). This measures what those checks cost beside the
load itself. Configurations, interleaved round by round so that drift hits all alike, all with
the page cache warm (each file read once before the first round; this benchmark does not drop
caches):

* ``dmi.load_model``   ``dmi.load_model("smollm2", home=...)``: check, then load (float32)
* ``from_pretrained``  ``AutoModelForCausalLM`` + ``AutoTokenizer.from_pretrained`` of the same
                       cache directory, no check: what loading a saved model costs anyway
* ``sha256 of the files``  SHA-256 of every cache file and of the GGUF file: the checks' floor
* ``from the GGUF``    ``from_pretrained(dir, gguf_file=...)``: what every load would cost
                       without a cache (``--gguf`` only; about a minute a round)

Reported per configuration: the median and range of wall seconds over the rounds, and for the
files the bytes hashed and the rate.

    python bench/bench_model_load.py              # 5 rounds
    python bench/bench_model_load.py --gguf       # with the GGUF conversion rows
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def sha256_all(paths: list[Path]) -> None:
    """Hash every file as a load's check does (the same function)."""
    from dmi._real_model import _sha256

    for path in paths:
        _sha256(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gguf", action="store_true", help="also time loading from the GGUF file")
    parser.add_argument("--home", default=os.environ.get("DMI_HOME"),
                        help="the DMI home holding the cache (default: $DMI_HOME, else the default home)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dmi
    from dmi._real_model import REAL_MODELS, locate_gguf, reading

    quiet = lambda line: None  # noqa: E731 - the conversion's progress lines are not measured
    spec = REAL_MODELS["smollm2"]
    with reading(spec, home=args.home, progress=quiet) as cache:  # converts first if needed, unclocked
        gguf = locate_gguf(spec)
        files = sorted(p for p in cache.iterdir() if p.is_file()) + [gguf]
        hashed = sum(p.stat().st_size for p in files)
        sha256_all(files)  # warms the page cache for every configuration

        configs = {
            "dmi.load_model": lambda: dmi.load_model("smollm2", home=args.home, progress=quiet),
            "from_pretrained": lambda: (AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32),
                                        AutoTokenizer.from_pretrained(cache)),
            "sha256 of the files": lambda: sha256_all(files),
        }
        if args.gguf:
            configs["from the GGUF"] = lambda: (
                AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32),
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
        seconds: dict[str, list[float]] = {name: [] for name in configs}
        load = os.getloadavg()[0]
        started = time.strftime("%H:%M:%S", time.gmtime())
        for _ in range(args.rounds):
            for name, fn in configs.items():
                seconds[name].append(timed(fn))

    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}; "
          f"{started}-{time.strftime('%H:%M:%S', time.gmtime())} UTC, load average (1 min) {load:.2f} at the "
          f"start, {os.getloadavg()[0]:.2f} at the end; {args.rounds} rounds, interleaved, page cache warm")
    print(f"Files hashed by every load: {len(files)}, {hashed / 1e6:.0f} MB ({gguf.name} "
          f"{gguf.stat().st_size / 1e6:.0f} MB)\n")
    print("| configuration | median s | min-max s |")
    print("|---|---|---|")
    for name, values in seconds.items():
        rate = f" ({hashed / statistics.median(values) / 1e9:.2f} GB/s)" if name.startswith("sha256") else ""
        print(f"| {name}{rate} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
