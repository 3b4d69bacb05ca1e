"""Crash harness: kill -9 a capturing process at random moments, recover, and check nothing is lost.

Each trial starts a child process that captures a tiny Llama (``tests/_models.py``, random
weights, 3 layers) through the real capture path — hooks, ring, drain thread, pack writer,
publisher lease — into a fresh pack store and a fresh catalog, and kills it with SIGKILL at
one of these moments:

* ``copy``          just after the k-th ring reservation (the hook's copy into the slot pending)
* ``encode``        inside the k-th record encoding (compressed, not yet in the pack)
* ``seal``          inside the k-th pack seal: local disk, before one of close / fsync /
                    rename / directory fsync; S3, before the one conditional PUT
* ``seal-publish``  after a pack is sealed, before the session publishes it
* ``publish``       mid-publish: index rows written, the watermark not yet
* ``random``        at a random time after the child is ready (the parent sends the SIGKILL)

The child lands the first five itself: an environment variable (``DMI_CRASH_AT=phase:k``)
makes the harness's own wrappers around those functions send SIGKILL to their process on the
k-th call (nothing in DMI is changed for this). k is drawn from the number of calls a clean
calibration run makes. How many publishes a run makes depends on when its lease is held (packs
sealed before then wait for it and go in one publish), so a publishing phase's k can exceed a
trial's own count: that trial is reported as not killed, never as a kill. Before each record is appended the child writes its key and the SHA-256
of its bytes to a side file, and the ids of packs it begins and seals.

After each trial the parent runs ``Store.recover()`` (what ``dmi recover`` runs) and checks:

* lost            sealed packs (listed, or reported sealed by the child) that are not
                  published, or published with fewer records than the pack holds
* torn            listed packs that do not verify, and begun-but-unsealed packs that can be opened
* double-visible  records readers see more than once
* mismatched      published records whose bytes differ from what the child appended (or unreadable)
* verify          problems ``Store.verify()`` reports (and packs it still calls unpublished)

All must be 0. The two backends the harness runs by default are the two deployments DMI has:
local disk + an embedded chDB catalog (one machine), and S3 object storage + a ClickHouse
server catalog (scale-out). Each trial gets a fresh pack directory or S3 prefix and a fresh
catalog: its own chDB directory, or its own database on the one server the run uses. Run it::

    python bench/crash_harness.py --trials 200                  # local disk + chDB, then S3 (moto) + server
    python bench/crash_harness.py --trials 20 --backend local
    python bench/crash_harness.py --backend s3 --catalog chdb   # S3 (moto) + chDB
    python bench/crash_harness.py --backend s3 --s3-endpoint http://127.0.0.1:9000   # your own S3/MinIO

``--catalog`` picks the catalog of every backend run; without it local disk gets chDB and S3
gets a server. The server is found or started once for the whole run by the chain the live
tests use (``tests/_clickhouse.py``): ``DMI_CLICKHOUSE_URL``, else a container, else the local
``clickhouse-server`` binary in a temporary directory, stopped at the end. S3 without
``--s3-endpoint`` starts moto's server (``pip install -e '.[test]'``); with it, credentials come
from the environment and the bucket ``--s3-bucket`` must exist.
``tests/test_crash_harness.py`` runs a short version (one trial per named phase).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: tests/ (the tiny models, moto) lives at the root
    sys.path.insert(0, str(ROOT))

from tests._side_file import SideFile, tensor_digest  # noqa: E402

CRASH_AT_ENV = "DMI_CRASH_AT"
CHILD_PHASES = ("copy", "encode", "seal", "seal-publish", "publish")
PHASES = (*CHILD_PHASES, "random")
MODEL_ID = "crash-harness-llama"
HOOKS = "resid_post attn_q mlp_out token_ids"
MAX_RECORDS = 5
NEW_TOKENS = 3
LOCAL_SEAL_STEPS = ("_close_stream", "_fsync_file", "_rename", "_fsync_dir")
CHILD_TIMEOUT = 300.0


# ---------------------------------------------------------------------------------- the child


class _Probes:
    """Counts calls per phase in the child and sends SIGKILL at the chosen one."""

    def __init__(self, crash_at: str):
        phase, _, hit = crash_at.partition(":")
        self.phase = phase or None
        self.hit = int(hit) if hit else 0
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def reached(self, phase: str) -> None:
        with self._lock:
            self.counts[phase] += 1
            due = phase == self.phase and self.counts[phase] == self.hit
        if due:
            os.kill(os.getpid(), signal.SIGKILL)


def _wrap(owner, name: str, *, before=None, after=None) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def _install_probes(probes: _Probes, side: SideFile, seal_step: str) -> None:
    """The harness's wrappers around the capture path (in the child only)."""
    from dmi.capture import _ring, _session
    from dmi.catalog import _leases
    from dmi.storage import _store, _store_s3, _writer

    _wrap(_ring.Ring, "reserve", after=lambda *_a, **_k: probes.reached("copy"))
    _wrap(_writer, "encode", after=lambda *_a, **_k: probes.reached("encode"))
    _wrap(_writer.PackWriter, "append", before=lambda self, key, data, **_: side.write(
        record=dataclasses.asdict(key), sha256=tensor_digest(data), dtype=str(data.dtype), shape=list(data.shape)))
    _wrap(_writer._OpenPack, "__init__", after=lambda _r, self, *_a, **_k: side.write(begun=self.pack_id))
    _wrap(_writer._OpenPack, "seal", after=lambda desc, *_a, **_k: side.write(sealed=desc.pack_id))
    _wrap(_store._LocalPackSink, seal_step, before=lambda *_a, **_k: probes.reached("seal"))
    _wrap(_store_s3._S3PackSink, "_put", before=lambda *_a, **_k: probes.reached("seal"))
    _wrap(_session._Publishing, "publish", before=lambda *_a, **_k: probes.reached("seal-publish"))
    _wrap(_leases.Publisher, "_write",
          before=lambda self, what, *_a, **_k: probes.reached("publish") if what == "watermark" else None)


