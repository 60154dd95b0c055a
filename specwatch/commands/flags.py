"""`specwatch flags`: the speculative-path state per scope, and manual overrides with audit."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

from specwatch.commands._arguments import (CommandError, EXIT_NOT_FOUND, EXIT_NOT_PUBLISHED, actor_name,
                                           archive_reader_options, open_archive)
from specwatch.commands.query import format_optional, format_scope, format_ts, print_rows
from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["DESCRIPTION", "add_arguments", "add_publish_options", "publish_keyring", "publish_manual"]

_PUBLISH_TIMEOUT_S = 15.0

# The decisions contract's reason codes (schemas/decisions.py), listed here so that the
# parser stays light; tests check the two lists agree.
_REASON_CODES = ("acceptance_drop", "no_speedup", "draft_overhead", "latency_slo", "kv_pressure",
                 "bundle_changed", "quality_regression", "error_rate", "unadmitted_bundle", "canary_judgement")


def add_publish_options(parser: argparse.ArgumentParser) -> None:
    """``--bootstrap``, ``--decisions-topic`` and ``--unsigned``: where and how a manual change is published."""
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="also publish the change, signed, on the decisions topic of this Kafka cluster")
    parser.add_argument("--decisions-topic", default=DECISIONS_TOPIC, metavar="TOPIC",
                        help="decisions topic to publish on (default: %(default)s)")
    parser.add_argument("--unsigned", action="store_true",
                        help="with --bootstrap and no signing key: publish unsigned, for a fleet whose flag "
                             "clients run without a key (any client that holds one ignores the change)")


def publish_keyring(args: argparse.Namespace):
    """The `Keyring` a manual change is published with, None without ``--bootstrap``; no key
    raises `CommandError` unless ``--unsigned``. Called before anything is recorded."""
    if not args.bootstrap:
        return None
    from specwatch.transport.signing import Keyring

    try:
        keyring = Keyring.from_env()
    except ValueError as error:
        raise CommandError(str(error)) from None
    if keyring.enabled and args.unsigned:
        raise CommandError("--unsigned, but a signing key is configured; drop --unsigned to publish signed")
    if not keyring.enabled and not args.unsigned:
        raise CommandError("no signing key, so flag clients that hold one would ignore this change; set "
                           "SPECWATCH_SIGNING_KEY_FILE (or SPECWATCH_SIGNING_KEY) to the fleet's key, or pass "
                           "--unsigned if its flag clients run without one")
    return keyring


def publish_manual(args: argparse.Namespace, decision, keyring) -> bool:
    """Publish one decision, signed with ``keyring``, and wait for the broker; False (and why, on stderr) if not."""
    from specwatch.actions.sinks.publisher import DecisionPublisher
    from specwatch.transport.config import KafkaConfig

    try:
        publisher = DecisionPublisher(KafkaConfig.from_env(args.bootstrap), topic=args.decisions_topic,
                                      keyring=keyring)
    except Exception as error:  # noqa: BLE001 - a bad address, an unreachable cluster, a bad key setting
        print(f"specwatch: cannot publish on {args.decisions_topic}: {error}", file=sys.stderr)
        return False
    try:
        ok = publisher.publish(decision) and publisher.flush(_PUBLISH_TIMEOUT_S) and publisher.stats()["failed"] == 0
    finally:
        publisher.close()
    if not ok:
        print(f"specwatch: the decisions topic {args.decisions_topic} did not take decision {decision.id} within "
              f"{_PUBLISH_TIMEOUT_S:.0f} s; the override is archived but flag clients have not seen it", file=sys.stderr)
    return ok


def _override_keyring(args: argparse.Namespace):
    """`publish_keyring`, once the override's arguments are known to be whole."""
    args.by = actor_name(args.by, "--by")
    if args.bootstrap and not args.code:
        raise CommandError("--bootstrap needs --code, the contract reason the published decision carries")
    return publish_keyring(args)


DESCRIPTION = ("Show the speculative-path state that archived decisions and manual overrides "
               "add up to, or pin a scope on or off by hand (recorded with an audit row).")


