"""Many capture processes publishing at once into one catalog and one pack store.

Used by ``tests/test_many_writers.py`` (the checks) and ``bench/bench_many_writers.py`` (the
timings). Each writer is a child process (``python -m tests._writers child ...``) that captures
a tiny Llama (``tests/_models.py``, random weights) through the real capture path — hooks,
ring, drain, pack writer, publisher lease — for one or more runs of one model id (optionally as
one tensor-parallel rank of them), into the pack store and catalog URIs it is given. It writes a side file (JSON lines) of what it did:

* ``record``: the key of each record it appends, with the SHA-256 of the tensor's bytes,
  its dtype, shape and byte count (the digest is skipped with ``--no-digest``, for timing);
* ``publish``: each call of the publisher lease's ``publish``: scope, pack ids, records, and
  the wall-clock start and end of the call;
* ``requests``: the request ids each run's ``generate`` returned;
* ``ready`` / ``go`` / ``done``: when it had its model, store and catalog open; when it was
  told to start; when it finished.

Children start at once: each opens its catalog (the first open creates the schema) and says
``ready``, then waits for a *go file* the parent creates when every child is ready, so the
captures overlap and start-up (importing torch) is not timed.

:func:`check_writers` is what "nothing lost, nothing visible twice, every run complete" means,
counted through one store (one replica's catalog URI + the bucket).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests._side_file import SideFile, tensor_digest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = "resid_post attn_q mlp_out token_ids"
GO_TIMEOUT = 300.0


# ---------------------------------------------------------------------------------- the child


def _record_appends(side: SideFile, digest: bool) -> None:
    """Wrap ``PackWriter.append`` (in the child only) to report each record before it is appended."""
    from dmi.storage import PackWriter

    append = PackWriter.append

    def recording_append(self, key, data, **kwargs):
        side.write(record=dataclasses.astuple(key), sha256=tensor_digest(data) if digest else None,
                   dtype=str(data.dtype), shape=list(data.shape), nbytes=data.numel() * data.element_size())
        return append(self, key, data, **kwargs)

    PackWriter.append = recording_append


def _time_publishes(side: SideFile) -> None:
    """Wrap the publisher lease's ``publish`` (in the child only) to report what it published and
    how long the call took (index rows, lease check, watermark)."""
    from dmi.catalog._leases import Publisher

    publish = Publisher.publish

    def timed_publish(self, descriptors):
        descriptors = list(descriptors)
        started = time.time()
        watermark = publish(self, descriptors)
        side.write(publish={"scope": self.scope, "pack_ids": [d.pack_id for d in descriptors],
                            "records": sum(len(d.records) for d in descriptors), "start": started,
                            "end": time.time()})
        return watermark

    Publisher.publish = timed_publish


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {path} within {timeout}s")
        time.sleep(0.01)


def child_main(args: argparse.Namespace) -> None:
    """Open the store and catalog, say ready, wait for the go file, capture each run, say done."""
    side = SideFile(args.side)
    _record_appends(side, digest=not args.no_digest)
    _time_publishes(side)
    from dmi.capture import attach
    from dmi.catalog import open_catalog
    from dmi.storage import PackStore
    from tests._models import left_padded_batch, tiny

    model = tiny("llama")
    store = PackStore.from_uri(args.packs)
    catalog = open_catalog(args.catalog)
    side.write(ready=time.time())
    _wait_for(Path(args.go), GO_TIMEOUT)
    side.write(go=time.time())
    ranks = {} if args.tp_size is None else {"tp_rank": args.tp_rank, "tp_size": args.tp_size, "tp_replicas": "all"}
    for i, run_id in enumerate(args.runs.split(",")):
        ids, mask = left_padded_batch(seed=args.seed * 1000 + i)
        with attach(model, hooks=args.hooks, store=store, catalog=catalog, model_id=args.model_id, run_id=run_id,
                    writer_options={"max_records": args.max_records}, decode_chunk_steps=args.chunk_steps,
                    **ranks) as cap:
            result = cap.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False)
        side.write(requests={"run_id": run_id, "request_ids": list(result.request_ids)})
    catalog.close()
    side.write(done=time.time())
    side.close()


# ---------------------------------------------------------------------------------- the parent


@dataclass(frozen=True, slots=True)
class Writer:
    """One capture process to start: its model id, runs, and where it publishes."""

    name: str
    model_id: str
    run_ids: tuple[str, ...]
    catalog: str
    packs: str
    seed: int = 1
    tp: tuple[int, int] | None = None  # (rank, size): one tensor-parallel rank of its runs
    hooks: str = HOOKS  # a TP rank of an unsharded model: replicated hooks only (resid_post, token_ids)

    def scope(self, run_id: str) -> str:
        """The publishing scope capture gives this writer's run (``default_publish_scope``)."""
        scope = f"capture/{self.model_id}/{run_id}"
        return f"{scope}/tp{self.tp[0]}" if self.tp is not None and self.tp[1] > 1 else scope


