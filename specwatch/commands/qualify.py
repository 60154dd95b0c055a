"""`specwatch qualify`: Gates 1 and 2 and the D sweep of a bundle against standard decoding of its
target, through two vLLM OpenAI servers; the report is archived under the card's fingerprint."""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specwatch.commands._arguments import (CommandError, add_archive_option, add_json_option, add_policy_option,
                                           load_policy, open_archive, write_page)

__all__ = ["DESCRIPTION", "add_arguments", "run"]

EXIT_FAILED = 1

DESCRIPTION = ("Qualify a speculative bundle before traffic. Gate 1: greedy outputs identical to standard "
               "decoding request by request, sampled outputs equal in distribution, AL per bucket, task "
               "checks on both paths, stress slices. Gate 2: the end-to-end ledger of both paths under the "
               "same load at each concurrency (vLLM's own benchmark client). Then the D and mechanism sweep, "
               "its Pareto front and vLLM's Dynamic SD table. Starts both servers from --model and "
               "--speculative-config, or uses --speculative-url and --standard-url. Exit 0 when the bundle "
               "passes, 1 when it fails.")


def _list_of_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CommandError(f"expected positive whole numbers, got {text!r}")
    return sorted(set(values))


def add_arguments(parser) -> None:
    started = parser.add_argument_group("servers started here")
    started.add_argument("--model", metavar="DIR", help="the target model (local directory or name)")
    started.add_argument("--speculative-config", metavar="JSON", help="vLLM's speculative_config of the bundle")
    started.add_argument("--dtype", default="float32", help="the target's dtype on both paths (default float32)")
    started.add_argument("--speculative-dtype", help="another dtype for the speculative path only")
    started.add_argument("--speculative-env", action="append", default=[], metavar="NAME=VALUE",
                         help="a variable for the speculative servers' environment (repeatable)")
    started.add_argument("--max-model-len", type=int,
                         help="the servers' context length (default: the dataset's longest request, prompt and "
                              "output, rounded up to 256, at least 512); a longer request is skipped with its verdict")
    started.add_argument("--max-num-seqs", type=int, default=8, help="the largest batch; the Dynamic SD table ends there")
    given = parser.add_argument_group("servers run by someone else")
    given.add_argument("--speculative-url", metavar="URL", help="the bundle's OpenAI-compatible server")
    given.add_argument("--standard-url", metavar="URL", help="the same target with standard decoding")
    given.add_argument("--card", metavar="FILE", help="the bundle's fingerprint card (JSON) when --model does not "
                                                     "describe it")
    given.add_argument("--tokenizer", help="tokenizer for the load generator (default: the served model name)")
    parser.add_argument("--dataset", metavar="FILE", help="JSON Lines requests (default: the shipped dataset)")
    parser.add_argument("--per-bucket", type=int, metavar="N", help="at most N requests of each bucket")
    parser.add_argument("--concurrency", default="1,4", help="Gate 2 and sweep concurrencies (default 1,4)")
    parser.add_argument("--requests-per-run", type=int, default=16, help="requests of each load run (default 16)")
    parser.add_argument("--draft-lengths", help="sweep these D besides the card's (comma-separated)")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep the D candidates from the model's G: 128/G - 1, tile boundaries, neighbours")
    parser.add_argument("--max-draft-length", type=int, default=8, help="largest D the sweep starts (default 8)")
    parser.add_argument("--mechanisms", default="", help="other vLLM methods to sweep beside the bundle's (ngram)")
    parser.add_argument("--effect-size", type=float, default=0.3, metavar="W",
                        help="Cohen's w the sampled distribution tests state their power for; a test below power "
                             "0.8 there is reported inconclusive (default 0.3, a medium effect)")
    parser.add_argument("--gate1-only", action="store_true",
                        help="check the quality invariants only (no load, no sweep; the report does not pass)")
    parser.add_argument("--check-table", action="store_true",
                        help="start an engine with the Dynamic SD table and complete requests on it")
    add_policy_option(parser, help="policy TOML whose SLOs, speedup and tolerances Gate 2 applies")
    add_archive_option(parser)
    parser.add_argument("--no-archive", action="store_true", help="do not archive the report")
    add_json_option(parser, help="print the report as one JSON object")
    parser.add_argument("--html", metavar="FILE", help="also write the report as a page to FILE")


