"""Re-running archived requests on a local vLLM engine, once standard and once speculative.

The card comes from the engine configuration before any model loads: a refused run starts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
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
        from specwatch.collectors.vllm.bundle import describe_bundle
        from .local_engine import configure_cpu_environment, engine_args

        configure_cpu_environment()
        return describe_bundle(engine_args(self.target, self.speculative_config).create_engine_config())

    def run(self, requests: Sequence[RerunRequest]) -> list[RerunOutcome]:
        """Each request alone (so step times are its own): speculative first, then standard."""
        from specwatch.collectors.vllm.collector import VllmCollector
        from .local_engine import close_engine, new_engine

        # Requests run one at a time, so the steps since the last flush belong to one request
        # (vLLM adds a suffix of its own to request ids, so they are not matched by id).
        records: list = []
        collector = VllmCollector(SimpleNamespace(emit=records.append), worker="reproduce")
        with collector.watching():
            engine = new_engine(self.target, self.speculative_config, max_num_seqs=1)
        speculative = []
        try:
            for i, request in enumerate(requests):
                ids = _token_ids(engine, f"reproduce-{i}", request)
                collector.flush()
                steps = [r for r in records if r.kind == "step"]
                records.clear()
                rounds = [(e.drafted, e.accepted) for s in steps for e in s.requests]
                speculative.append((ids, rounds, sum(s.draft_ms for s in steps),
                                    sum(s.verify_ms for s in steps)))
        finally:
            collector.close()
            close_engine(engine)
        engine = new_engine(self.target, None, max_num_seqs=1)
        try:
            return [RerunOutcome(_token_ids(engine, f"reproduce-std-{i}", request), *measured)
                    for i, (request, measured) in enumerate(zip(requests, speculative))]
        finally:
            close_engine(engine)


def _token_ids(engine: Any, request_id: str, request: RerunRequest) -> list[int]:
    # As many tokens as the archived output, EOS or not, so both runs compare position by position.
    from vllm import SamplingParams

    from .local_engine import run_to_completion

    sampling = {name: request.sampling[name] for name in ("temperature", "top_p", "seed")
                if request.sampling.get(name) is not None}
    params = SamplingParams(max_tokens=max(1, len(request.output_ids)), ignore_eos=True, **sampling)
    prompt = {"prompt_token_ids": list(request.prompt_ids)}
    run = run_to_completion(engine, [(request_id, prompt, params)])
    return list(run.outputs[request_id].outputs[0].token_ids)
