"""`specwatch run`: the topology as Faust workers on Kafka, one process or ``--workers N``."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from specwatch.commands._arguments import CommandError, add_archive_option, add_policy_option, load_policy
from specwatch.transport.topics import DEADLETTER_TOPIC, DECISIONS_TOPIC, PARTIALS_TOPIC, TELEMETRY_TOPIC

__all__ = ["DESCRIPTION", "add_arguments", "run"]

_DEFAULT_DATA_DIR = "specwatch-data/faust"
_SUPERVISE_POLL_S = 0.5
_DEFAULT_WEB_PORT = 6066
_STOP_GRACE_S = 30.0


DESCRIPTION = ("Consume OTLP telemetry from Kafka, run stage 1 per telemetry partition and stage 2 "
               "per partials partition, publish decisions to the compacted decisions topic. State is "
               "checkpointed to Kafka: a restarted or replaced worker resumes where it left off.")


def add_arguments(parser) -> None:
    parser.add_argument("--bootstrap", required=True, metavar="HOST:PORT", help="Kafka bootstrap servers")
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start here (default 1)")
    add_policy_option(parser)
    add_archive_option(parser, help="archive decisions, evidence, samples and window stats (e.g. "
                                    "chdb://specwatch-data/archive, or a ClickHouse server http://user@host:8123/db)")
    parser.add_argument("--telemetry-topic", action="append", metavar="TOPIC",
                        help=f"telemetry topic (repeatable; default {TELEMETRY_TOPIC})")
    parser.add_argument("--partials-topic", default=PARTIALS_TOPIC, metavar="TOPIC")
    parser.add_argument("--decisions-topic", default=DECISIONS_TOPIC, metavar="TOPIC")
    parser.add_argument("--deadletter-topic", default=DEADLETTER_TOPIC, metavar="TOPIC")
    parser.add_argument("--app-id", default="specwatch",
                        help="consumer group and prefix of the checkpoint topics (default specwatch)")
    parser.add_argument("--data-dir", default=_DEFAULT_DATA_DIR,
                        help=f"local directory; worker i uses DATA_DIR/worker-i (default {_DEFAULT_DATA_DIR})")
    parser.add_argument("--partitions", type=int, default=4,
                        help="partitions of topics this command has to create (default 4)")
    parser.add_argument("--checkpoint-seconds", type=float, default=2.0,
                        help="seconds between checkpoints of a busy task (default 2)")
    parser.add_argument("--source-silence", type=float, metavar="SECONDS",
                        help="a telemetry partition with nothing to read that sent nothing for this long is idle: "
                             "it closes its slices and stage 2 stops waiting for it (default: the policy's "
                             "windows.source_idle_seconds, 10)")
    parser.add_argument("--session-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="consumer session timeout: how soon a dead worker's partitions move (default 30)")
    parser.add_argument("--replication-factor", type=int, default=1,
                        help="replication of the checkpoint topics it creates (default 1)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="worker log level (default warning; info adds progress and every decision)")
    parser.add_argument("--web-port", type=int, default=os.environ.get("SPECWATCH_WEB_PORT") or str(_DEFAULT_WEB_PORT),
                        metavar="PORT",
                        help="port of the web server serving /metrics, /healthz, /readyz and the Alertmanager "
                             f"webhook; worker i uses PORT+i (default $SPECWATCH_WEB_PORT or {_DEFAULT_WEB_PORT}; "
                             "0: no web server)")
    parser.add_argument("--web-bind", default="0.0.0.0", metavar="ADDRESS",
                        help="interface the web server listens on (default 0.0.0.0)")
    parser.add_argument("--max-metric-keys", type=int, default=2000, metavar="N",
                        help="export per-key metrics for at most N (bundle, bucket, cohort) keys; how many more "
                             "there are is specwatch_metric_keys_overflow (default 2000)")
    parser.add_argument("--alertmanager-url", default=os.environ.get("SPECWATCH_ALERTMANAGER_URL"), metavar="URL",
                        help="post decisions as alerts to this Alertmanager (default $SPECWATCH_ALERTMANAGER_URL)")
    parser.add_argument("--webhook-token-file", default=os.environ.get("SPECWATCH_WEBHOOK_TOKEN_FILE"),
                        metavar="FILE", help="bearer token the Alertmanager webhook demands (default "
                                             "$SPECWATCH_WEBHOOK_TOKEN_FILE; without it the webhook refuses)")
    parser.add_argument("--rollback-policy", metavar="FILE",
                        help="TOML: which alert names map to which reason, and which resolved alerts restore "
                             "(docs/OPERATIONS.md)")
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)


def run(args) -> int:
    import asyncio

    from specwatch.actions.sinks.alertmanager import load_rollback_policy, read_token_file
    from specwatch.streams.faust_app import run_worker
    from specwatch.streams.operations import OperationsSettings
    from specwatch.streams.decision_trace import DECISION_TRACE_ENV
    from specwatch.streams.partition_runner import (StreamSettings, checkpoint_before_publish_setting,
                                                    send_partials_setting)
    from specwatch.transport.config import BrokerUnavailable, KafkaConfig
    from specwatch.transport.topics import TopicError, prepare_topics

    if args.workers < 1:
        raise CommandError(f"--workers must be >= 1, got {args.workers}")
    if args.partitions < 1:
        raise CommandError(f"--partitions must be >= 1, got {args.partitions}")
    # a worker archives only into an archive named on its command line, never the default
    archive = args.archive_dsn if args.archive else None
    if args.workers > 1 and archive is not None and archive.location.engine == "chdb":
        raise CommandError("a chDB archive opens in one process only; with --workers > 1 use a ClickHouse server "
                     "DSN, or run one worker per archive")
    policy = load_policy(args.policy)
    if not 0 <= args.web_port < 65536 - args.workers:
        raise CommandError(f"--web-port must be between 0 and {65535 - args.workers}, got {args.web_port}")
    try:
        operations = OperationsSettings(
            web_port=args.web_port + args.worker_index if args.web_port else None, web_bind=args.web_bind,
            max_metric_keys=args.max_metric_keys, alertmanager_url=args.alertmanager_url or None,
            webhook_token=read_token_file(args.webhook_token_file) if args.webhook_token_file else None,
            rollback=load_rollback_policy(args.rollback_policy), explain_archive=archive.label if archive is not None else None)
        if operations.alertmanager_url:
            from specwatch.actions.sinks.alertmanager import AlertSender

            AlertSender(operations.alertmanager_url)  # the URL is checked before anything starts
    except ValueError as error:
        raise CommandError(str(error))
    kafka = None
    try:
        from specwatch.transport.signing import Keyring

        Keyring.from_env()  # an empty, weak or unreadable key setting stops here, before any topic is touched
        settings = StreamSettings(
            bootstrap=args.bootstrap, app_id=args.app_id, policy=policy, archive_dsn=archive,
            telemetry_topics=tuple(args.telemetry_topic or (TELEMETRY_TOPIC,)),
            partials_topic=args.partials_topic, decisions_topic=args.decisions_topic,
            deadletter_topic=args.deadletter_topic,
            data_dir=str(Path(args.data_dir) / f"worker-{args.worker_index}"),
            checkpoint_seconds=args.checkpoint_seconds, operations=operations,
            source_silence_seconds=args.source_silence or policy.windows.source_idle_seconds,
            session_timeout_seconds=args.session_timeout,
            replication_factor=args.replication_factor,
            partials_after_seconds=send_partials_setting(),
            checkpoint_before_publish=checkpoint_before_publish_setting(),
            decision_trace=os.environ.get(DECISION_TRACE_ENV) or None)
        # TLS/SASL from SPECWATCH_KAFKA_* (docs/DEPLOY.md); secrets never reach the log
        kafka = KafkaConfig.from_env(args.bootstrap)
        settings = replace(settings, kafka=kafka)
        settings = settings.with_partitions(asyncio.run(prepare_topics(settings.topic_plan(),
                                                                      default_partitions=args.partitions)))
    except BrokerUnavailable as error:
        hint = ("is the broker running, and do the SPECWATCH_KAFKA_* security settings match its listener "
                f"({kafka.security_protocol}, credentials of the user given)?"
                if kafka is not None and kafka.security_protocol != "PLAINTEXT"
                else "is the broker running? (deploy/kafka/broker.sh start)")
        raise CommandError(f"{error}\n  {hint}")
    except (TopicError, ValueError) as error:
        raise CommandError(str(error))
    if args.workers == 1:
        os.makedirs(settings.data_dir, exist_ok=True)
        level = "debug" if getattr(args, "verbose", False) else args.log_level
        from specwatch.archive.errors import ArchiveError

        try:
            return run_worker(settings, loglevel=level)
        except ArchiveError as error:  # e.g. the archive is held by another process
            raise CommandError(str(error)) from None
    return _supervise(args)


def _worker_command(args, index: int) -> list[str]:
    """Worker ``index``'s command line: every option of this one that has a value, one worker."""
    command = [sys.executable, "-m", "specwatch.cli", *(["-v"] if getattr(args, "verbose", False) else []),
               "run", "--workers", "1", "--worker-index", str(index)]
    for name, value in vars(args).items():
        if name in _NOT_PASSED_ON or value in (None, ""):
            continue
        for one in value if isinstance(value, list) else [value]:
            command += [f"--{name.replace('_', '-')}", str(one)]
    return command


_NOT_PASSED_ON = ("archive_dsn", "command", "func", "verbose", "workers", "worker_index")


def _supervise(args) -> int:
    """Start the workers; stop them all when told to, or when one of them ends."""
    children = [subprocess.Popen(_worker_command(args, i)) for i in range(args.workers)]
    stopping = False

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = 0
        while not stopping:
            ended = [c for c in children if c.poll() is not None]
            if ended:
                code = next((c.returncode for c in ended if c.returncode), 0)
                print(f"specwatch run: worker pid {ended[0].pid} ended with code {ended[0].returncode}; "
                      "stopping the others", file=sys.stderr)
                break
            time.sleep(_SUPERVISE_POLL_S)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
