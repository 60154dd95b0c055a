"""`specwatch flags`: the speculative-path state per scope, and manual overrides with audit.

State is rebuilt from the archive (decisions folded in time order, then overrides on top);
`set` and `clear` record an override and its audit row there.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from specwatch.commands.query import add_archive_options, format_ts, open_archive, print_rows

__all__ = ["register", "OverrideChange", "record_override"]

_EXIT_NOT_FOUND = 1
_EXIT_USAGE = 2


@dataclass(frozen=True)
class OverrideChange:
    """A manual override being set (``cleared=False``) or cleared, as recorded and published."""

    bundle_id: str
    bucket: str | None
    cohort: str | None
    enabled: bool
    draft_limit: int | None
    by: str
    reason: str
    ts: float
    cleared: bool = False

    @property
    def scope(self) -> tuple[str, str | None, str | None]:
        return self.bundle_id, self.bucket, self.cohort


Publisher = Callable[[OverrideChange], None]


def record_override(archive, change: OverrideChange, publishers: Sequence[Publisher] = ()) -> str:
    """Record an override change in the archive (the system of record), then publish it.

    Publishers (e.g. to the decisions topic, so flag clients see it) run after the
    archive write succeeded; returns the archived override id.
    """
    override_id = archive.write_override(change.scope, change.enabled, change.draft_limit, change.by,
                                         change.reason, change.ts, cleared=change.cleared)
    for publish in publishers:
        publish(change)
    return override_id


def register(subparsers) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_archive_options(common)
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--bundle", required=True, help="bundle id")
    scope.add_argument("--bucket", help="task bucket (default: every bucket)")
    scope.add_argument("--cohort", help="cohort (default: every cohort)")
    scope.add_argument("--by", required=True, metavar="NAME",
                       help="who is making the change (recorded in the audit trail)")

    parser = subparsers.add_parser(
        "flags", help="speculative-path state per scope; manual overrides",
        description="Show the speculative-path state that archived decisions and manual overrides "
                    "add up to, or pin a scope on or off by hand (recorded with an audit row).")
    sub = parser.add_subparsers(dest="flags_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", parents=[common], help="state per scope (manual overrides marked)")
    p.add_argument("--bundle", help="only this bundle")
    p.set_defaults(func=_list)

    p = sub.add_parser("set", parents=[common, scope], help="pin a scope on or off by hand")
    state = p.add_mutually_exclusive_group(required=True)
    state.add_argument("--off", dest="enabled", action="store_false", help="standard decoding only")
    state.add_argument("--on", dest="enabled", action="store_true", help="speculation allowed")
    p.add_argument("--draft-length", type=int, metavar="N", help="with --on: draft at most N tokens")
    p.add_argument("--reason", required=True, metavar="TEXT", help="why (recorded in the audit trail)")
    p.add_argument("--create", action="store_true", help="start a new archive if there is none")
    p.set_defaults(func=_set)

    p = sub.add_parser("clear", parents=[common, scope], help="remove a manual override")
    p.add_argument("--reason", default="", metavar="TEXT", help="why (recorded in the audit trail)")
    p.set_defaults(func=_clear)


def _list(args: argparse.Namespace) -> int:
    archive = open_archive(args)
    if archive is None:
        return _EXIT_USAGE
    with archive:
        store = archive.flag_store()
        automatic = archive.flag_store(overrides=False).scopes()
    manual = store.overrides()
    rows = []
    for scope, state in sorted(store.scopes().items(), key=lambda item: tuple(p or "" for p in item[0])):
        if args.bundle and scope[0] != args.bundle:
            continue
        auto = automatic.get(scope)
        rows.append({
            "bundle_id": scope[0], "bucket": scope[1], "cohort": scope[2],
            "speculation": "on" if state.enabled else "off",
            "draft_limit": state.draft_limit, "cohort_share": state.cohort_share,
            "reason": state.reason, "since": state.ts,
            "manual": scope in manual, "by": state.manual_by,
            "decision_id": state.decision_id or None,
            "automatic": None if auto is None else ("on" if auto.enabled else "off"),
        })
    if args.json:
        print_rows(rows, (), as_json=True)
        return 0
    if not rows:
        print("speculation on everywhere: no decision or override in force")
        return 0
    for row in rows:
        row["source"] = f"manual by {row['by']}" if row["manual"] else (row["decision_id"] or "")
        if row["manual"] and row["automatic"]:
            row["source"] += f" (automatic: {row['automatic']})"
    print_rows(rows, [
        ("bundle_id", "bundle", str), ("bucket", "bucket", _scope), ("cohort", "cohort", _scope),
        ("speculation", "speculation", str), ("draft_limit", "draft limit", _opt),
        ("cohort_share", "share", _opt), ("since", "since (UTC)", format_ts),
        ("reason", "reason", str), ("source", "source", str),
    ], as_json=False)
    return 0


def _set(args: argparse.Namespace) -> int:
    if args.draft_length is not None and (not args.enabled or args.draft_length < 1):
        print("specwatch: --draft-length needs --on and a value of at least 1", file=sys.stderr)
        return _EXIT_USAGE
    if not args.by.strip() or not args.reason.strip():
        print("specwatch: --by and --reason must not be empty", file=sys.stderr)
        return _EXIT_USAGE
    archive = open_archive(args, create=args.create)
    if archive is None:
        return _EXIT_USAGE
    change = OverrideChange(args.bundle, args.bucket, args.cohort, args.enabled, args.draft_length,
                            args.by.strip(), args.reason.strip(), time.time())
    with archive:
        override_id = record_override(archive, change)
    return _report(args, change, override_id, "set")


def _clear(args: argparse.Namespace) -> int:
    if not args.by.strip():
        print("specwatch: --by must not be empty", file=sys.stderr)
        return _EXIT_USAGE
    archive = open_archive(args)
    if archive is None:
        return _EXIT_USAGE
    scope = (args.bundle, args.bucket, args.cohort)
    with archive:
        active = next((o for o in archive.overrides(active_only=True)
                       if (o["bundle_id"], o["bucket"], o["cohort"]) == scope), None)
        if active is None:
            print(f"specwatch: no manual override on {_key(scope)}", file=sys.stderr)
            return _EXIT_NOT_FOUND
        change = OverrideChange(args.bundle, args.bucket, args.cohort, active["enabled"],
                                active["draft_limit"], args.by.strip(), args.reason.strip(),
                                # never before the override it clears, whatever the clocks say
                                max(time.time(), active["ts"]), cleared=True)
        override_id = record_override(archive, change)
    return _report(args, change, override_id, "cleared")


def _report(args: argparse.Namespace, change: OverrideChange, override_id: str, verb: str) -> int:
    if args.json:
        print_rows([dict(asdict(change), override_id=override_id)], (), as_json=True)
    elif change.cleared:
        print(f"override on {_key(change.scope)} cleared by {change.by} ({override_id})")
    else:
        state = "on" if change.enabled else "off"
        if change.draft_limit is not None:
            state += f", draft length <= {change.draft_limit}"
        print(f"override {verb}: {_key(change.scope)} speculation {state} by {change.by}: "
              f"{change.reason} ({override_id})")
    return 0


def _key(scope: tuple[str, str | None, str | None]) -> str:
    from specwatch.schemas import decision_key  # pydantic is heavy; the parser stays light

    return decision_key(*scope)


def _scope(value: object) -> str:
    return "*" if value is None else str(value)


def _opt(value: object) -> str:
    return "-" if value is None else str(value)
