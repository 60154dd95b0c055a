"""`specwatch decisions`: the decisions topic as JSON Lines, checked as a flag client checks it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from typing import TYPE_CHECKING, TextIO

from specwatch.commands._arguments import CommandError

if TYPE_CHECKING:  # the Kafka client and the signing code load when the command runs
    from specwatch.transport.decisions import DecisionReader
    from specwatch.transport.signing import Keyring

__all__ = ["DESCRIPTION", "add_arguments", "run", "print_decisions"]

logger = logging.getLogger(__name__)

_EXIT_UNVERIFIED = 3
_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_FOLLOW_POLL_MS = 500


DESCRIPTION = ("Print every decision on the (compacted) decisions topic, one contract JSON line "
               "each, in topic order. Exits at the end of the topic unless --follow.")


def add_arguments(parser) -> None:
    parser.add_argument("--bootstrap", required=True, metavar="HOST:PORT",
                        help="Kafka bootstrap servers, comma separated")
    parser.add_argument("--topic", help="decisions topic (default: specwatch.decisions)")
    parser.add_argument("--follow", action="store_true", help="keep printing new decisions until interrupted")
    parser.add_argument("--unverified", action="store_true",
                        help="also print decisions whose signature does not check out (they are still reported)")
    parser.add_argument("--timeout", type=float, default=_DEFAULT_CONNECT_TIMEOUT_S, metavar="SECONDS",
                        help="how long to try reaching the cluster (default: %(default)s)")


def print_decisions(reader: DecisionReader, out: TextIO, keyring: Keyring, *, follow: bool = False,
                    print_unverified: bool = False) -> Counter:
    """Print decisions from a connected reader; returns how many failed the signature check, by
    `Verdict` value. With an empty ``keyring`` nothing is checked."""
    from specwatch.transport.signing import verify

    unverified: Counter = Counter()

    def emit(batch) -> None:
        for decision, message in batch:
            if decision is None:
                if message.value is not None:  # tombstones are compaction bookkeeping, not data
                    logger.warning("skipping a message that is not a decision at %s[%d]@%d",
                                   message.topic, message.partition, message.offset)
                continue
            verdict = verify(message.value, message.headers, keyring)
            if not verdict.accepted:
                unverified[verdict.value] += 1
                logger.warning("decision %s at %s[%d]@%d is %s: a flag client ignores it", decision.id,
                               message.topic, message.partition, message.offset, verdict.value)
                if not print_unverified:
                    continue
            out.write(decision.to_json_line() + "\n")
        out.flush()

    if follow:
        while True:
            emit(reader.poll(_FOLLOW_POLL_MS))
    while not reader.caught_up:
        emit(reader.poll())
    return unverified


def run(args: argparse.Namespace) -> int:
    from specwatch.transport.config import BrokerUnavailable, KafkaConfig
    from specwatch.transport.decisions import DecisionReader
    from specwatch.transport.signing import Keyring
    from specwatch.transport.topics import DECISIONS_TOPIC

    try:
        config = KafkaConfig.from_env(args.bootstrap)
        keyring = Keyring.from_env()
    except ValueError as error:
        raise CommandError(str(error)) from None
    if not keyring.enabled:
        logger.warning("no signing key configured: decisions are printed unchecked")
    reader = DecisionReader(config, topic=args.topic or DECISIONS_TOPIC, connect_timeout_s=args.timeout)
    try:
        reader.connect()
    except BrokerUnavailable as error:
        raise CommandError(str(error)) from None
    except LookupError as error:
        raise CommandError(error.args[0]) from None
    unverified: Counter = Counter()
    try:
        unverified = print_decisions(reader, sys.stdout, keyring, follow=args.follow,
                                     print_unverified=args.unverified)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        sys.stderr.close()  # the reader of our output went away (`| head`)
    finally:
        reader.close()
    if unverified:
        counts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(unverified.items()))
        print(f"specwatch decisions: {counts} decision(s) failed the signature check"
              + (" (printed anyway)" if args.unverified else " and were left out"), file=sys.stderr)
        return _EXIT_UNVERIFIED
    return 0
