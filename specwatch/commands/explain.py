"""`specwatch explain DECISION_ID`: the postmortem of one archived decision, as text or an HTML page.

Reads the archive (decision, audit evidence, samples); the page is self-contained.
"""

from __future__ import annotations

import sys

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "explain", help="postmortem of one archived decision (text, or an HTML page)",
        description="Render the postmortem of one decision from the archive: the evidence window "
                    "(acceptance length, draft overhead, speedup, latency percentiles, error and mismatch "
                    "rates) as plots, the baseline it was compared to, the bundle card, the detector and "
                    "thresholds that fired, and the archived samples. Without --html a text summary is printed.")
    parser.add_argument("decision_id", help="the decision's id (d-...), as `specwatch query decisions` shows it")
    parser.add_argument("--archive", default=None,
                        help="archive DSN (default: $SPECWATCH_ARCHIVE or chdb://specwatch-data/archive)")
    parser.add_argument("--html", metavar="FILE", help="write the postmortem page to FILE (- for stdout)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from specwatch.archive.errors import ArchiveError
    from specwatch.archive.store import Archive
    from specwatch.outputs import atomic_output
    from specwatch.analysis.postmortem import render_html, render_text

    try:
        archive = Archive.open(args.archive, create=False)
    except (ArchiveError, ValueError) as error:
        print(f"specwatch explain: {error}", file=sys.stderr)
        return 2
    with archive:
        record = archive.decision(args.decision_id)
        if record is None:
            print(f"specwatch explain: no decision {args.decision_id!r} in the archive {archive!r}", file=sys.stderr)
            return 1
        samples = archive.samples(args.decision_id)
        reproductions = archive.reproductions(args.decision_id)
    if args.html is None:
        print(render_text(record, samples))
        return 0
    page = render_html(record, samples, reproductions)
    if args.html == "-":
        sys.stdout.write(page)
        return 0
    try:
        with atomic_output(args.html) as out:
            out.write(page)
    except OSError as error:
        print(f"specwatch explain: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"postmortem of {args.decision_id} written to {args.html}", file=sys.stderr)
    return 0
