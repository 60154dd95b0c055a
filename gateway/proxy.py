"""`specwatch gateway`: an OpenAI-compatible proxy (starlette, httpx) in front of a speculative and a
standard pool; routes each request by its scope's flag state and records what it saw as contract v1."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from specwatch.schemas import bundle_digest

from .evidence import (Exchange, bundle_record, card_from_server, digest_text, finish_reason, request_record,
                       shadow_record, step_records)
from .metrics import GatewayMetrics
from .routing import (SPECULATIVE, STANDARD, LabelRules, Route, assign_labels, choose_route, mirrorable,
                      share_draw, valid_label)
from .scrape import ServerCounters, parse_server_metrics

__all__ = ["Gateway", "GatewaySettings", "build_app"]

logger = logging.getLogger(__name__)

_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_READ_TIMEOUT_S = 120.0
_DEFAULT_MAX_BODY_BYTES = 4 << 20
_DEFAULT_SCRAPE_INTERVAL_S = 5.0
_DEFAULT_CARD_INTERVAL_S = 30.0
_REQUEST_ID_HEADER = "x-request-id"
_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Headers that describe one hop, not the request: never forwarded (RFC 9110 section 7.6.1).
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                          "accept-encoding"})
_TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


@dataclass(frozen=True)
class GatewaySettings:
    """Where the pools are, the speculative config the speculative pool serves, and the limits."""

    speculative_url: str
    standard_url: str
    speculative_config: Mapping[str, Any]
    name: str = "gateway"
    rules: LabelRules = field(default_factory=LabelRules)
    baseline_cohort: str = "baseline"
    shadow_cohort: str = "shadow"
    connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = _DEFAULT_READ_TIMEOUT_S
    max_body_bytes: int = _DEFAULT_MAX_BODY_BYTES
    retry: bool = True
    scrape_interval_s: float = _DEFAULT_SCRAPE_INTERVAL_S
    card_interval_s: float = _DEFAULT_CARD_INTERVAL_S
    model_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "scrape_interval_s", "card_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        for url in (self.speculative_url, self.standard_url):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a pool URL must start with http:// or https://, got {url!r}")


class _Failed(Exception):
    """A pool failed an attempt before the client got anything: ``kind`` is error or timeout."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class _Call:
    """One client request as the gateway handles it."""

    route: str
    body: dict
    headers: dict[str, str]
    request_id: str
    bucket: str
    cohort: str
    stream: bool
    client_usage: bool
    client_token_ids: bool
    sampling: dict
    prompt_sha256: str
    mirror: asyncio.Future | None = None  # the standard answer's token ids, for the shadow check