def child_main(args: argparse.Namespace) -> None:
    """Capture ``args.rounds`` generate calls (one run each); SIGKILLed where DMI_CRASH_AT says."""
    probes = _Probes(os.environ.get(CRASH_AT_ENV, ""))
    side = SideFile(args.side)
    _install_probes(probes, side, args.seal_step)
    from dmi.capture import attach
    from dmi.catalog import open_catalog
    from dmi.storage import PackStore
    from tests._models import left_padded_batch, tiny

    model = tiny("llama")
    store = PackStore.from_uri(args.packs)
    catalog = open_catalog(args.catalog)
    side.write(ready=time.time())
    for round_ in range(args.rounds):
        ids, mask = left_padded_batch(seed=round_ + 1)
        with attach(model, hooks=HOOKS, store=store, catalog=catalog, model_id=MODEL_ID, run_id=f"run{round_}",
                    writer_options={"max_records": MAX_RECORDS}, decode_chunk_steps=1) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    catalog.close()
    side.write(counts=dict(probes.counts), done=time.time())


# ---------------------------------------------------------------------------------- the parent


@dataclass(frozen=True, slots=True)
class SideEvents:
    """What the child reported before it died."""

    expected: dict[tuple, tuple[str, str, list[int]]]
    begun: frozenset[str]
    sealed: frozenset[str]
    ready_at: float | None
    done_at: float | None
    counts: dict[str, int]

    @staticmethod
    def read(path: Path) -> SideEvents:
        expected, begun, sealed, ready, done, counts = {}, set(), set(), None, None, {}
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # the last line, cut by the kill
                continue
            if "record" in event:
                expected[tuple(event["record"].values())] = (event["sha256"], event["dtype"], event["shape"])
            begun.update([event["begun"]] if "begun" in event else [])
            sealed.update([event["sealed"]] if "sealed" in event else [])
            ready = event.get("ready", ready)
            done = event.get("done", done)
            counts = event.get("counts", counts)
        return SideEvents(expected, frozenset(begun), frozenset(sealed), ready, done, counts)


@dataclass(frozen=True, slots=True)
class Trial:
    """One child run: where the kill was aimed, whether it happened, what the child reported."""

    backend: str
    phase: str
    hit: int
    packs: str
    catalog: str
    killed: bool
    events: SideEvents
    notes: tuple[str, ...]

    @property
    def seconds(self) -> float:
        """Capture time (ready → done) of a child that finished; 0 for a killed one."""
        ready, done = self.events.ready_at, self.events.done_at
        return done - ready if ready is not None and done is not None else 0.0


@dataclass(frozen=True, slots=True)
class TrialResult:
    """The checks' counts after one trial (all 0 when nothing went wrong)."""

    trial: Trial
    lost: int
    torn: int
    double_visible: int
    mismatched: int
    verify_problems: int
    published_records: int
    notes: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        counts = (self.lost, self.torn, self.double_visible, self.mismatched, self.verify_problems)
        return not any(counts) and not self.notes and not self.trial.notes


@dataclass(frozen=True, slots=True)
class Calibration:
    """A clean run: calls per phase (where kills are drawn from) and its capture time."""

    counts: dict[str, int]
    seconds: float
    result: TrialResult


