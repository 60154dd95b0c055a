"""`specwatch bundles`: the bundle registry, admission stages and their history, manual moves."""

from __future__ import annotations

import argparse
import time

from specwatch.commands._arguments import (CommandError, EXIT_NOT_FOUND, EXIT_NOT_PUBLISHED, actor_name,
                                           add_policy_option, archive_reader_options, load_policy,
                                           open_archive, write_page)
from specwatch.commands.flags import add_publish_options, publish_keyring, publish_manual
from specwatch.commands.query import format_card, format_optional as _opt, format_ts, print_rows

__all__ = ["DESCRIPTION", "add_arguments"]


DESCRIPTION = ("Every bundle (fingerprint card) seen, its admission stage (unadmitted, shadow, canary "
               "with a traffic share, admitted, frozen, invalidated) and what changed it, when and on "
               "what evidence. admit, promote and freeze record a person's change with an audit row.")


def add_arguments(parser) -> None:
    common = archive_reader_options()
    change = argparse.ArgumentParser(add_help=False)
    change.add_argument("bundle_id", help="bundle id (b-...)")
    change.add_argument("--by", required=True, metavar="NAME", help="who is making the change (audited)")
    change.add_argument("--reason", required=True, metavar="TEXT", help="why (audited)")
    add_publish_options(change)

    sub = parser.add_subparsers(dest="bundles_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", parents=[common], help="every bundle with its stage")
    p.set_defaults(func=_list)
    p = sub.add_parser("show", parents=[common], help="one bundle: card, stage history and qualification")
    p.add_argument("bundle_id", help="bundle id (b-...)")
    p.add_argument("--html", metavar="FILE", help="write the bundle's newest qualification report as a page to FILE")
    p.set_defaults(func=_show)
    p = sub.add_parser("admit", parents=[common, change], help="admit a bundle by hand (all traffic speculates)")
    p.set_defaults(func=_change, move="admit")
    p = sub.add_parser("promote", parents=[common, change],
                       help="move a bundle one step on the cohort schedule by hand")
    add_policy_option(p, help="policy TOML file whose cohort schedule to follow (defaults built in)")
    p.set_defaults(func=_change, move="promote")
    p = sub.add_parser("freeze", parents=[common, change], help="freeze a bundle: no speculation, no promotion")
    p.set_defaults(func=_change, move="freeze")


def _list(args: argparse.Namespace) -> int:
    with open_archive(args.archive_dsn) as archive:
        rows = archive.bundle_registry()
    for row in rows:
        row["card_summary"] = format_card(row["card"])
    print_rows(rows, [
        ("bundle_id", "bundle", str), ("stage", "stage", _opt), ("cohort_share", "share", _opt),
        ("stage_since", "since (UTC)", format_ts), ("stage_by", "by", _opt),
        ("first_seen", "first seen (UTC)", format_ts), ("card_summary", "card", str),
    ], args.json, empty="no bundle in the archive yet")
    return 0


def _show(args: argparse.Namespace) -> int:
    from specwatch.analysis.qualification import render_html, render_text

    with open_archive(args.archive_dsn) as archive:
        qualifications = archive.qualifications(args.bundle_id)
        # a bundle qualified before any engine ran it is known by its qualification's card alone
        row = _registered(archive, args.bundle_id) if not qualifications else next(
            (r for r in archive.bundle_registry() if r["bundle_id"] == args.bundle_id), None)
        history = archive.stage_history(args.bundle_id)
    qualification = dict(qualifications[-1]["report"], qualification_id=qualifications[-1]["qualification_id"]
                         ) if qualifications else None
    if args.html:
        if qualification is None:
            raise CommandError(f"bundle {args.bundle_id} has no qualification to draw (run specwatch qualify)",
                               EXIT_NOT_FOUND)
        write_page(args.html, render_html(qualification), "qualification page", args)
    for change in history:
        change["evidence"] = _evidence(change)
    if row is None:
        row = {"bundle_id": args.bundle_id, "stage": None, "cohort_share": None, "card": qualification["card"],
               "first_seen": None, "last_seen": None, "workers": []}
    if args.json:
        print_rows([dict(row, history=history, qualification=qualification)], (), as_json=True)
        return 0
    _print_stages(row, history)
    print()
    if qualification is not None:
        print(render_text(qualification) + f"\n  ({qualification['qualification_id']}; "
              f"{len(qualifications)} qualification run(s) of this card)")
    else:
        print("no qualification of this card (specwatch qualify)")
    return 0