def _environment(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise CommandError(f"--speculative-env wants NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _card(args, settings, speculative_config):
    from specwatch.qualify.servers import bundle_card
    from specwatch.schemas import BundleCard

    if args.card:
        try:
            return BundleCard.model_validate_json(Path(args.card).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise CommandError(f"--card {args.card}: {error}") from None
    if settings is None or speculative_config is None:
        raise CommandError("give --card, or --model and --speculative-config, so that the report binds to a card")
    try:
        return bundle_card(settings, speculative_config)
    except (ValueError, OSError) as error:
        raise CommandError(f"vLLM refuses the bundle's configuration: {error}") from None


def _draft_lengths(args, card) -> list[int]:
    if args.draft_lengths:
        return _list_of_ints(args.draft_lengths)
    if not args.sweep:
        return []
    from specwatch.analysis.tuning import heads_per_kv_head
    from specwatch.qualify.sweep import draft_length_candidates

    try:
        config = json.loads((Path(args.model) / "config.json").read_text(encoding="utf-8")) if args.model else {}
        heads = heads_per_kv_head(config) if config else None
    except (OSError, ValueError):
        heads = None
    return draft_length_candidates(heads, card.drafter.draft_length, args.max_draft_length)


def _endpoint(url: str, tokenizer: str | None):
    """A server run by someone else, as /v1/models describes it."""
    from specwatch.qualify.client import served_model_card
    from specwatch.qualify.procedure import Endpoint

    card = served_model_card(url)
    limit = card.get("max_model_len")
    return Endpoint(url, card["id"], tokenizer or card["id"], limit if isinstance(limit, int) else None)


def run(args) -> int:
    from specwatch.analysis.qualification import render_html, render_text
    from specwatch.qualify.dataset import load_dataset
    from specwatch.qualify.procedure import Endpoint, QualifyPlan, qualify_bundle
    from specwatch.qualify.servers import ServerSettings, fitting_max_model_len, server_factory, started

    urls = (args.speculative_url, args.standard_url)
    if any(urls) and not all(urls):
        raise CommandError("give both --speculative-url and --standard-url, or neither")
    if not any(urls) and not (args.model and args.speculative_config):
        raise CommandError("give --model and --speculative-config (servers started here), or --speculative-url "
                           "and --standard-url")
    try:
        speculative_config = json.loads(args.speculative_config) if args.speculative_config else None
    except ValueError as error:
        raise CommandError(f"--speculative-config is not JSON: {error}") from None
    if speculative_config is not None and not isinstance(speculative_config, dict):
        raise CommandError("--speculative-config must be a JSON object")
    policy = load_policy(args.policy)
    try:
        dataset = load_dataset(args.dataset).limited(args.per_bucket)
    except ValueError as error:
        raise CommandError(str(error)) from None
    for line, reason in dataset.rejected.items():
        print(f"specwatch qualify: {dataset.name} line {line} rejected: {reason}", file=sys.stderr)
    settings = (ServerSettings(args.model, dtype=args.dtype, speculative_dtype=args.speculative_dtype,
                               speculative_env=_environment(args.speculative_env),
                               max_model_len=args.max_model_len or fitting_max_model_len(args.model, dataset.requests),
                               max_num_seqs=args.max_num_seqs) if args.model else None)
    card = _card(args, settings, speculative_config)
    plan = QualifyPlan(concurrencies=_list_of_ints(args.concurrency), requests_per_run=args.requests_per_run,
                       draft_lengths=_draft_lengths(args, card),
                       mechanisms=[m.strip() for m in args.mechanisms.split(",") if m.strip()],
                       max_batch_size=args.max_num_seqs, check_table=args.check_table, gate2=not args.gate1_only,
                       effect_w=args.effect_size)
    if not 0 < plan.effect_w < math.inf:
        raise CommandError(f"--effect-size must be a positive Cohen's w, got {args.effect_size}")
    if (plan.draft_lengths or plan.mechanisms or plan.check_table) and settings is None:
        raise CommandError("the sweep and --check-table start servers: give --model (and --speculative-config)")

    def progress(message: str) -> None:
        print(f"[qualify {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    with ExitStack() as stack:
        if any(urls):
            try:
                speculative, standard = (_endpoint(url, args.tokenizer) for url in urls)
            except (OSError, ValueError) as error:
                raise CommandError(f"cannot reach the servers: {error}") from None
            starts = 0
        else:
            progress("starting the standard and the speculative server")
            standard = stack.enter_context(started(settings, None))
            speculative = stack.enter_context(started(settings, speculative_config))
            starts = 2
        report = qualify_bundle(card, speculative_config or {"method": card.drafter.mechanism}, dataset, policy,
                                speculative, standard, plan,
                                start_server=server_factory(settings) if settings else None,
                                progress=progress, engine_starts=starts, after_gates=stack.close)
    document = json.loads(report.model_dump_json())
    if not args.no_archive:
        with open_archive(args.archive_dsn, create=True) as archive:
            document["qualification_id"] = archive.write_qualification(document)
    if args.html:
        write_page(args.html, render_html(document), "qualification page", args)
    print(json.dumps(document, sort_keys=True) if args.json else render_text(document))
    return 0 if report.passed else EXIT_FAILED