@dataclass(frozen=True, slots=True)
class Backend:
    """Where a trial's packs and index go: a fresh local directory or a fresh prefix in one
    bucket; a fresh chDB directory or a fresh database on one ClickHouse server."""

    name: str
    s3_uri: str | None = None  # s3://bucket?endpoint_override=... (no prefix), for S3
    server_uri: str | None = None  # clickhouse://user:password@host:port (no database), for a server

    def packs_uri(self, trial_dir: Path) -> str:
        if self.s3_uri is None:
            return str(trial_dir / "packs")
        base, _, query = self.s3_uri.partition("?")
        return f"{base.rstrip('/')}/{trial_dir.name}" + (f"?{query}" if query else "")

    def catalog_uri(self, trial_dir: Path) -> str:
        """The trial's own catalog: a chDB directory in the trial's directory, or a database
        named after it on the server (the catalog creates it on first open)."""
        if self.server_uri is None:
            return f"chdb://{trial_dir / 'catalog'}"
        return f"{self.server_uri.rstrip('/')}/dmi_crash_{trial_dir.name.replace('-', '_')}"


def drop_trial_catalog(trial: Trial) -> None:
    """Drop a server trial's database once it is checked, so a long run against a server
    someone else runs leaves nothing behind (a chDB catalog goes with the trial's directory)."""
    if not trial.catalog.startswith("clickhouse://"):
        return
    from clickhouse_driver import Client

    base, _, database = trial.catalog.rpartition("/")
    client = Client.from_url(f"{base}/default")
    try:
        client.execute(f"DROP DATABASE IF EXISTS `{database}`")
    finally:
        client.disconnect()


def kill_trial(backend: Backend, workdir: Path, phase: str | None, hit: int, *, rng: random.Random,
               window: float = 0.0, rounds: int = 2) -> Trial:
    """Run one child into a fresh store and catalog, killed at (``phase``, ``hit``); ``None``: no kill."""
    trial_dir = Path(tempfile.mkdtemp(prefix="trial-", dir=workdir))
    packs, catalog = backend.packs_uri(trial_dir), backend.catalog_uri(trial_dir)
    side = trial_dir / "side.jsonl"
    seal_step = LOCAL_SEAL_STEPS[hit % len(LOCAL_SEAL_STEPS)]
    env = {**os.environ, CRASH_AT_ENV: f"{phase}:{hit}" if phase in CHILD_PHASES else ""}
    command = [sys.executable, str(Path(__file__).resolve()), "child", "--packs", packs, "--catalog", catalog,
               "--side", str(side), "--rounds", str(rounds), "--seal-step", seal_step]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    notes = []
    if phase == "random":
        _kill_after_ready(proc, side, rng.uniform(0.0, window))
    try:
        output, _ = proc.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        notes.append(f"child hung past {CHILD_TIMEOUT}s and was killed")
    if proc.returncode not in (0, -signal.SIGKILL):
        notes.append(f"child failed (exit {proc.returncode}): {output.decode(errors='replace')[-2000:]}")
    return Trial(backend.name, phase or "none", hit, packs, catalog, proc.returncode == -signal.SIGKILL,
                 SideEvents.read(side), tuple(notes))


def _kill_after_ready(proc: subprocess.Popen, side: Path, delay: float) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if side.exists() and '"ready"' in side.read_text(encoding="utf-8"):
            break
        time.sleep(0.01)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


def check_trial(trial: Trial, *, recover: bool = True) -> TrialResult:
    """Recover (unless told not to), then count lost, torn, double-visible and mismatched."""
    import dmi

    events = trial.events
    with dmi.open(catalog=trial.catalog, packs=trial.packs) as store:
        if recover:
            store.recover()
        listed = set(store.packs.list_packs())
        whole, torn = _verify_listed(store.packs, listed)
        torn += sum(1 for p in events.begun - listed if _openable(store.packs, p))
        published = store.catalog.published_pack_ids()
        entries = store.catalog.find_records(MODEL_ID) if MODEL_ID in store.catalog.models() else []
        per_pack = collections.Counter(e.pack_id for e in entries)
        lost = len((listed - published) | (events.sealed - listed))
        lost += sum(1 for p, d in whole.items() if p in published and per_pack[p] < len(d.records))
        keys = [e.meta.key for e in entries]
        double = len(keys) - len(set(keys))
        mismatched, notes = _compare(store.packs, entries, events.expected)
        report = store.verify()
    verify = len(report.problems) + len(report.unpublished_packs)
    return TrialResult(trial, lost, torn, double, mismatched, verify, len(entries), tuple(notes))