class Gateway:
    """The proxy's state: pool clients, the card, flags to route by, the telemetry sink, counters.

    ``flags`` answers ``lookup(bundle, bucket, cohort)`` and ``admission(bundle)`` (a `FlagStore`, or a
    `FlagClient` following the decisions topic); ``sink`` takes contract records by ``emit(record)``
    and never blocks.
    """

    def __init__(self, settings: GatewaySettings, flags: Any, sink: Any,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.flags = flags
        store = getattr(flags, "store", flags)  # a FlagClient keeps its stages in its store
        self._admission = store.admission
        self.sink = sink
        self.metrics = GatewayMetrics()
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.clients = {pool: httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits,
                                                transport=transport)
                        for pool, url in ((SPECULATIVE, settings.speculative_url),
                                          (STANDARD, settings.standard_url))}
        self.card = None
        self.bundle_id: str | None = None
        self.speculative_up = True
        self.counters: dict[str, ServerCounters] = {}
        # step sequence numbers of this process: from its start time, so a restarted gateway never reuses one
        self._next_seq = int(time.time() * 1e6)
        self._tasks: list[asyncio.Task] = []
        self._mirrors: set[asyncio.Task] = set()
        self.metrics.shadow_in_flight = lambda: len(self._mirrors)
        self.workers = {pool: f"{settings.name}:{pool}" for pool in (SPECULATIVE, STANDARD)}

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh_card()
        await self.scrape()
        self._tasks = [asyncio.create_task(self._every(self.settings.card_interval_s, self.refresh_card)),
                       asyncio.create_task(self._every(self.settings.scrape_interval_s, self.scrape))]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._mirrors:
            await asyncio.gather(*self._mirrors, return_exceptions=True)
        for client in self.clients.values():
            await client.aclose()

    @property
    def mirrors_in_flight(self) -> int:
        """Shadow copies sent to the speculative pool whose comparison has not been made yet."""
        return len(self._mirrors)

    async def _every(self, seconds: float, job) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await job()
            except Exception:  # noqa: BLE001 - a background job never stops the proxy
                logger.exception("gateway background job failed")

    async def refresh_card(self) -> None:
        """The speculative pool's card from ``/v1/models`` and ``/version``; its bundle record re-sent."""
        client = self.clients[SPECULATIVE]
        try:
            models = (await client.get("/v1/models")).raise_for_status().json()
            version_response = await client.get("/version")
            version = version_response.json().get("version") if version_response.status_code == 200 else None
            card = card_from_server(models, self.settings.speculative_config, version, self.settings.model_dir)
        except (httpx.HTTPError, ValueError, KeyError) as error:
            self.metrics.count("scrape_errors", (SPECULATIVE,))
            logger.warning("cannot read the speculative pool's card: %s", type(error).__name__)
            return
        if self.bundle_id is not None and bundle_digest(card) != self.bundle_id:
            logger.warning("the speculative pool's card changed: bundle %s -> %s", self.bundle_id,
                           bundle_digest(card))
        self.card, self.bundle_id = card, bundle_digest(card)
        self._emit(bundle_record(self.workers[SPECULATIVE], card, time.time()))

    async def scrape(self) -> None:
        """Each pool's spec-decode counters and KV usage from its ``/metrics``."""
        for pool, client in self.clients.items():
            try:
                response = await client.get("/metrics")
                response.raise_for_status()
                self.counters[pool] = parse_server_metrics(response.text)
                up = True
            except (httpx.HTTPError, ValueError):
                self.metrics.count("scrape_errors", (pool,))
                up = False
            self.metrics.pool_up[pool] = up
            if pool == SPECULATIVE:
                self.speculative_up = up
        self.metrics.pools = dict(self.counters)

    # -- telemetry ---------------------------------------------------------------------------
    def _emit(self, record) -> None:
        try:
            self.sink.emit(record)
            self.metrics.count("telemetry_records", (record.kind,))
        except Exception:  # noqa: BLE001 - telemetry never costs a request
            self.metrics.count("telemetry_errors", (record.kind,))
            logger.exception("the telemetry sink refused a %s record", record.kind)

    def _record(self, exchange: Exchange) -> None:
        """The request record of one attempt, and step records of a speculative one."""
        if self.bundle_id is None:
            return
        speculative = exchange.pool == SPECULATIVE
        worker = self.workers[exchange.pool]
        try:
            if speculative and exchange.speculative_metrics is not None:
                kv = self.counters.get(SPECULATIVE, ServerCounters()).kv_usage or 0.0
                steps = step_records(worker, self.bundle_id, exchange, self._next_seq, kv)
                self._next_seq += len(steps)
                for step in steps:
                    self._emit(step)
            self._emit(request_record(worker, self.bundle_id, exchange, speculative))
        except ValueError:  # a value the contract refuses: counted, the response is unaffected
            self.metrics.count("telemetry_errors", ("request",))
            logger.warning("a response gave values the contract refuses; no record for it")

    # -- requests ----------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        route = request.url.path
        body_bytes = await _read_limited(request, self.settings.max_body_bytes)
        if body_bytes is None:
            self.metrics.count("rejected", ("body_too_large",))
            return _error(413, f"request body over {self.settings.max_body_bytes} bytes")
        try:
            body = json.loads(body_bytes)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.metrics.count("rejected", ("invalid_json",))
            return _error(400, "the request body must be a JSON object")
        headers = {k.lower(): v for k, v in request.headers.items()}
        given_id = headers.get(_REQUEST_ID_HEADER)
        request_id = given_id if valid_label(given_id) else uuid.uuid4().hex
        stage = self._admission(self.bundle_id) if self.bundle_id else None
        labels = assign_labels(self.settings.rules, route, headers, body, stage, share_draw(request_id))
        if self.bundle_id is None:  # no card yet: nothing to judge a speculative answer against
            chosen = Route(STANDARD, "bundle_unknown")
        else:
            chosen = choose_route(self.flags.lookup(self.bundle_id, labels.bucket, labels.cohort), stage,
                                  labels.cohort, speculative_up=self.speculative_up,
                                  baseline_cohort=self.settings.baseline_cohort,
                                  shadow_cohort=self.settings.shadow_cohort)
        self.metrics.count("requests", (route, chosen.pool, chosen.reason))
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        call = _Call(route=route, body=body, headers=_forwarded(headers), request_id=request_id,
                     bucket=labels.bucket, cohort=labels.cohort, stream=stream,
                     client_usage=isinstance(options, dict) and bool(options.get("include_usage")),
                     client_token_ids=bool(body.get("return_token_ids")),
                     sampling={k: body.get(k) for k in ("temperature", "top_p", "seed", "max_tokens")},
                     prompt_sha256=digest_text(body.get("messages") if "messages" in body else body.get("prompt")))
        if chosen.mirror and mirrorable(body):
            call.mirror = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._shadow(call, labels.cohort))
            self._mirrors.add(task)
            task.add_done_callback(self._mirrors.discard)
            # the client's answer is standard decoding: its record is baseline traffic, not the shadow's
            call.cohort = self.settings.rules.default_cohort
        return await self._answer(call, chosen.pool, chosen.reason)

    async def _answer(self, call: _Call, pool: str, reason: str) -> Response:
        """Answer from ``pool``; a speculative attempt that failed before any token goes once to standard.
        The response says which pool answered and why (``x-specwatch-pool``, ``x-specwatch-route``)."""
        try:
            return _routed(await (self._stream(call, pool) if call.stream else self._whole(call, pool)),
                           pool, reason)
        except _Failed as failure:
            self.metrics.count("upstream_failures", (pool, failure.kind))
            if pool == SPECULATIVE and self.settings.retry and call.headers.get("x-specwatch-retry") != "never":
                self.metrics.count("retries", (failure.kind,))
                try:
                    return _routed(await (self._stream(call, STANDARD) if call.stream
                                          else self._whole(call, STANDARD)), STANDARD, "retry")
                except _Failed as second:
                    self.metrics.count("upstream_failures", (STANDARD, second.kind))
                    failure = second
            self._settle(call, None)
            status = 504 if failure.kind == "timeout" else 502
            self.metrics.count("responses", (pool, str(status)))
            return _error(status, f"the {pool} pool failed: {failure.kind}")

    def _upstream_body(self, call: _Call) -> dict:
        body = dict(call.body)
        if call.stream:
            # vLLM puts a request's speculative metrics on the final usage chunk only
            body["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
        if call.mirror is not None:
            body["return_token_ids"] = True
        return body

    def _exchange(self, call: _Call, pool: str) -> Exchange:
        return Exchange(request_id=call.request_id, bucket=call.bucket, cohort=call.cohort, pool=pool,
                        started=time.time(), prompt_sha256=call.prompt_sha256, sampling=call.sampling)

    async def _whole(self, call: _Call, pool: str) -> Response:
        exchange = self._exchange(call, pool)
        upstream = await self._attempt(exchange, self.clients[pool].post(
            call.route, json=self._upstream_body(call), headers=call.headers))
        exchange.finished = time.time()
        if upstream.status_code >= 500:
            self._failed(exchange, "error", f"HTTP {upstream.status_code}")
            raise _Failed("error", f"HTTP {upstream.status_code}")
        self.metrics.count("responses", (pool, f"{upstream.status_code // 100}xx"))
        if upstream.status_code != 200:  # the client's own error: the same on either pool, no telemetry
            self._settle(call, None)
            return Response(upstream.content, upstream.status_code, media_type="application/json")
        try:
            payload = upstream.json()
        except ValueError:
            self._failed(exchange, "error", "invalid JSON from the pool")
            raise _Failed("error", "invalid JSON") from None
        _note_answer(exchange, payload)
        self._record(exchange)
        self._settle(call, exchange.token_ids)
        if call.mirror is not None and not call.client_token_ids:
            _strip_token_ids(payload)
            return JSONResponse(payload)
        return Response(upstream.content, 200, media_type="application/json")

    async def _stream(self, call: _Call, pool: str) -> Response:
        exchange = self._exchange(call, pool)
        client = self.clients[pool]
        request = client.build_request("POST", call.route, json=self._upstream_body(call), headers=call.headers)
        upstream = await self._attempt(exchange, client.send(request, stream=True))
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code >= 500:
                self._failed(exchange, "error", f"HTTP {upstream.status_code}")
                raise _Failed("error", f"HTTP {upstream.status_code}")
            self.metrics.count("responses", (pool, f"{upstream.status_code // 100}xx"))
            self._settle(call, None)
            return Response(content, upstream.status_code, media_type="application/json")
        events = _sse_events(upstream.aiter_lines())
        try:
            first = await self._attempt(exchange, events.__anext__())
        except StopAsyncIteration:
            await upstream.aclose()
            self._failed(exchange, "error", "the stream ended before its first event")
            raise _Failed("error", "empty stream") from None
        except _Failed:
            await upstream.aclose()
            raise
        self.metrics.count("responses", (pool, "2xx"))
        return StreamingResponse(self._relay(call, exchange, upstream, first, events),
                                 media_type="text/event-stream")

    async def _relay(self, call: _Call, exchange: Exchange, upstream: httpx.Response, first: str,
                     events: AsyncIterator[str]) -> AsyncIterator[bytes]:
        """The pool's events to the client as each arrives; timings, metrics and tokens noted on the way."""
        text: list[str] = []
        token_ids: list[int] = []
        openai_finish = None
        failure = None
        try:
            event = first
            while True:
                data = event[6:] if event.startswith("data: ") else None
                out = event
                if data is not None and data != "[DONE]":
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        chunk = None
                    if isinstance(chunk, dict):
                        choices = chunk.get("choices")
                        if choices:
                            if exchange.first_token is None:
                                exchange.first_token = time.time()
                            choice = choices[0]
                            piece = _choice_text(choice)
                            if piece:
                                text.append(piece)
                            token_ids.extend(choice.get("token_ids") or ())
                            openai_finish = choice.get("finish_reason") or openai_finish
                            if call.mirror is not None and not call.client_token_ids:
                                _strip_token_ids(chunk)
                                out = "data: " + json.dumps(chunk, separators=(",", ":"))
                        elif "usage" in chunk:
                            exchange.output_tokens = int((chunk.get("usage") or {}).get("completion_tokens") or 0)
                            exchange.speculative_metrics = (chunk.get("metrics") or {}).get("speculative_decoding")
                            if not call.client_usage:
                                out = None  # the usage chunk the gateway asked for, not the client
                        elif "error" in chunk:
                            failure = "error"
                            exchange.error = "the pool reported an error in the stream"
                if out is not None:
                    yield (out + "\n\n").encode()
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
        except httpx.TimeoutException as error:
            failure, exchange.error = "timeout", type(error).__name__
            yield _error_event("timeout", "the pool stopped sending within the read timeout")
        except httpx.HTTPError as error:
            failure, exchange.error = "error", type(error).__name__
            yield _error_event("error", "the pool's stream broke")
        finally:
            # a client that went away leaves no finish reason: the request counts as aborted
            await upstream.aclose()
            exchange.finished = time.time()
            exchange.finish = failure or finish_reason(openai_finish)
            exchange.output_sha256 = digest_text("".join(text))
            exchange.token_ids = token_ids or None
            if not exchange.output_tokens:
                exchange.output_tokens = len(token_ids)
            if failure is not None:
                self.metrics.count("upstream_failures", (exchange.pool, failure))
            self._record(exchange)
            self._settle(call, exchange.token_ids if failure is None and openai_finish else None)

    async def _attempt(self, exchange: Exchange, pending):
        """Await a call to a pool; a failure is recorded on ``exchange`` and raised as `_Failed`."""
        try:
            return await pending
        except httpx.TimeoutException as error:
            self._failed(exchange, "timeout", error)
            raise _Failed("timeout", type(error).__name__) from None
        except httpx.HTTPError as error:
            self._failed(exchange, "error", error)
            raise _Failed("error", type(error).__name__) from None

    def _failed(self, exchange: Exchange, kind: str, error: Any) -> None:
        """Record an attempt that failed before the client got anything (no prompt or body in the text)."""
        exchange.finished = time.time()
        exchange.finish = kind
        exchange.error = error if isinstance(error, str) else type(error).__name__
        self._record(exchange)

    def _settle(self, call: _Call, token_ids: list[int] | None) -> None:
        if call.mirror is not None and not call.mirror.done():
            call.mirror.set_result(token_ids)

    async def _shadow(self, call: _Call, cohort: str) -> None:
        """Mirror a copy to the speculative pool, discard its answer, compare it with the standard one."""
        body = dict(call.body, stream=False, return_token_ids=True)
        body.pop("stream_options", None)
        exchange = Exchange(request_id=call.request_id, bucket=call.bucket, cohort=cohort, pool=SPECULATIVE,
                            started=time.time(), prompt_sha256=call.prompt_sha256, sampling=call.sampling)
        mirrored: list[int] | None = None
        try:
            response = await self.clients[SPECULATIVE].post(call.route, json=body, headers=call.headers)
            exchange.finished = time.time()
            if response.status_code >= 500:
                exchange.finish, exchange.error = "error", f"HTTP {response.status_code}"
            elif response.status_code == 200:
                _note_answer(exchange, response.json())
                mirrored = exchange.token_ids
            else:
                self.metrics.count("shadow_checks", ("not_compared",))
                return
        except httpx.TimeoutException as error:
            exchange.finished, exchange.finish, exchange.error = time.time(), "timeout", type(error).__name__
        except (httpx.HTTPError, ValueError) as error:
            exchange.finished, exchange.finish, exchange.error = time.time(), "error", type(error).__name__
        self._record(exchange)
        standard = await call.mirror
        if mirrored is None or standard is None or self.bundle_id is None:
            self.metrics.count("shadow_checks", ("not_compared",))
            return
        match = list(mirrored) == list(standard)
        self.metrics.count("shadow_checks", ("match" if match else "mismatch",))
        self._emit(shadow_record(self.bundle_id, call.request_id, call.bucket, match, time.time()))


def _routed(response: Response, pool: str, reason: str) -> Response:
    response.headers["x-specwatch-pool"] = pool
    response.headers["x-specwatch-route"] = reason
    return response


def _note_answer(exchange: Exchange, payload: Mapping[str, Any]) -> None:
    """What a whole (non-streamed) answer tells about its attempt."""
    choice = (payload.get("choices") or [{}])[0]
    exchange.output_tokens = int((payload.get("usage") or {}).get("completion_tokens") or 0)
    exchange.finish = finish_reason(choice.get("finish_reason"))
    exchange.output_sha256 = digest_text(_choice_text(choice))
    exchange.speculative_metrics = (payload.get("metrics") or {}).get("speculative_decoding")
    exchange.token_ids = choice.get("token_ids")


def _choice_text(choice: Mapping[str, Any]) -> str:
    """The text of a completion choice, a chat message or a streamed delta."""
    if "text" in choice:
        return choice.get("text") or ""
    message = choice.get("message") or choice.get("delta") or {}
    content = message.get("content") if isinstance(message, Mapping) else None
    return content if isinstance(content, str) else ""


def _strip_token_ids(payload: dict) -> None:
    """Remove the token ids the gateway asked for (a mirrored request's) from what the client gets."""
    for name in _TOKEN_ID_FIELDS:
        payload.pop(name, None)
    for choice in payload.get("choices") or ():
        if isinstance(choice, dict):
            for name in _TOKEN_ID_FIELDS:
                choice.pop(name, None)


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events, each as soon as its blank line arrives (a multi-line event joined by newlines)."""
    event: list[str] = []
    async for line in lines:
        if line:
            event.append(line)
        elif event:
            yield "\n".join(event)
            event = []
    if event:
        yield "\n".join(event)


def _error_event(kind: str, message: str) -> bytes:
    body = {"error": {"message": message, "type": kind, "code": 504 if kind == "timeout" else 502}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "gateway_error", "code": status}}, status)


def _forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in _HOP_HEADERS}


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it passes ``limit`` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(gateway: Gateway) -> Starlette:
    """The ASGI app: the two completion routes, ``/v1/models`` (the standard pool's), health, metrics."""

    async def completions(request: Request) -> Response:
        return await gateway.handle(request)

    async def models(request: Request) -> Response:
        try:
            upstream = await gateway.clients[STANDARD].get("/v1/models")
        except httpx.HTTPError as error:
            return _error(502, f"the standard pool did not answer: {type(error).__name__}")
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        # The standard pool is what every request can fall back to: without it the gateway is not healthy.
        try:
            up = (await gateway.clients[STANDARD].get("/health")).status_code == 200
        except httpx.HTTPError:
            up = False
        body = {"standard": up, "speculative": gateway.speculative_up, "bundle_id": gateway.bundle_id}
        return JSONResponse(body, 200 if up else 503)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [HttpRoute(path, completions, methods=["POST"]) for path in _ROUTES]
    routes += [HttpRoute("/v1/models", models, methods=["GET"]), HttpRoute("/health", health, methods=["GET"]),
               HttpRoute("/metrics", metrics, methods=["GET"])]

    async def lifespan(app):
        await gateway.start()
        yield
        await gateway.close()

    from contextlib import asynccontextmanager

    return Starlette(routes=routes, lifespan=asynccontextmanager(lifespan))
