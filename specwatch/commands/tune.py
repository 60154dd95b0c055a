"""`specwatch tune`: the best draft length per bucket, predicted from archived window stats."""

from __future__ import annotations

import json
from pathlib import Path

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option, check_output,
                                           open_archive, write_page)

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = ("Predict, for each bucket of a bundle, the acceptance length and speedup at every draft "
               "length up to the one drafted, from the archived per-position acceptance counts and the "
               "bundle's measured draft and verify times; show the best D, the current D, the expected "
               "gain with its 95%% interval, the 128/G - 1 starting point and the tile-boundary candidates.")


def add_arguments(parser) -> None:
    parser.add_argument("--bundle", help="bundle id (default: the bundle seen last)")
    add_archive_option(parser)
    parser.add_argument("--window", type=float, default=None, metavar="SECONDS",
                        help="evidence: the last SECONDS of event time before the newest slice (default 300)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model-config", metavar="FILE",
                       help="the target's Hugging Face config.json: G = num_attention_heads / num_key_value_heads")
    group.add_argument("--heads-per-kv", type=int, metavar="G", help="query heads per KV head of the target")
    add_json_option(parser, help="print one JSON object")
    parser.add_argument("--html", metavar="FILE", help="write the page with the plotted curves to FILE (- for stdout)")


def run(args) -> int:
    from specwatch.analysis.tuning import DEFAULT_WINDOW_SECONDS, heads_per_kv_head, render_html, render_text, tune_report
    from specwatch.outputs import writes_stdout

    check_output(args.html, args)
    window = DEFAULT_WINDOW_SECONDS if args.window is None else args.window
    if not window > 0:
        raise CommandError(f"--window must be a positive number of seconds, got {args.window}")
    heads = args.heads_per_kv
    if heads is not None and heads < 1:
        raise CommandError(f"--heads-per-kv must be at least 1, got {heads}")
    if args.model_config:
        try:
            heads = heads_per_kv_head(json.loads(Path(args.model_config).read_text(encoding="utf-8")))
        except OSError as error:
            raise CommandError(f"cannot read {args.model_config}: {error.strerror or error}")
        except (ValueError, AttributeError) as error:
            raise CommandError(f"{args.model_config}: {error}")
    with open_archive(args.archive) as archive:
        cards = {b["bundle_id"]: (b["card"], b["last_seen"]) for b in archive.bundles()}
        bundle = args.bundle
        if bundle is None:
            if not cards:
                raise CommandError(f"no bundle in the archive {archive!r}: run `specwatch replay` or `run` into it "
                                   "first")
            bundle = max(sorted(cards), key=lambda b: cards[b][1])  # the bundle seen last
        if bundle not in cards:
            raise CommandError(f"no bundle {bundle!r} in the archive {archive!r} (`specwatch query bundles` lists "
                               "them)")
        rows = archive.timeline(bundle_id=bundle)
        flags = archive.flag_store()
    report = tune_report(rows, cards[bundle][0], bundle, flags, heads, window)
    if args.html is not None:
        write_page(args.html, render_html(report), f"draft-length report of {bundle}", args)
        if writes_stdout(args.html):
            return 0
    if args.json:
        print(json.dumps(report, sort_keys=True))
    elif args.html is None:
        print(render_text(report))
    return 0