def _verify_listed(packs, listed: set[str]) -> tuple[dict, int]:
    from dmi.storage import PackError, verify_pack

    whole, torn = {}, 0
    for pack_id in sorted(listed):
        try:
            whole[pack_id] = verify_pack(packs, pack_id)
        except PackError:
            torn += 1
    return whole, torn


def _openable(packs, pack_id: str) -> bool:
    from dmi.storage import PackNotFoundError

    try:
        packs.open_input(pack_id).close()
    except PackNotFoundError:
        return False
    return True


def _compare(packs, entries, expected) -> tuple[int, list[str]]:
    """Published records whose bytes, dtype or shape differ from what the child appended, or
    that cannot be read at all."""
    from dmi.reader import read_records
    from dmi.storage import PackError

    by_pack = collections.defaultdict(list)
    for entry in entries:
        by_pack[entry.pack_id].append(entry)
    bad, notes = 0, []
    for pack_id, group in sorted(by_pack.items()):
        try:
            tensors = read_records(packs, group)
        except PackError as exc:
            bad += len(group)
            notes.append(f"pack {pack_id}: {len(group)} published records unreadable: {exc}")
            continue
        for entry, tensor in zip(group, tensors):
            want = expected.get(dataclasses.astuple(entry.meta.key))
            got = (tensor_digest(tensor), str(tensor.dtype), list(tensor.shape))
            if want != got:
                bad += 1
                notes.append(f"{entry.meta.key.describe()}: appended {want}, read back {got}")
    return bad, notes[:5]


def calibrate(backend: Backend, workdir: Path, rounds: int) -> Calibration:
    """One run without a kill: the calls per phase, its duration, and its own checks."""
    trial = kill_trial(backend, workdir, None, 0, rng=random.Random(0), rounds=rounds)
    result = check_and_drop(trial)
    if trial.events.done_at is None or not result.clean:
        raise RuntimeError(f"the calibration run (no kill) failed on {backend.name}: {result}")
    return Calibration({p: trial.events.counts.get(p, 0) for p in CHILD_PHASES}, trial.seconds, result)


def run_trials(backend: Backend, workdir: Path, *, trials: int, seed: int, rounds: int = 2,
               recover: bool = True) -> tuple[Calibration, list[TrialResult]]:
    """``trials`` kills on ``backend``: every six trials cover the six phases in a random order,
    each at a call drawn at random from the calibration's count (or a random time)."""
    calibration = calibrate(backend, workdir, rounds)
    rng = random.Random(seed)
    results, order = [], []
    for _ in range(trials):
        if not order:
            order = rng.sample(PHASES, len(PHASES))
        phase = order.pop()
        hit = rng.randint(1, max(1, calibration.counts.get(phase, 1)))
        trial = kill_trial(backend, workdir, phase, hit, rng=rng, window=calibration.seconds, rounds=rounds)
        results.append(check_and_drop(trial, recover=recover))
    return calibration, results


def check_and_drop(trial: Trial, *, recover: bool = True) -> TrialResult:
    """:func:`check_trial`, then drop the trial's server database (trials stay independent)."""
    try:
        return check_trial(trial, recover=recover)
    finally:
        drop_trial_catalog(trial)


# ---------------------------------------------------------------------------------- reporting