def add_arguments(parser) -> None:
    common = archive_reader_options()
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--bundle", required=True, help="bundle id")
    scope.add_argument("--bucket", help="task bucket (default: every bucket)")
    scope.add_argument("--cohort", help="cohort (default: every cohort)")
    scope.add_argument("--by", required=True, metavar="NAME",
                       help="who is making the change (recorded in the audit trail)")
    add_publish_options(scope)
    scope.add_argument("--code", choices=_REASON_CODES, metavar="REASON",
                       help="with --bootstrap: the contract reason the published decision carries, the "
                            "alert being answered (" + ", ".join(_REASON_CODES) + ")")

    sub = parser.add_subparsers(dest="flags_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", parents=[common], help="state per scope (manual overrides marked)")
    p.add_argument("--bundle", help="only this bundle")
    p.add_argument("--bootstrap", metavar="HOST:PORT",
                   help="the state flag clients follow: read the decisions topic (verified with the signing key "
                        "settings) instead of the archive")
    p.add_argument("--decisions-topic", default=DECISIONS_TOPIC, metavar="TOPIC",
                   help="with --bootstrap: the decisions topic (default: %(default)s)")
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
    ignored = 0
    if args.bootstrap:
        store, ignored = _fleet_store(args)
        automatic = store.scopes()
    else:
        with open_archive(args.archive_dsn) as archive:
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
    # like `specwatch decisions`: messages flag clients ignore for their signature mean
    # someone other than the key holders writes the topic
    code = EXIT_NOT_PUBLISHED if ignored else 0
    for row in [] if args.json else rows:  # JSON keeps the fields the source line is made of
        row["source"] = f"manual by {row['by']}" if row["manual"] else (row["decision_id"] or "")
        if row["manual"] and row["automatic"]:
            row["source"] += f" (automatic: {row['automatic']})"
    print_rows(rows, [
        ("bundle_id", "bundle", str), ("bucket", "bucket", format_scope), ("cohort", "cohort", format_scope),
        ("speculation", "speculation", str), ("draft_limit", "draft limit", format_optional),
        ("cohort_share", "share", format_optional), ("since", "since (UTC)", format_ts),
        ("reason", "reason", str), ("source", "source", str),
    ], args.json, empty="speculation on everywhere: no decision or override in force")
    return code


def _fleet_store(args: argparse.Namespace):
    """(the flag store a flag client builds from the decisions topic, how many messages failed the
    signature check); `CommandError` when the topic cannot be read."""
    from specwatch.collectors.flag_client import FlagClient
    from specwatch.transport.config import KafkaConfig

    try:
        client = FlagClient(KafkaConfig.from_env(args.bootstrap), topic=args.decisions_topic, silence_seconds=None)
    except ValueError as error:
        raise CommandError(str(error)) from None
    with client:
        if not client.wait_until_caught_up(_PUBLISH_TIMEOUT_S):
            raise CommandError(f"could not read {args.decisions_topic} at {args.bootstrap} within "
                               f"{_PUBLISH_TIMEOUT_S:.0f} s", EXIT_NOT_PUBLISHED)
        stats = client.stats()
        ignored = stats.forged + stats.unsigned + stats.replayed + stats.misrouted
        if ignored:
            print(f"specwatch: {ignored} message(s) on {args.decisions_topic} ignored as a flag client ignores "
                  f"them ({stats.forged} forged or signed with an unknown key, {stats.unsigned} unsigned, "
                  f"{stats.replayed} replayed, {stats.misrouted} misrouted)", file=sys.stderr)
        return client.store, stats.forged + stats.unsigned


def _set(args: argparse.Namespace) -> int:
    if args.draft_length is not None and (not args.enabled or args.draft_length < 1):
        raise CommandError("--draft-length needs --on and a value of at least 1")
    args.by = actor_name(args.by, "--by")
    if not args.reason.strip():
        raise CommandError("--by and --reason must not be empty")
    from specwatch.actions.flags import OverrideChange, override_decision

    keyring = _override_keyring(args)
    change = OverrideChange(args.bundle, args.bucket, args.cohort, args.enabled, args.draft_length,
                            args.by.strip(), args.reason.strip(), time.time())
    with open_archive(args.archive_dsn, create=args.create) as archive:
        override_id = _record(archive, change)
    published = not args.bootstrap or publish_manual(
        args, override_decision(change, args.code, override_id=override_id), keyring)
    _report(args, change, override_id, "set")
    return 0 if published else EXIT_NOT_PUBLISHED


def _clear(args: argparse.Namespace) -> int:
    from specwatch.actions.flags import OverrideChange, override_decision

    keyring = _override_keyring(args)
    scope = (args.bundle, args.bucket, args.cohort)
    with open_archive(args.archive_dsn) as archive:
        active = next((o for o in archive.overrides(active_only=True)
                       if (o["bundle_id"], o["bucket"], o["cohort"]) == scope), None)
        if active is None:
            raise CommandError(f"no manual override on {_key(scope)}", EXIT_NOT_FOUND)
        change = OverrideChange(args.bundle, args.bucket, args.cohort, active["enabled"],
                                active["draft_limit"], args.by.strip(), args.reason.strip(),
                                # never before the override it clears, whatever the clocks say
                                max(time.time(), active["ts"]), cleared=True)
        override_id = _record(archive, change)
        automatic = archive.flag_store(overrides=False).state(scope)
    published = not args.bootstrap or publish_manual(
        args, override_decision(change, args.code, automatic, override_id), keyring)
    _report(args, change, override_id, "cleared")
    return 0 if published else EXIT_NOT_PUBLISHED


def _record(archive, change) -> str:
    """Write an override change to the archive, the system of record; returns its id."""
    return archive.write_override(change.scope, change.enabled, change.draft_limit, change.by, change.reason,
                                  change.ts, cleared=change.cleared)


def _report(args: argparse.Namespace, change, override_id: str, verb: str) -> None:
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


def _key(scope: tuple[str, str | None, str | None]) -> str:
    from specwatch.schemas import decision_key  # pydantic is heavy; the parser stays light

    return decision_key(*scope)
