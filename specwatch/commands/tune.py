"""`specwatch tune`: the best draft length per bucket, predicted from archived window stats."""

from __future__ import annotations

import json
import math

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option, check_output,
                                           open_archive, write_page)

__all__ = ["DESCRIPTION", "add_arguments", "run"]

# A Hugging Face config.json is a few KB; a file this long is something else.
_MAX_MODEL_CONFIG_BYTES = 1 << 20
# A qualification report with its latency samples runs to a few MB at most.
_MAX_QUALIFICATION_BYTES = 64 << 20


DESCRIPTION = ("Predict, for each bucket of a bundle, the acceptance length and speedup at every draft "
               "length up to the one drafted, from the archived per-position acceptance counts and the "
               "bundle's measured draft and verify times, or from a qualification (--from-qualification) before any "
               "traffic; show the best D, the current D, the expected "
               "gain with its 95%% interval, the 128/G - 1 starting point and the tile-boundary candidates.")


def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bundle", help="bundle id (default: the bundle seen last)")
    source.add_argument("--from-qualification", metavar="FILE|CARD",
                        help="start from a qualification instead of traffic: a report `specwatch qualify --json` "
                             "wrote to FILE, or the newest archived qualification of bundle CARD (its per-position "
                             "acceptance per bucket, its ledger's step times)")
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
    from specwatch.analysis.tuning import DEFAULT_WINDOW_SECONDS, heads_per_kv_head, tune_report

    check_output(args.html, args)
    window = DEFAULT_WINDOW_SECONDS if args.window is None else args.window
    if not 0 < window < math.inf:  # Infinity is no window, and no JSON either
        raise CommandError(f"--window must be a positive, finite number of seconds, got {args.window}")
    heads = args.heads_per_kv
    if heads is not None and heads < 1:
        raise CommandError(f"--heads-per-kv must be at least 1, got {heads}")
    if args.model_config:
        heads = _model_config_heads(args.model_config, heads_per_kv_head)
    if args.from_qualification is not None:
        from specwatch.analysis.tuning import qualification_tune_report

        qualification = _qualification(args.from_qualification, args.archive_dsn)
        return _emit(qualification_tune_report(qualification, heads), qualification["bundle_id"], args)
    with open_archive(args.archive_dsn) as archive:
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
    return _emit(tune_report(rows, cards[bundle][0], bundle, flags, heads, window), bundle, args)


def _emit(report: dict, bundle: str, args) -> int:
    from specwatch.analysis.tuning import render_html, render_text
    from specwatch.outputs import writes_stdout

    if args.html is not None:
        write_page(args.html, render_html(report), f"draft-length report of {bundle}", args)
        if writes_stdout(args.html):
            return 0
    if args.json:
        print(json.dumps(report, sort_keys=True))
    elif args.html is None:
        print(render_text(report))
    return 0


def _model_config_heads(path: str, heads_per_kv_head) -> int:
    """G from the model config at ``path``: a JSON object of at most `_MAX_MODEL_CONFIG_BYTES`."""
    from specwatch.schemas.config_files import read_config_file

    try:
        config = json.loads(read_config_file(path, _MAX_MODEL_CONFIG_BYTES).decode("utf-8"))
    except OSError as error:
        raise CommandError(f"cannot read the model config {path}: {error.strerror or error}") from None
    except RecursionError:
        raise CommandError(f"{path}: not a model config: JSON nested too deeply") from None
    except ValueError as error:  # invalid JSON or not UTF-8
        raise CommandError(f"{path}: not a JSON model config: {error}") from None
    try:
        return heads_per_kv_head(config)
    except ValueError as error:
        raise CommandError(f"{path}: {error}") from None


def _qualification(source: str, archive_dsn) -> dict:
    """A qualification report from a JSON file, or else the newest archived one of bundle ``source``."""
    from pathlib import Path

    from specwatch.schemas.config_files import read_config_file

    if Path(source).is_file():
        try:
            report = json.loads(read_config_file(source, _MAX_QUALIFICATION_BYTES).decode("utf-8"))
        except OSError as error:
            raise CommandError(f"cannot read the qualification {source}: {error.strerror or error}") from None
        except (ValueError, RecursionError) as error:
            raise CommandError(f"{source}: not a JSON qualification report: {error}") from None
        if not isinstance(report, dict) or not {"bundle_id", "card", "gate1"} <= set(report):
            raise CommandError(f"{source}: not a qualification report (`specwatch qualify --json` writes one): "
                               "it needs bundle_id, card and gate1")
        return report
    with open_archive(archive_dsn) as archive:
        rows = archive.qualifications(source)
    if not rows:
        raise CommandError(f"{source}: neither a file nor a bundle with an archived qualification "
                           "(`specwatch qualify` archives one)")
    return dict(rows[-1]["report"], qualification_id=rows[-1]["qualification_id"])