def conditions(args: argparse.Namespace) -> str:
    import torch

    return (f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load average {_load()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}; tiny Llama (3 layers, hidden 32, "
            f"random weights, float32); hooks {HOOKS}; batch 3, {NEW_TOKENS} new tokens, {args.rounds} runs per "
            f"child; max_records {MAX_RECORDS}; seed {args.seed}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summarize(backend: str, calibration: Calibration, results: list[TrialResult]) -> str:
    by_phase = collections.Counter(r.trial.phase for r in results)
    killed = collections.Counter(r.trial.phase for r in results if r.trial.killed)
    lines = [f"== {backend}: {len(results)} trials; a clean run makes {calibration.counts} calls "
             f"in {calibration.seconds:.1f}s and publishes {calibration.result.published_records} records"]
    for phase in PHASES:
        if by_phase[phase]:
            lines.append(f"   {phase:<13} {by_phase[phase]:>4} trials, {killed[phase]:>4} killed")
    totals = {name: sum(getattr(r, name) for r in results)
              for name in ("lost", "torn", "double_visible", "mismatched", "verify_problems")}
    lines.append("   " + "  ".join(f"{k.replace('_', '-')}: {v}" for k, v in totals.items()))
    lines.extend(f"   trial {i} ({r.trial.phase}:{r.trial.hit}): {note}"
                 for i, r in enumerate(results) for note in (*r.trial.notes, *r.notes))
    return "\n".join(lines)


BACKEND_CATALOGS = {"local": "chdb", "s3": "server"}
"""Each backend's catalog unless ``--catalog`` says otherwise: the two deployments DMI has."""


def _backends(args: argparse.Namespace, stack: ExitStack) -> list[Backend]:
    names = ["local", "s3"] if args.backend == "both" else [args.backend]
    backends, server = [], None
    for name in names:
        storage, s3_uri = ("local disk", None) if name == "local" else _s3_storage(args, stack)
        if (args.catalog or BACKEND_CATALOGS[name]) == "chdb":
            backends.append(Backend(f"{storage} + chDB", s3_uri))
            continue
        server = server or _start_server(stack)
        backends.append(Backend(f"{storage} + {server[0]}", s3_uri, server[1]))
    return backends


def _s3_storage(args: argparse.Namespace, stack: ExitStack) -> tuple[str, str]:
    """(label, ``s3://bucket?endpoint_override=...``): moto's server, or the endpoint given."""
    if args.s3_endpoint is not None:
        return f"S3 ({args.s3_endpoint})", f"s3://{args.s3_bucket}?endpoint_override={args.s3_endpoint}"
    from tests._s3 import CREDENTIALS, MotoServer

    os.environ.update(CREDENTIALS)
    moto = stack.enter_context(MotoServer())
    return "S3 (moto)", f"s3://{moto.new_bucket()}?endpoint_override={moto.url}"


def _start_server(stack: ExitStack) -> tuple[str, str]:
    """(label, ``clickhouse://user:password@host:port``): one server for the whole run, found or
    started by the live tests' chain and stopped when the run ends."""
    from clickhouse_driver import Client

    from tests._clickhouse import choose_live_server, start_live_server

    server = stack.enter_context(start_live_server(choose_live_server()))
    client = Client(server.host, port=server.port, user=server.user, password=server.password)
    try:
        version = client.execute("SELECT version()")[0][0]
    finally:
        client.disconnect()
    return f"ClickHouse server {version} ({server.how})", server.uri("default").rpartition("/")[0]


def parent_main(args: argparse.Namespace) -> int:
    print(f"conditions: {conditions(args)}")
    failed = False
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dmi-crash-")))
        for backend in _backends(args, stack):
            calibration, results = run_trials(backend, workdir, trials=args.trials, seed=args.seed,
                                              rounds=args.rounds, recover=not args.no_recover)
            print(summarize(backend.name, calibration, results), flush=True)
            failed = failed or not all(r.clean for r in results)
    print(f"load average after: {_load()}")
    print("RESULT:", "FAILED" if failed else "all trials clean (lost, torn, double-visible, mismatched, verify all 0)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="By default: local disk + embedded chDB, then S3 (moto) + a ClickHouse server (the live tests' "
               "chain: DMI_CLICKHOUSE_URL, a container, or the local clickhouse-server binary), 200 trials each; "
               "prints lost / torn / double-visible / mismatched / verify counts (all must be 0; exit 1 otherwise).")
    sub = parser.add_subparsers(dest="mode")
    child = sub.add_parser("child", help="(internal) the capturing process")
    child.add_argument("--packs", required=True)
    child.add_argument("--catalog", required=True)
    child.add_argument("--side", required=True)
    child.add_argument("--rounds", type=int, default=2)
    child.add_argument("--seal-step", choices=LOCAL_SEAL_STEPS, default="_rename")
    parser.add_argument("--trials", type=int, default=200, help="kills per backend (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the phase order and kill points")
    parser.add_argument("--rounds", type=int, default=2, help="capture runs (generate calls) per child")
    parser.add_argument("--backend", choices=("local", "s3", "both"), default="both",
                        help="pack storage: local disk, S3, or both one after the other (default)")
    parser.add_argument("--catalog", choices=("chdb", "server"),
                        help="catalog of every backend run: embedded chDB, or one ClickHouse server for the run "
                             "(a fresh database per trial); default: chDB for local disk, a server for S3")
    parser.add_argument("--s3-endpoint", help="an S3 endpoint URL to use instead of starting moto")
    parser.add_argument("--s3-bucket", default="dmi-crash-harness", help="existing bucket (with --s3-endpoint)")
    parser.add_argument("--no-recover", action="store_true",
                        help="skip recovery: shows that the checks catch the packs a crash leaves unpublished")
    args = parser.parse_args(argv)
    if args.mode == "child":
        child_main(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
