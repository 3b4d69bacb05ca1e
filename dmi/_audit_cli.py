"""``dmi audit`` and the audit lines of ``dmi show``: what the command line prints."""

from __future__ import annotations

import argparse
import datetime
from typing import Any

__all__ = ["run_audit_command", "audit_lines", "last_audits"]


def run_audit_command(store: Any, args: argparse.Namespace) -> Any:
    """Load ``--model`` and audit ``args.model_id``; returns the :class:`AuditReport`.
    A real model (``smollm2``) is cached in ``store.home``, the home the command reads."""
    from dmi._models import load_model, model_progress

    loaded = load_model(args.model, attn_implementation=args.attn_implementation, home=store.home,
                        progress=model_progress(quiet=args.quiet))
    return store.audit(args.model_id, model=loaded.model, model_name=args.model, run_id=args.run,
                       requests=args.requests, request_ids=args.request, seed=args.seed, exact=args.exact)


def report_lines(report: Any) -> list[str]:
    """A line per request (its counts), a line per failed check, and the outcome."""
    lines = []
    for run, rid in report.requests:
        mine = [c for c in report.checks if (c.run_id, c.request_id) == (run, rid)]
        count = {v: sum(c.verdict == v for c in mine) for v in ("exact", "noise", "fail")}
        kinds = ", ".join(dict.fromkeys(c.tolerance for c in mine)) or report.tolerance
        lines.append(f"request {rid} (run {run}): {len(mine)} hook/layer checks, {count['exact']} exact, "
                     f"{count['noise']} within {kinds} noise, {count['fail']} failed")
    lines += ["FAIL " + c.describe() for c in report.failures]
    outcome = "passed" if report.passed else f"FAILED ({len(report.failures)} checks)"
    lines.append(f"audit {report.audit_id} of {report.model_id} against {report.model}: {outcome}")
    return lines


def audit_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``dmi show``'s line per audit of a request (rows of ``Catalog.audits``)."""
    lines = []
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["audited_at"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
        outcome = f"FAILED first at {r['first_failure']}" if r["failed"] else "passed"
        lines.append(f"audit {r['audit_id']} {when} against {r['model']}: {outcome} ({r['checks']} checks, "
                     f"{r['exact']} exact, {r['noise']} within {r['tolerance']} noise, {r['failed']} failed)")
    return lines


def last_audits(catalog: Any, model_id: str | None) -> dict[tuple[str, str], str]:
    """``dmi runs``' audit column: per (model, run), the outcome and tolerance of the newest
    audit that checked requests of it (one query of ``Catalog.audits``)."""
    newest: dict[tuple[str, str], str] = {}
    failed: dict[tuple[str, str], int] = {}
    kinds: dict[tuple[str, str], dict[str, None]] = {}
    for r in catalog.audits(model_id).to_pylist():  # newest first
        run = (r["model_id"], r["run_id"])
        if newest.setdefault(run, r["audit_id"]) != r["audit_id"]:
            continue
        failed[run] = failed.get(run, 0) + r["failed"]
        kinds.setdefault(run, {}).update(dict.fromkeys(r["tolerance"].split(", ")))
    return {run: (f"FAILED {failed[run]} checks" if failed[run] else "passed") + f" ({', '.join(kinds[run])})"
            for run in newest}
