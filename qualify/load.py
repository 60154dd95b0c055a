"""Gate 2's load: vLLM's own benchmark client (`vllm.benchmarks.serve`) against one server at one
concurrency, over the dataset's prompts, while the server's KV cache usage is sampled from /metrics."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Sequence

from .dataset import QualificationRequest

__all__ = ["KvSampler", "benchmark_run"]

_LOG = logging.getLogger(__name__)
_KV_GAUGE = "vllm:kv_cache_usage_perc"
_DEFAULT_KV_PERIOD_S = 0.2


class KvSampler:
    """Highest ``vllm:kv_cache_usage_perc`` seen on a server's /metrics while the sampler runs."""

    def __init__(self, base_url: str, period_s: float = _DEFAULT_KV_PERIOD_S) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.period_s = period_s
        self.peak = math.nan
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)

    def _sample(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _KV_GAUGE:
                    self.peak = sample.value if math.isnan(self.peak) else max(self.peak, sample.value)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except (OSError, ValueError) as error:
                _LOG.debug("metrics of %s unreadable: %s", self.url, error)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "KvSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError, ValueError):
            self._sample()  # the last word: a peak between the final poll and the end


def _prompt_file(requests: Sequence[QualificationRequest], folder: Path, num_prompts: int) -> tuple[Path, list[str]]:
    """``num_prompts`` prompts as vLLM's custom dataset reads them, cycling through the dataset's prompt
    requests in order (chat requests are left to Gate 1), and the bucket of each line: the client keeps
    the file's order (shuffling off) and needs no oversampling, so its i-th result is line i."""
    path = folder / "prompts.jsonl"
    prompted = [r for r in requests if r.prompt is not None]
    if not prompted:
        raise ValueError("no prompt request in the dataset: the load generator sends completions only")
    chosen = [prompted[i % len(prompted)] for i in range(num_prompts)]
    path.write_text("".join(json.dumps({"prompt": r.prompt, "output_tokens": r.sampling.max_tokens}) + "\n"
                            for r in chosen))
    return path, [r.bucket for r in chosen]


def benchmark_run(base_url: str, model: str, tokenizer: str, requests: Sequence[QualificationRequest],
                  concurrency: int, num_prompts: int, seed: int = 0) -> tuple[dict, float]:
    """(vLLM's benchmark result, KV peak) for ``num_prompts`` greedy requests ``concurrency`` at a
    time; every request runs to its ``max_tokens`` (EOS ignored) so both paths do the same work. The
    result's ``buckets`` names the bucket of each request of its per-request lists."""
    from specwatch.engines.vllm.local_engine import quiet_vllm_logging

    quiet_vllm_logging()
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    with tempfile.TemporaryDirectory(prefix="specwatch-load-") as folder:
        prompts, buckets = _prompt_file(requests, Path(folder), num_prompts)
        args = parser.parse_args([
            "--backend", "openai", "--base-url", base_url.rstrip("/"), "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(prompts), "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--temperature", "0",
            "--ignore-eos", "--disable-tqdm", "--save-detailed", "--num-warmups", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
        ])
        # the client prints its own report on stdout, which belongs to --json output
        with contextlib.redirect_stdout(sys.stderr), KvSampler(base_url) as kv:
            result = serve.main(args)
    # per-request lists stay in the result with --save-detailed only (the client drops them otherwise)
    answered = len(result.get("output_lens") or [])
    if answered != len(buckets):
        raise ValueError(f"the benchmark client gave per-request results for {answered} of the {len(buckets)} "
                         "requests sent: they cannot be matched to buckets")
    return dict(result, buckets=buckets), kv.peak