@dataclass(frozen=True, slots=True)
class Publish:
    """One ``publish`` call in a child: its scope, packs, records, and wall-clock span."""

    scope: str
    pack_ids: tuple[str, ...]
    records: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class WriterEvents:
    """What one child reported (see the module docstring)."""

    appended: tuple[tuple[tuple, str | None, str, tuple[int, ...]], ...]  # (key, sha256, dtype, shape)
    payload_bytes: int
    publishes: tuple[Publish, ...]
    requests: dict[str, tuple[str, ...]]
    go_at: float | None
    done_at: float | None

    @staticmethod
    def read(path: Path) -> WriterEvents:
        appended, payload, publishes, requests, go, done = [], 0, [], {}, None, None
        for line in path.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if "record" in event:
                appended.append((tuple(event["record"]), event["sha256"], event["dtype"], tuple(event["shape"])))
                payload += event["nbytes"]
            elif "publish" in event:
                p = event["publish"]
                publishes.append(Publish(p["scope"], tuple(p["pack_ids"]), p["records"], p["start"], p["end"]))
            elif "requests" in event:
                requests[event["requests"]["run_id"]] = tuple(event["requests"]["request_ids"])
            go = event.get("go", go)
            done = event.get("done", done)
        return WriterEvents(tuple(appended), payload, tuple(publishes), requests, go, done)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished child: its writer, exit code, output tail and side events."""

    writer: Writer
    returncode: int
    output: str
    events: WriterEvents


def _command(writer: Writer, side: Path, go: Path, *, tokens: int, max_records: int, chunk_steps: int,
             digest: bool) -> list[str]:
    command = [sys.executable, "-m", "tests._writers", "child", "--packs", writer.packs, "--catalog", writer.catalog,
               "--model-id", writer.model_id, "--hooks", writer.hooks, "--runs", ",".join(writer.run_ids), "--side", str(side),
               "--go", str(go), "--tokens", str(tokens), "--max-records", str(max_records),
               "--chunk-steps", str(chunk_steps), "--seed", str(writer.seed)]
    if writer.tp is not None:
        command += ["--tp-rank", str(writer.tp[0]), "--tp-size", str(writer.tp[1])]
    return command if digest else [*command, "--no-digest"]


def run_writers(writers: list[Writer], workdir: Path, *, tokens: int = 3, max_records: int = 5,
                chunk_steps: int = 1, digest: bool = True, timeout: float = 600.0) -> list[Outcome]:
    """Start every writer as its own process, let them capture at once (the go file), and wait
    for all of them. Raises ``RuntimeError`` if one dies before it is ready or the wait runs out."""
    workdir.mkdir(parents=True, exist_ok=True)
    go = workdir / "go"
    sides = [workdir / f"{w.name}.jsonl" for w in writers]
    logs = [open(workdir / f"{w.name}.log", "wb") for w in writers]  # noqa: SIM115 - closed below
    procs = []
    try:
        for writer, side, log in zip(writers, sides, logs):
            procs.append(subprocess.Popen(_command(writer, side, go, tokens=tokens, max_records=max_records,
                                                   chunk_steps=chunk_steps, digest=digest),
                                          cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        _wait_until_ready(procs, sides, workdir, timeout)
        go.touch()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    return [Outcome(w, p.returncode, (workdir / f"{w.name}.log").read_text(errors="replace")[-4000:],
                    WriterEvents.read(s)) for w, p, s in zip(writers, procs, sides)]


def _wait_until_ready(procs, sides: list[Path], workdir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(s.exists() and '"ready"' in s.read_text(encoding="utf-8") for s in sides):
        for proc, side in zip(procs, sides):
            if proc.poll() is not None:
                log = workdir / f"{side.stem}.log"
                raise RuntimeError(f"writer {side.stem} exited ({proc.returncode}) before it was ready: "
                                   f"{log.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"writers not ready within {timeout}s")
        time.sleep(0.05)


# ---------------------------------------------------------------------------------- the checks


@dataclass(frozen=True, slots=True)
class WritersCheck:
    """What one store shows of the writers' work: every count but ``published`` must be 0.

    * ``lost``: appended records that are not published (or not readable at all)
    * ``double_visible``: published records whose key readers see more than once
    * ``mismatched``: published records whose bytes, dtype or shape differ from what was appended
    * ``unexpected``: published records of the writers' models that no writer appended
    * ``incomplete_runs``: runs whose requests, record count or watermarks fall short of what
      their writer reported
    * ``unpublished_packs``: packs in the store that no visible watermark names
    """

    published: int
    lost: int
    double_visible: int
    mismatched: int
    unexpected: int
    incomplete_runs: int
    unpublished_packs: int
    notes: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not (self.lost or self.double_visible or self.mismatched or self.unexpected
                    or self.incomplete_runs or self.unpublished_packs)


def check_writers(store, outcomes: list[Outcome]) -> WritersCheck:
    """Count, through ``store`` (a ``dmi.Store``), what the writers' side files say must be there."""
    expected = {key: (sha, dtype, shape) for o in outcomes for key, sha, dtype, shape in o.events.appended}
    models = sorted({o.writer.model_id for o in outcomes} & set(store.catalog.models()))
    entries = [e for m in models for e in store.catalog.find_records(m)]
    keys = [dataclasses.astuple(e.meta.key) for e in entries]
    double = sum(n - 1 for n in collections.Counter(keys).values())
    mismatched, unreadable, notes = _compare(store.packs, entries, expected)
    published = set(keys) - unreadable
    lost = len(set(expected) - published)
    unexpected = len(set(keys) - set(expected))
    incomplete, run_notes = _incomplete_runs(store, outcomes)
    unpublished = set(store.packs.list_packs()) - store.catalog.published_pack_ids()
    notes += run_notes + [f"pack {p} is in the store but not published" for p in sorted(unpublished)[:5]]
    return WritersCheck(len(entries), lost, double, mismatched, unexpected, incomplete, len(unpublished),
                        tuple(notes))


