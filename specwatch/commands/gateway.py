"""`specwatch gateway`: an OpenAI-compatible proxy in front of a speculative and a standard pool."""

from __future__ import annotations

import json
import logging
import os
import sys

from specwatch.commands._arguments import CommandError, add_policy_option, load_policy

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = ("Proxy /v1/completions and /v1/chat/completions to a speculative or a standard pool of vLLM "
               "servers by each scope's flag state; every response becomes contract-v1 telemetry, decided in "
               "this process (default) or on Kafka (--bootstrap) (docs/DEPLOY.md, \"The gateway\").")


def add_arguments(parser) -> None:
    parser.add_argument("--speculative", metavar="URL", required=True,
                        help="base URL of the speculative pool (a vLLM OpenAI server with a drafter)")
    parser.add_argument("--standard", metavar="URL", required=True,
                        help="base URL of the standard pool (the same target, no drafter)")
    parser.add_argument("--speculative-config", metavar="JSON", required=True,
                        help="the --speculative-config the speculative pool was started with (its card's drafter)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument("--name", default="gateway", help="worker name prefix of the gateway's records")
    parser.add_argument("--rules", metavar="FILE", help="TOML rule table: [[rule]] rows giving bucket and cohort "
                        "by route, model name or a JSON path (headers x-specwatch-bucket/-cohort win)")
    parser.add_argument("--model-dir", metavar="DIR", help="the target checkpoint, if readable here: its digests "
                        "go on the card")
    parser.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka: telemetry to the telemetry topic, flags "
                        "from the decisions topic (signed; SPECWATCH_KAFKA_* and SPECWATCH_SIGNING_KEY* settings); "
                        "without it an embedded pipeline decides in this process")
    add_policy_option(parser, help="policy TOML file of the embedded pipeline (defaults built in)")
    parser.add_argument("--decisions", metavar="FILE.jsonl", help="embedded: append each decision to this file")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a pool may stay silent within a response (default 120)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a pool (default 5)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB)")
    parser.add_argument("--no-retry", action="store_true",
                        help="do not retry on the standard pool what failed on the speculative pool")


def run(args) -> int:
    from specwatch.gateway import GatewaySettings, LabelRules

    try:
        speculative_config = json.loads(args.speculative_config)
        if not isinstance(speculative_config, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        raise CommandError(f"--speculative-config is not a JSON object: {error}") from None
    rules = LabelRules()
    if args.rules:
        rules = _rules(args.rules)
    try:
        settings = GatewaySettings(speculative_url=args.speculative, standard_url=args.standard,
                                   speculative_config=speculative_config, name=args.name, rules=rules,
                                   read_timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
                                   max_body_bytes=args.max_body_bytes, retry=not args.no_retry,
                                   model_dir=args.model_dir)
    except ValueError as error:
        raise CommandError(str(error)) from None
    if args.bootstrap:
        if args.policy or args.decisions:
            raise CommandError("--policy and --decisions are for the embedded pipeline; with --bootstrap the "
                               "stream processors (specwatch run) decide")
        sink, flags, stop = _kafka(args.bootstrap)
    else:
        sink, flags, stop = _embedded(load_policy(args.policy), args.decisions)
    try:
        _serve(settings, flags, sink, args.host, args.port)
    finally:
        stop()
    return 0


def _rules(path: str):
    import tomllib

    from pydantic import ValidationError

    from specwatch.gateway import LabelRules

    try:
        with open(path, "rb") as f:
            return LabelRules.model_validate(tomllib.load(f))
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, ValidationError) as error:
        raise CommandError(f"{path} is not a rule table: {error}") from None


def _embedded(policy, decisions_path: str | None):
    import time

    from specwatch.gateway import EmbeddedFeed
    from specwatch.streams.embedded import EmbeddedPipeline

    out = open(decisions_path, "a", encoding="utf-8") if decisions_path else None  # noqa: SIM115

    def write(decision) -> None:
        if out is not None:
            out.write(decision.to_json_line() + "\n")
            out.flush()

    feed = EmbeddedFeed(EmbeddedPipeline(policy, clock=time.time), on_decision=write)

    def stop() -> None:
        feed.shutdown()
        if out is not None:
            out.close()
    return feed, feed.flags, stop


def _kafka(bootstrap: str):
    from specwatch.collectors.vllm.kafka import decision_flags
    from specwatch.collectors.vllm.sink import telemetry_sink

    environ = dict(os.environ, SPECWATCH_KAFKA_BOOTSTRAP=bootstrap)
    environ.setdefault("SPECWATCH_VLLM_WORKER", "gateway")
    sink = telemetry_sink(environ, exporter="kafka")
    flags = decision_flags(environ)

    def stop() -> None:
        flags.stop()
        sink.shutdown()
    return sink, flags, stop


def _serve(settings, flags, sink, host: str, port: int) -> None:
    import uvicorn

    from specwatch.gateway import Gateway, build_app

    app = build_app(Gateway(settings, flags, sink))
    # uvicorn's access log would print every request line; the gateway's /metrics counts them instead
    logging.getLogger("uvicorn.access").disabled = True
    print(f"specwatch gateway: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
