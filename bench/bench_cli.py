"""CLI startup benchmark: how long ``dmi --help`` and ``dmi models`` take, process start to exit.

Each command runs as its own process (``python -m dmi.cli``, what the ``dmi`` script runs),
``--runs`` times after one untimed warm-up run (the OS file cache warm, as for a user's
second command); prints the best and the median wall time, and the conditions (CPU
count, load average before and after, Python and platform). ``dmi models`` runs against
a store in a temporary home holding one small capture (the built-in ``tiny-llama``, one
prompt), so it opens the embedded catalog and answers a real query.

    python bench/bench_cli.py              # 7 runs each
    python bench/bench_cli.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "dmi --help": ["--help"],
    "dmi models": ["models"],
}


def dmi(args: list[str], home: str) -> float:
    """Seconds for one ``dmi ARGS --home HOME`` process; fails loudly if the command fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMI_")}
    argv = [sys.executable, "-m", "dmi.cli", *args] + ([] if args == ["--help"] else ["--home", home])
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command (default: 7)")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        dmi(["capture", "--model", "tiny-llama", "--prompt", "bench", "--max-new-tokens", "2", "-q"], home)
        load_before = os.getloadavg()[0]
        rows = []
        for name, args in COMMANDS.items():
            dmi(args, home)  # warm-up
            times = [dmi(args, home) for _ in range(options.runs)]
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