def _compare(packs, entries, expected) -> tuple[int, set[tuple], list[str]]:
    """Read every published record back (one read per pack) and compare it with what was appended.
    Returns the mismatched count, the keys that could not be read, and notes."""
    from dmi.reader import read_records
    from dmi.storage import PackError

    by_pack = collections.defaultdict(list)
    for entry in entries:
        by_pack[entry.pack_id].append(entry)
    bad, unreadable, notes = 0, set(), []
    for pack_id, group in sorted(by_pack.items()):
        try:
            tensors = read_records(packs, group)
        except PackError as exc:
            unreadable.update(dataclasses.astuple(e.meta.key) for e in group)
            notes.append(f"pack {pack_id}: {len(group)} published records unreadable: {exc}")
            continue
        for entry, tensor in zip(group, tensors):
            key = dataclasses.astuple(entry.meta.key)
            want = expected.get(key)
            got = (tensor_digest(tensor), str(tensor.dtype), tuple(tensor.shape))
            if want is not None and want != got:
                bad += 1
                notes.append(f"{entry.meta.key.describe()}: appended {want}, read back {got}")
    return bad, unreadable, notes[:5]


def _incomplete_runs(store, outcomes: list[Outcome]) -> tuple[int, list[str]]:
    """Runs whose listing (``store.runs`` / ``store.requests``) or watermarks miss something
    their writers (one, or every tensor-parallel rank of the run) reported appending, getting
    back from ``generate`` or publishing."""
    summaries = {(r.model_id, r.run_id): r for r in store.runs()}
    by_run = collections.defaultdict(list)
    for outcome in outcomes:
        for run_id in outcome.writer.run_ids:
            by_run[(outcome.writer.model_id, run_id)].append(outcome)
    incomplete, notes = 0, []
    for (model_id, run_id), writers in sorted(by_run.items(), key=lambda item: item[0]):
        problems = _run_problems(store, summaries.get((model_id, run_id)), model_id, run_id, writers)
        if problems:
            incomplete += 1
            notes.append(f"run {model_id}/{run_id}: " + "; ".join(problems))
    return incomplete, notes


def _run_problems(store, summary, model_id: str, run_id: str, writers: list[Outcome]) -> list[str]:
    appended = sum(1 for o in writers for key, *_ in o.events.appended if key[1] == run_id)
    returned = {r for o in writers for r in o.events.requests.get(run_id, ())}
    listed = {r.request_id for r in store.requests(model_id, run_id=run_id)} if summary else set()
    problems = []
    if summary is None or summary.records != appended:
        problems.append(f"{summary.records if summary else 0} records listed, {appended} appended")
    if listed != returned:
        problems.append(f"requests listed {sorted(listed)}, generate returned {sorted(returned)}")
    for outcome in writers:
        scope = outcome.writer.scope(run_id)
        sent = {p for pub in outcome.events.publishes if pub.scope == scope for p in pub.pack_ids}
        marked = {p for w in store.catalog.watermarks(scope) for p in w.pack_ids}
        if not sent or sent - marked:
            problems.append(f"{scope}: {len(sent - marked)} of {len(sent)} published packs not under a watermark")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="(internal) one capturing writer process")
    parser.add_argument("mode", choices=("child",))
    parser.add_argument("--packs", required=True)
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--runs", required=True, help="run ids, comma-separated (one generate call each)")
    parser.add_argument("--side", required=True)
    parser.add_argument("--go", required=True)
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--max-records", type=int, default=5)
    parser.add_argument("--chunk-steps", type=int, default=1, help="decode steps per published chunk")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hooks", default=HOOKS)
    parser.add_argument("--tp-rank", type=int)
    parser.add_argument("--tp-size", type=int)
    parser.add_argument("--no-digest", action="store_true")
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
