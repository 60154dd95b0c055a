"""`specwatch reproduce DECISION_ID`: re-run a decision's sealed requests on both paths."""

from __future__ import annotations

import getpass
import json
import time

from specwatch.commands._arguments import (CommandError, actor_name, add_archive_option, add_json_option,
                                           open_archive)

__all__ = ["DESCRIPTION", "add_arguments", "run"]


DESCRIPTION = ("Open the sealed samples of an archived decision with the sample key "
               "($SPECWATCH_SAMPLE_KEY_FILE or $SPECWATCH_SAMPLE_KEY), check that the local engine's "
               "bundle card matches the decision's, and run each request twice under its archived "
               "sampling settings and seed: on the target with standard decoding and with the bundle's "
               "drafter. Reports, per request, the first divergent token, acceptance by draft position, "
               "draft and verify time and a verdict; the result is archived beside the decision. Every "
               "opening is audited. Exit 0 when it ran, 1 when the decision or its samples are missing, "
               "2 on bad arguments, 3 when it refused (key, bundle).")


def add_arguments(parser) -> None:
    parser.add_argument("decision_id", help="the decision's id (d-...), as `specwatch query decisions` shows it")
    add_json_option(parser, help="print the result as one JSON object")
    parser.add_argument("--engine", choices=["vllm"], default="vllm", help="the local engine (default: vllm)")
    parser.add_argument("--model", default=None,
                        help="the target model to load (default: the model id on the decision's bundle card)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="vLLM's speculative_config (default: derived from the card's drafter)")
    add_archive_option(parser)
    parser.add_argument("--force", action="store_true",
                        help="run even when the local bundle card differs (verdicts say 'bundle differs')")
    parser.add_argument("--actor", default=None, help="who opens the samples, for the audit (default: the user)")


def run(args) -> int:
    from specwatch.analysis.reproduce import ReproduceError, render_result, reproduce_decision
    from specwatch.schemas.sealed import SampleKey

    try:
        key = SampleKey.from_env()
        speculative_config = json.loads(args.speculative_config) if args.speculative_config else None
    except ValueError as error:
        raise CommandError(str(error)) from None
    if speculative_config is not None and not isinstance(speculative_config, dict):
        raise CommandError("--speculative-config must be a JSON object")
    actor = actor_name(args.actor, "--actor") if args.actor is not None else _user()
    _check_engine(args.engine)

    def rerunner_for(card):
        try:
            from specwatch.engines.vllm.rerunner import VllmRerunner, speculative_config_for
        except ImportError as error:
            raise ReproduceError(f"the vLLM integration is not available ({error}); install it with "
                                 "deploy/bootstrap.sh --with-vllm", 2) from None
        try:
            config = speculative_config if speculative_config is not None else speculative_config_for(card)
        except ValueError as error:
            raise ReproduceError(str(error), 2) from None
        return VllmRerunner(args.model or card.target.model_id, config)

    with open_archive(args.archive_dsn) as archive:
        try:
            result = reproduce_decision(archive, args.decision_id, key, None, actor, time.time,
                                        force=args.force, rerunner_for=rerunner_for)
        except ReproduceError as error:
            raise CommandError(str(error), error.exit_code) from None
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(render_result(result))
    return 0


def _check_engine(engine: str) -> None:
    """`CommandError` (exit 2) unless the local engine imports: checked before any sample is
    opened or audited, so a machine without vLLM leaves no opening in the audit trail."""
    try:
        import vllm  # noqa: F401  (slow, and needed for the re-runs anyway)

        from specwatch.engines.vllm.rerunner import VllmRerunner  # noqa: F401
    except Exception as error:  # a broken install raises more than ImportError
        raise CommandError(f"the {engine} engine is not available ({type(error).__name__}: {error}); install it "
                           "with deploy/bootstrap.sh --with-vllm; no sample was opened") from None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
