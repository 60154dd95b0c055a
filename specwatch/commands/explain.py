"""`specwatch explain DECISION_ID`: the postmortem of one archived decision, as text or HTML."""

from __future__ import annotations

from specwatch.commands._arguments import (CommandError, EXIT_NOT_FOUND, add_archive_option, check_output,
                                           open_archive, write_page)

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = ("Render the postmortem of one decision from the archive: the evidence window "
               "(acceptance length, draft overhead, speedup, latency percentiles, error and mismatch "
               "rates) as plots, the baseline it was compared to, the bundle card, the detector and "
               "thresholds that fired, and the archived samples. Without --html a text summary is printed.")


def add_arguments(parser) -> None:
    parser.add_argument("decision_id", help="the decision's id (d-...), as `specwatch query decisions` shows it")
    add_archive_option(parser)
    parser.add_argument("--html", metavar="FILE", help="write the postmortem page to FILE (- for stdout)")


def run(args) -> int:
    from specwatch.analysis.postmortem import render_html, render_text

    check_output(args.html, args)
    with open_archive(args.archive_dsn) as archive:
        record = archive.decision(args.decision_id)
        if record is None:
            message = f"no decision {args.decision_id!r} in the archive {archive!r}"
            raise CommandError(message, EXIT_NOT_FOUND)
        samples = archive.samples(args.decision_id)
        reproductions = archive.reproductions(args.decision_id)
    if args.html is None:
        print(render_text(record, samples))
        return 0
    write_page(args.html, render_html(record, samples, reproductions), f"postmortem of {args.decision_id}", args)
    return 0