def _print_stages(row: dict, history: list[dict]) -> None:
    print(f"bundle {row['bundle_id']}: {row['stage'] or 'not judged (admission off)'}"
          + (f", cohort share {row['cohort_share']:g}" if row["stage"] in ("shadow", "canary") else ""))
    print(f"  card: {format_card(row['card'])}")
    print(f"  seen: {format_ts(row['first_seen'])} .. {format_ts(row['last_seen'])} on "
          f"{', '.join(row['workers']) or '-'}")
    if not history:
        print("  no stage history")
        return
    print()
    print_rows(history, [
        ("ts", "when (UTC)", format_ts), ("previous_stage", "from", _opt), ("stage", "to", str),
        ("cohort_share", "share", _opt), ("actor", "by", str), ("reason", "reason", str),
        ("decision_id", "decision", _opt), ("evidence", "evidence", str),
    ], as_json=False)


def _change(args: argparse.Namespace) -> int:
    """A person's admit, promote or freeze: the stage rules are admission's, the record the archive's."""
    from specwatch.actions.admission import manual_stage, manual_stage_decision

    by, reason = actor_name(args.by, "--by"), args.reason.strip()
    if not by or not reason:
        raise CommandError("--by and --reason must not be empty")
    settings = load_policy(getattr(args, "policy", None)).admission
    keyring = publish_keyring(args)
    with open_archive(args.archive_dsn) as archive:
        row = _registered(archive, args.bundle_id)
        try:
            stage, cohort, share = manual_stage(args.move, row["stage"], row["cohort_share"], settings)
        except ValueError as error:
            raise CommandError(str(error)) from None
        # never before the change it follows, whatever the clocks say
        ts = max(time.time(), row["stage_since"] or 0.0)
        change_id = archive.write_manual_stage(args.bundle_id, stage, by, reason, ts, row["stage"], share, cohort)
    published = not args.bootstrap or publish_manual(args, manual_stage_decision(
        args.bundle_id, stage, share, cohort, by, reason, ts, change_id), keyring)
    if args.json:
        print_rows([{"change_id": change_id, "bundle_id": args.bundle_id, "stage": stage, "previous_stage":
                     row["stage"], "cohort_share": share, "by": by, "reason": reason, "ts": ts}], (), as_json=True)
    else:
        print(f"bundle {args.bundle_id}: {row['stage'] or 'not judged'} -> {stage}"
              + (f" (cohort share {share:g})" if stage in ("shadow", "canary") else "")
              + f" by {by}: {reason} ({change_id})")
    return 0 if published else EXIT_NOT_PUBLISHED


def _registered(archive, bundle_id: str) -> dict:
    row = next((row for row in archive.bundle_registry() if row["bundle_id"] == bundle_id), None)
    if row is None:
        raise CommandError(f"no bundle {bundle_id} in the archive", EXIT_NOT_FOUND)
    return row


def _evidence(change: dict) -> str:
    """One line of what moved a stage: the failing bucket and metric, the judged buckets, or a fingerprint change."""
    detail = change.get("detail") or {}
    if detail.get("manual"):
        return "manual"
    if detail.get("failed_bucket") or detail.get("failed_metric"):
        text = f"failed: {detail.get('failed_bucket') or '*'} {detail.get('failed_metric')}"
        if detail.get("vetoed_by"):
            text += f" (veto by {detail['vetoed_by']})"
        return text
    if detail.get("changed_fields"):
        return f"card changed from {detail.get('previous_bundle_id')}: {', '.join(detail['changed_fields'])}"
    judged = detail.get("judgement")
    if judged:
        requests = sum(j.get("canary_requests", 0) for j in judged.values())
        return f"{len(judged)} buckets pass, {requests} speculative requests judged"
    return ""
