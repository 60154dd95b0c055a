"""Re-running archived requests on a local vLLM engine, once standard and once speculative.

The card comes from the engine configuration before any model loads: a refused run starts nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specwatch.schemas import BundleCard
from specwatch.schemas.rerun import RerunOutcome, RerunRequest

__all__ = ["VllmRerunner", "speculative_config_for"]

def speculative_config_for(card: BundleCard) -> dict:
    """vLLM's speculative_config for a bundle card's drafter, where the card says enough.

    >>> from specwatch.schemas import DrafterCard, TargetCard
    >>> card = BundleCard(target=TargetCard(model_id="/m/target"),
    ...                   drafter=DrafterCard(mechanism="ngram", revision="ngram:lookup=2-3", draft_length=4))
    >>> speculative_config_for(card)
    {'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_min': 2, 'prompt_lookup_max': 3}
    """
    drafter = card.drafter
    revision = drafter.revision
    method, _, rest = revision.partition(":")
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": drafter.draft_length}
    if drafter.mechanism == "ngram" and rest.startswith("lookup="):
        low, _, high = rest.removeprefix("lookup=").partition("-")
        config.update(prompt_lookup_min=int(low), prompt_lookup_max=int(high))
    elif method == "draft_model" and rest:
        config["model"] = rest.rsplit("@", 1)[0]
    else:
        raise ValueError(f"the card's drafter ({drafter.mechanism}, {revision!r}) does not say how to build it; "
                         "pass --speculative-config with vLLM's speculative_config as JSON")
    return config


class VllmRerunner:
    """A local vLLM engine pair on CPU or GPU: the target alone, and the target with the drafter."""

    def __init__(self, target: str | Path, speculative_config: dict) -> None:
        from .local_engine import quiet_vllm_logging

        quiet_vllm_logging()
        self.target = str(target)
        self.speculative_config = dict(speculative_config)

    def card(self) -> BundleCard:
        from .bundle import describe_bundle
        from .local_engine import configure_cpu_environment, engine_args

        configure_cpu_environment()
        return describe_bundle(engine_args(self.target, self.speculative_config).create_engine_config())

    def run(self, requests: Sequence[RerunRequest]) -> list[RerunOutcome]:
        """Each request alone (so step times are its own): speculative first, then standard."""
        from .collector import VllmCollector
        from .local_engine import close_engine, new_engine, run_to_completion

        rounds = _Rounds()
        collector = VllmCollector(rounds, worker="reproduce")
        with collector.watching():
            engine = new_engine(self.target, self.speculative_config, max_num_seqs=1)
        speculative = []
        try:
            for i, request in enumerate(requests):
                request_id = f"reproduce-{i}"
                rounds.take()  # nothing from before this request
                run = run_to_completion(engine, [(request_id, _prompt(request), _params(request))])
                collector.flush()
                speculative.append((list(run.outputs[request_id].outputs[0].token_ids), rounds.take()))
        finally:
            collector.close()
            close_engine(engine)
        engine = new_engine(self.target, None, max_num_seqs=1)
        outcomes = []
        try:
            for i, (request, (ids, (steps, draft_ms, verify_ms))) in enumerate(zip(requests, speculative)):
                request_id = f"reproduce-std-{i}"
                run = run_to_completion(engine, [(request_id, _prompt(request), _params(request))])
                outcomes.append(RerunOutcome(list(run.outputs[request_id].outputs[0].token_ids), ids,
                                             steps, draft_ms, verify_ms))
        finally:
            close_engine(engine)
        return outcomes

    def __repr__(self) -> str:
        return f"VllmRerunner({self.target!r}, {json.dumps(self.speculative_config, sort_keys=True)})"


class _Rounds:
    """The collector's sink here: the (drafted, accepted) of every step and the step times.

    Requests run one at a time, so everything since the last `take` belongs to one request
    (vLLM adds a suffix of its own to request ids, so they are not matched by id).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._rounds: list[tuple[int, int]] = []
        self._draft_ms = 0.0
        self._verify_ms = 0.0

    def emit(self, record: Any) -> None:
        if record.kind != "step":
            return
        with self._lock:
            self._rounds.extend((entry.drafted, entry.accepted) for entry in record.requests)
            self._draft_ms += record.draft_ms
            self._verify_ms += record.verify_ms

    def take(self) -> tuple[list, float, float]:
        with self._lock:
            taken = (self._rounds, self._draft_ms, self._verify_ms)
            self._reset()
        return taken


def _prompt(request: RerunRequest) -> dict:
    return {"prompt_token_ids": list(request.prompt_ids)}


def _params(request: RerunRequest) -> Any:
    from vllm import SamplingParams

    sampling = request.sampling
    # As many tokens as the archived output, EOS or not, so both runs compare position by position.
    kwargs: dict[str, Any] = {"max_tokens": max(1, len(request.output_ids)), "ignore_eos": True}
    for name in ("temperature", "top_p", "seed"):
        if sampling.get(name) is not None:
            kwargs[name] = sampling[name]
    return SamplingParams(**kwargs)
