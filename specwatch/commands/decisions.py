"""`specwatch decisions`: print the decisions topic as contract JSON Lines, in topic order.

Reads from the beginning and stops at the end of the topic, or keeps following with --follow;
an unreachable cluster is reported in seconds with exit code 2, not waited on.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TextIO

from specwatch.actions.decisions_topic import DEFAULT_DECISIONS_TOPIC, BrokerUnavailable, DecisionReader
from specwatch.collectors.otel import KafkaConfig

__all__ = ["register", "print_decisions"]

logger = logging.getLogger(__name__)

_EXIT_OK = 0
_EXIT_UNREACHABLE = 2
_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_FOLLOW_POLL_MS = 500


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "decisions",
        help="print the decisions topic as JSON Lines",
        description="Print every decision on the (compacted) decisions topic, one contract JSON line "
                    "each, in topic order. Exits at the end of the topic unless --follow.",
    )
    parser.add_argument("--bootstrap", required=True, metavar="HOST:PORT",
                        help="Kafka bootstrap servers, comma separated")
    parser.add_argument("--topic", default=DEFAULT_DECISIONS_TOPIC, help="decisions topic (default: %(default)s)")
    parser.add_argument("--follow", action="store_true", help="keep printing new decisions until interrupted")
    parser.add_argument("--timeout", type=float, default=_DEFAULT_CONNECT_TIMEOUT_S, metavar="SECONDS",
                        help="how long to try reaching the cluster (default: %(default)s)")
    parser.set_defaults(func=_run)


def print_decisions(reader: DecisionReader, out: TextIO, *, follow: bool = False) -> tuple[int, int]:
    """Print decisions from a connected reader; returns (printed, skipped undecodable)."""
    printed = skipped = 0

    def emit(batch) -> None:
        nonlocal printed, skipped
        for decision, message in batch:
            if decision is None:
                if message.value is not None:  # tombstones are compaction bookkeeping, not data
                    skipped += 1
                    logger.warning("skipping a message that is not a decision at %s[%d]@%d",
                                   message.topic, message.partition, message.offset)
                continue
            out.write(decision.to_json_line() + "\n")
            printed += 1
        out.flush()

    if follow:
        while True:
            emit(reader.poll(_FOLLOW_POLL_MS))
    while not reader.caught_up:
        emit(reader.poll())
    return printed, skipped


def _run(args: argparse.Namespace) -> int:
    try:
        config = KafkaConfig(args.bootstrap)
    except ValueError as error:
        print(f"specwatch decisions: {error}", file=sys.stderr)
        return _EXIT_UNREACHABLE
    reader = DecisionReader(config, topic=args.topic, connect_timeout_s=args.timeout)
    try:
        reader.connect()
    except BrokerUnavailable as error:
        print(f"specwatch decisions: {error}", file=sys.stderr)
        return _EXIT_UNREACHABLE
    except LookupError as error:
        print(f"specwatch decisions: {error.args[0]}", file=sys.stderr)
        return _EXIT_UNREACHABLE
    try:
        print_decisions(reader, sys.stdout, follow=args.follow)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader of our output went away (e.g. `| head`): not an error of ours.
        sys.stderr.close()
    finally:
        reader.close()
    return _EXIT_OK
