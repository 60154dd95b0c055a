"""A vLLM server's own Prometheus counters of speculative decoding, read from its ``/metrics``: coarse
per-server evidence (no bucket, no cohort) beside the per-request metrics of its responses. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ServerCounters", "parse_server_metrics"]

_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative counters of one server (summed over its engines), and its KV-cache usage now."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    kv_usage: float | None = None
    speculative: bool = False  # whether the server reports speculative decoding at all

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify step (accepted drafts + 1) since the server started; nan before any."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")


def parse_server_metrics(text: str) -> ServerCounters:
    """The spec-decode counters and KV usage in a vLLM ``/metrics`` page.

    >>> page = '''# TYPE vllm:spec_decode_num_drafts counter
    ... vllm:spec_decode_num_drafts_total{engine="0"} 10.0
    ... # TYPE vllm:spec_decode_num_accepted_tokens counter
    ... vllm:spec_decode_num_accepted_tokens_total{engine="0"} 15.0
    ... # TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
    ... vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 5.0
    ... vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 10.0
    ... # TYPE vllm:kv_cache_usage_perc gauge
    ... vllm:kv_cache_usage_perc{engine="0"} 0.25
    ... '''
    >>> counters = parse_server_metrics(page)
    >>> counters.accepted_per_position, counters.acceptance_length, counters.kv_usage, counters.speculative
    ((10, 5), 2.5, 0.25, True)
    """
    totals = {name: 0 for name in _COUNTERS.values()}
    positions: dict[int, int] = {}
    kv: list[float] = []
    speculative = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # by sample name: the parser does not file "name:with:colons_total" under its TYPE line
            name = sample.name.removesuffix("_total")
            if name in _COUNTERS:
                speculative = True
                totals[_COUNTERS[name]] += int(sample.value)
            elif name == _PER_POSITION:
                position = int(sample.labels.get("position", 0))
                positions[position] = positions.get(position, 0) + int(sample.value)
            elif name == _KV_USAGE:
                kv.append(float(sample.value))
    per_position = tuple(positions.get(i, 0) for i in range(max(positions) + 1)) if positions else ()
    return ServerCounters(**totals, accepted_per_position=per_position, kv_usage=max(kv) if kv else None,
                          speculative=speculative)


