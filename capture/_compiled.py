"""Capture inside compiled graphs: the copy into ring memory as one registered custom op.

Under ``torch.compile``, dynamo traces module forward hooks into the graph. The eager hooks
(``_session``) cannot be traced: they time themselves (``perf_counter``), reserve ring space
under a ``threading.Condition`` and append Python records, so every hook breaks the graph
(``torch._dynamo.explain`` on a one-layer Llama with ``resid_post`` + ``attn_q``: 10 graphs,
9 breaks). Here the work is split so that the compiled graph holds nothing but tensor ops:

* **before the forward**, outside the compiled region (the model's own pre-hook, run with
  dynamo disabled): the step plan decides which rows each hook keeps and where its bytes go;
  :meth:`Staging.prepare` writes that into small tensors (``rows``: flat token indices;
  ``regions``: per (hook, layer) the byte offset, byte length and dtype code);
* **inside the graph**: each tap calls ``torch.ops.dmi.ring_write(buffer, x, rows, region)``,
  a custom op that mutates only ``buffer`` — a preallocated staging buffer on the model's
  device whose address stays fixed from step to step (what CUDA graph replay needs) — at the
  offset its ``region`` tensor holds. It allocates nothing visible and returns nothing;
* **after the forward**, outside again (the model's post-hook): :meth:`Staging.commit`
  reserves ring space per (hook, layer) exactly as the eager path does and copies the staged
  bytes into it (a memcpy on CPU; on CUDA an asynchronous device-to-pinned copy on the
  session's side stream), with the same :class:`Entry` the eager path writes, so the drain
  turns both into identical records.

The graph therefore sees the same code every step; only tensor values change. A step the
schedule skips flips one Python flag (``active``), which dynamo guards on: one more graph.

Dynamo does not guard on module hooks by default (``torch._dynamo.config.
skip_nnmodule_hook_guards``), and it shares one graph between instances of a model class: a
graph compiled before the taps were installed, or for another instance without taps, would
run without them (records of stale bytes), and one compiled with them would keep calling
the op after detach. So while a compiled session is attached, hook guards are on
(:func:`guard_hooks`), and attach and detach clear torch.compile's in-process caches; the
next call recompiles.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from dmi.storage.errors import AttachError, CaptureError, HookSelectionError, InvalidArgumentError

from ._hooks import HOOKS, ModelGeometry
from ._ring import Entry

__all__ = ["ring_write", "Staging", "compiled_form", "inner_model", "check_compiled_selection",
           "install_compiled_taps", "outside_graph", "guard_hooks", "unguard_hooks"]

_ALIGN = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
"""Dtype codes a region carries (the position in this tuple), checked by the op on CPU."""

_CPU_WRITES = threading.local()
"""How many CPU ``ring_write`` calls this thread has run (``count``): the model thread's
staging compares it before and after a forward, so a graph that skipped the op is caught."""


@torch.library.custom_op("dmi::ring_write", mutates_args=("buffer",))
def ring_write(buffer: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, region: torch.Tensor) -> None:
    """Write ``src[rows]`` (``src``: ``[positions, width]``) into the uint8 ``buffer`` at the
    byte offset ``region[0]``; ``region[1]`` is the byte length and ``region[2]`` the dtype
    code the step plan expects there.

    CPU: the offset is read on the host and the rows gathered straight into the buffer
    (``index_select(out=)``, the eager path's copy); a region that does not match what the
    model produced raises :class:`CaptureError` instead of writing over its neighbour.
    CUDA: the offset is used on the device (positions = offset + arange), so nothing reads
    it on the host and a CUDA graph replays with each step's value; the length and the dtype
    code are checked by ``torch._assert_async`` (a mismatch is a device-side assert, fatal to
    the process's CUDA context, rather than bytes written under another dtype's label).
    """
    n, width = rows.shape[0], src.shape[1]
    nbytes = n * width * src.element_size()
    if buffer.device.type == "cpu":
        offset, length, code = region.tolist()
        if length != nbytes or src.dtype not in _DTYPES or code != _DTYPES.index(src.dtype):
            raise CaptureError(
                f"compiled capture planned {length} bytes of {_DTYPES[code]} for a tensor of "
                f"{nbytes} bytes of {src.dtype} ({n} rows of width {width}); the model produced a "
                "tensor its geometry does not describe (under torch.autocast, or a module that "
                "returns another dtype than the model's); capture it with compiled=False on the "
                "uncompiled model, or run it without autocast"
            )
        dst = buffer.narrow(0, offset, nbytes).view(src.dtype).view(n, width)
        torch.index_select(src, 0, rows, out=dst)
        _CPU_WRITES.count = _cpu_writes() + 1
        return
    torch._assert_async((region[1] == nbytes) & (region[2] == _dtype_code(src.dtype)))
    elements = buffer.view(src.dtype)
    positions = region[0] // src.element_size() + torch.arange(n * width, device=buffer.device)
    elements.index_copy_(0, positions, src.index_select(0, rows).reshape(-1))


@ring_write.register_fake
def _ring_write_fake(buffer, src, rows, region) -> None:
    """Shapes only: the op returns nothing and writes in place."""
    return None


def _cpu_writes() -> int:
    return getattr(_CPU_WRITES, "count", 0)


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"compiled capture cannot stage tensors of dtype {dtype}")
    return _DTYPES.index(dtype)


# -- which models are compiled ------------------------------------------------------------------
def compiled_form(model: nn.Module) -> str | None:
    """How ``model`` was compiled: ``"module"`` (``torch.compile(model)``, an
    ``OptimizedModule``), ``"forward"`` (``model.forward = torch.compile(model.forward)``),
    ``"call"`` (``model.compile()``), ``"submodule"`` (one of its modules compiled in one of
    these ways, e.g. ``model.model.compile()``), or ``None``.

    A compiled submodule counts: a graph it traced before attaching holds no capture hook,
    and only the compiled path clears such graphs (an eager session would run it and record
    nothing of the layers inside it)."""
    own = _own_form(model)
    if own is not None:
        return own
    if any(_own_form(sub) is not None for sub in inner_model(model).modules()):
        return "submodule"
    return None


def _own_form(module: nn.Module) -> str | None:
    """How ``module`` itself (not its children) was compiled, or ``None``."""
    if isinstance(module, torch._dynamo.OptimizedModule):
        return "module"
    if hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable"):
        return "forward"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "call"
    return None


def inner_model(model: nn.Module) -> nn.Module:
    """The model ``torch.compile(model)`` wrapped (``model`` itself otherwise)."""
    while isinstance(model, torch._dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def check_compiled_selection(hooks: dict[str, tuple[int, ...]], tp_size: int) -> None:
    """Refuse, before anything is installed, what compiled capture does not do."""
    if "attn_pattern" in hooks:
        raise HookSelectionError(
            "attn_pattern cannot be captured in a compiled model (it needs eager attention and "
            "one ragged copy per request); capture it with compiled=False on an uncompiled model"
        )
    if tp_size > 1:
        raise AttachError("compiled capture of a tensor-parallel shard is not supported; pass compiled=False")


_GUARDED = {"sessions": 0, "saved": True}
_GUARDED_LOCK = threading.Lock()


def guard_hooks() -> None:
    """A compiled session starts (or an eager one, where code was traced before it): dynamo
    guards on module hooks from now on, so a graph traced without the taps never runs where
    they are installed, nor one traced with them where they are not. Clears the process's in-memory torch.compile caches (graphs traced
    before hold no such guard): every compiled model recompiles once."""
    with _GUARDED_LOCK:
        if _GUARDED["sessions"] == 0:
            _GUARDED["saved"] = torch._dynamo.config.skip_nnmodule_hook_guards
            torch._dynamo.config.skip_nnmodule_hook_guards = False
        _GUARDED["sessions"] += 1
        torch.compiler.reset()


def traced_before() -> bool:
    """Whether torch.compile traced any code in this process since its caches were last
    cleared: a graph traced before an eager session's hooks were installed holds none of them
    and, unguarded, would run in place of the hooked forward (nothing captured, no error)."""
    return bool(torch._dynamo.convert_frame.input_codes.seen)


def unguard_hooks() -> None:
    """A session that guarded hooks ended: clear the caches again (graphs traced with its taps would
    call the op) and, when it was the last, restore the hook-guard setting."""
    with _GUARDED_LOCK:
        _GUARDED["sessions"] -= 1
        if _GUARDED["sessions"] == 0:
            torch._dynamo.config.skip_nnmodule_hook_guards = _GUARDED["saved"]
        torch.compiler.reset()


def outside_graph(fn):
    """``fn`` (a model-level hook) always runs as Python, never traced into a graph."""
    return torch._dynamo.disable(fn, recursive=True)


# -- the staging buffer ------------------------------------------------------------------------
class Staging:
    """The fixed-address buffer compiled taps write into, and this step's layout of it.

    ``emissions``: the compiled (hook, layer) pairs in a fixed order — emission ``k`` writes
    region ``k``. The buffer grows (to at least twice its size) only when a step needs more
    than it holds; a new buffer is a new address, which recompiles once.
    """

    def __init__(self, emissions: list[tuple[str, int]], geometry: ModelGeometry, device: torch.device):
        self.emissions = list(emissions)
        self.device = torch.device(device)
        self._widths = [math.prod(HOOKS[h].feature_shape(geometry)) for h, _ in self.emissions]
        self._dtypes = [HOOKS[h].dtype(geometry) for h, _ in self.emissions]
        self._codes = [_dtype_code(d) for d in self._dtypes]
        self.buffer = self._alloc(_ALIGN)
        self.regions = torch.zeros(max(len(self.emissions), 1), 3, dtype=torch.int64, device=self.device)
        self.rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.active = False
        self._layout: list[tuple[int, int]] = []  # (offset, nbytes) per emission, this step
        self._writes_before = 0
        self._plan = None
        self._full_rows: dict[int, torch.Tensor] = {}

    def _alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch._dynamo.mark_static_address(buf)
        return buf

    def index_of(self, hook: str, layer: int) -> int:
        return self.emissions.index((hook, layer))

    def prepare(self, plan) -> None:
        """Lay out this step (``plan`` is the step plan, ``None`` when nothing is captured)."""
        self._plan = plan
        self.active = plan is not None and bool(self.emissions)
        if not self.active:
            return
        n = plan.n_rows
        layout, offset = [], 0
        for width, dtype in zip(self._widths, self._dtypes):
            nbytes = n * width * dtype.itemsize
            layout.append((offset, nbytes))
            offset += (nbytes + _ALIGN - 1) & ~(_ALIGN - 1)
        if offset > self.buffer.numel():
            self.buffer = self._alloc(max(offset, 2 * self.buffer.numel()))
        self._layout = layout
        regions = torch.tensor([(o, b, c) for (o, b), c in zip(layout, self._codes)], dtype=torch.int64)
        self.regions.copy_(regions, non_blocking=True)
        self.rows = self._rows(plan)
        self._writes_before = _cpu_writes()

    def _rows(self, plan) -> torch.Tensor:
        index = plan.index_on(self.device)
        if index is not None:
            return index
        count = plan.batch * plan.tokens
        rows = self._full_rows.get(count)
        if rows is None:
            rows = self._full_rows[count] = torch.arange(count, device=self.device)
        return rows

    def commit(self, ring, drain, copy) -> None:
        """Move this step's staged bytes into the ring, one reservation per (hook, layer) as the
        eager path makes them; a reservation the drop policy refuses is counted as a loss.
        ``copy(dst, src)`` copies two uint8 views (the session's CPU or CUDA copy)."""
        plan = self._plan
        self._plan = None
        if plan is None or not self.active:
            return
        self._check_written()
        for (hook, layer), (offset, nbytes), dtype in zip(self.emissions, self._layout, self._dtypes):
            res = ring.reserve(nbytes, check=drain.check)
            if res is None:
                drain.note_loss(hook, layer, plan)
                continue
            slot, off = res
            copy(slot.buffer[off : off + nbytes], self.buffer[offset : offset + nbytes])
            slot.entries.append(Entry(hook, layer, off, nbytes, dtype, plan.n_rows, plan))
            ring.stats.copies += 1


    def _check_written(self) -> None:
        """On CPU every staged region must have been written by this forward; otherwise the
        graph that ran lacks the taps and the staged bytes are stale. (On CUDA a replayed
        graph runs the op without calling back into Python, so there is nothing to count.)"""
        if self.device.type != "cpu":
            return
        written = _cpu_writes() - self._writes_before
        if written != len(self.emissions):
            raise CaptureError(
                f"the compiled forward ran the capture op {written} times for {len(self.emissions)} "
                "staged (hook, layer) tensors: the graph that ran was not traced with the capture "
                "taps; nothing of this step is recorded"
            )


def install_compiled_taps(taps, staging: Staging) -> list:
    """One traceable forward hook per tap: each emission's tensor goes through ``ring_write``."""
    handles = []
    for tap in taps:
        items = [(staging.index_of(em.hook, em.layer), em.extract, em.layout) for em in tap.emissions]
        if tap.kind == "pre":
            handles.append(tap.module.register_forward_pre_hook(_pre_writer(items, staging), with_kwargs=True))
        else:
            handles.append(tap.module.register_forward_hook(_post_writer(items, staging), with_kwargs=True))
    return handles


def _write(items, staging: Staging, args, kwargs, output) -> None:
    if not staging.active:
        return
    for k, extract, layout in items:
        x = extract(args, kwargs, output).detach()
        flat = x.reshape(x.shape[0] * x.shape[1], -1) if layout == "bt" else x.reshape(x.shape[0], -1)
        torch.ops.dmi.ring_write(staging.buffer, flat, staging.rows, staging.regions[k])


def _pre_writer(items, staging: Staging):
    def hook(module, args, kwargs):
        _write(items, staging, args, kwargs, None)

    return hook


def _post_writer(items, staging: Staging):
    def hook(module, args, kwargs, output):
        _write(items, staging, args, kwargs, output)

    return hook
