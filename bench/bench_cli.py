"""CLI startup benchmark: how long ``dmi --help``, ``dmi models``, ``dmi requests`` and ``dmi show``
take, process start to exit.

Each command runs as its own process (``python -m dmi.cli``, what the ``dmi`` script runs),
``--runs`` times after one untimed warm-up run (the OS file cache warm, as for a user's
second command); prints the best and the median wall time, and the conditions (CPU
count, load average before and after, Python and platform). The store commands run against
a temporary home holding one small capture (the built-in ``tiny-llama``, one prompt), so
they open the embedded catalog and answer a real query; ``dmi show`` also reads the
request's token records from its packs (as checked bytes, without torch). ``import torch``
alone, in a process of its own, is the floor of any command that reads tensors.

    python bench/bench_cli.py              # 7 runs each
    python bench/bench_cli.py --runs 3
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

def commands(request_id: str) -> dict[str, list[str]]:
    """Each row's argv after ``python``: the DMI commands, and the floor (``import torch``)."""
    return {
        "dmi --help": ["-m", "dmi.cli", "--help"],
        "dmi models": ["-m", "dmi.cli", "models"],
        "dmi requests tiny-llama": ["-m", "dmi.cli", "requests", "tiny-llama"],
        "dmi show tiny-llama REQUEST": ["-m", "dmi.cli", "show", "tiny-llama", request_id],
        "python -c 'import torch' (floor of a tensor read)": ["-c", "import torch"],
    }


def run(args: list[str], home: str) -> float:
    """Seconds for one ``python ARGS`` process (``--home HOME`` added to a store command);
    fails loudly if the command fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMI_")}
    store = args[:2] == ["-m", "dmi.cli"] and args[2] != "--help"
    argv = [sys.executable, *args] + (["--home", home] if store else [])
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def capture_one(home: str) -> str:
    """Capture one prompt with the built-in model; its request id."""
    subprocess.run([sys.executable, "-m", "dmi.cli", "capture", "--model", "tiny-llama", "--prompt", "bench",
                    "--max-new-tokens", "2", "-q", "--home", home], check=True, stdout=subprocess.DEVNULL)
    listed = subprocess.run([sys.executable, "-m", "dmi.cli", "requests", "tiny-llama", "--json", "--home", home],
                            check=True, capture_output=True, text=True)
    return json.loads(listed.stdout)[0]["request_id"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command (default: 7)")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        request_id = capture_one(home)
        load_before = os.getloadavg()[0]
        rows = []
        for name, args in commands(request_id).items():
            run(args, home)  # warm-up
            times = [run(args, home) for _ in range(options.runs)]
            rows.append((name, min(times), statistics.median(times)))
        load_after = os.getloadavg()[0]
    print(f"{platform.python_implementation()} {platform.python_version()}, {platform.system()} "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load_before:.1f} before, "
          f"{load_after:.1f} after; best and median of {options.runs} runs after one warm-up\n")
    print("| command | best | median |")
    print("|---|---|---|")
    for name, best, median in rows:
        print(f"| `{name}` | {best:.2f} s | {median:.2f} s |")


if __name__ == "__main__":
    main()
