"""The model thread's cost per captured tensor, piece by piece: how the ring region a hook
copies into is made, against how it was made before stop 36.

Every hook call reserves a region of the open ring slot and copies its tensor there
(``capture/_session.py``, ``_emit``). Until stop 36 the region was made by slicing the
slot's ``uint8`` buffer and viewing the slice twice (dtype, then shape); since then it is one
``as_strided`` over a view of the whole buffer in that dtype, made once per slot and dtype
(``Slot.rows``). Timed here in a loop on one thread, under ``torch.inference_mode`` as a
capture runs, for a decode-sized region (``[8, 576]`` bf16, SmolLM2's hidden size) and a
prefill-sized one (``[1024, 576]``); plus the copy into it, for scale. Last, what a hook's
call costs when it runs outside any graph (``outside_graph``), as every Python hook of a
session does since stop 38, against a plain call. Idle-machine figures;
under a model that keeps both cores busy each piece takes several times longer
(``bench_capture.py``'s ``hooks only`` row measures the whole hook path there).

    python bench/bench_hook_path.py
"""

from __future__ import annotations

import os
import platform
import time

import torch

from dmi.capture._ring import Ring

_CALLS = 50_000


def per_call_us(fn, calls: int = _CALLS, rounds: int = 5) -> float:
    """Best of ``rounds`` of ``calls`` calls, microseconds a call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def main() -> None:
    ring = Ring(1, 32 << 20, pin=False)
    slot, _ = ring.reserve(16)
    rows = []
    with torch.inference_mode():
        for n, width in ((8, 576), (1024, 576)):
            src = torch.randn(n, width).to(torch.bfloat16)
            nbytes = src.numel() * src.element_size()
            off = 4096
            buffer = slot.buffer

            def sliced(off=off, nbytes=nbytes, n=n, width=width):
                return buffer[off : off + nbytes].view(torch.bfloat16).view(n, width)

            def strided(off=off, n=n, width=width):
                return slot.rows(off, torch.bfloat16, n, width)

            assert torch.equal(sliced().copy_(src), strided())
            dst = strided()
            rows.append((f"[{n}, {width}] bf16", per_call_us(sliced), per_call_us(strided),
                         per_call_us(lambda: dst.copy_(src))))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}; load average {os.getloadavg()[0]:.2f}; best of 5 x {_CALLS} calls\n")
    print("| region | slice + 2 views (before) µs | one strided view (Slot.rows) µs | the copy into it µs |")
    print("|---|---:|---:|---:|")
    for name, before, after, copy in rows:
        print(f"| {name} | {before:.2f} | {after:.2f} | {copy:.2f} |")
    plain, outside = hook_call_us()
    print("\n| a forward hook's call | µs |\n|---|---:|")
    print(f"| plain Python function | {plain:.2f} |\n| run outside any graph (``outside_graph``, since stop 38) | {outside:.2f} |")


def hook_call_us() -> tuple[float, float]:
    """A hook's call, plain and wrapped as every Python hook of a session is since stop 38
    (``torch._dynamo.disable``: a compile DMI did not see breaks its graph there)."""
    from dmi.capture._compiled import outside_graph

    def hook(module, args, kwargs, output):
        return None

    wrapped = outside_graph(hook)
    return per_call_us(lambda: hook(None, (), {}, None)), per_call_us(lambda: wrapped(None, (), {}, None))


if __name__ == "__main__":
    main()
