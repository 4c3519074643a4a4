"""The router: one OpenAI-compatible endpoint in front of prefill + decode instances, or of colocated replicas.

Prefill/decode disaggregation (--prefill URL... --decode URL...): each /v1/completions or /v1/chat/completions
request goes first to a prefill instance (`serve --kv-role producer`) as the same request with max_tokens=1, not
streamed, and kv_transfer_params {"do_remote_decode": true}; the producer computes the prompt, keeps its KV blocks
on a lease and answers where they are (its kv_transfer_params). The request then goes, as the client sent it plus
those kv_transfer_params, to a decode instance (`serve --kv-role consumer`), which loads the blocks and decodes;
its answer (streamed or not) goes back to the client unchanged. Where the prefill fails (the instance is down,
times out, answers 5xx) the decode instance gets kv_transfer_params with the reason and follows its
kv_load_failure_policy: it recomputes the prompt, or refuses with a 503 that names the cause. A 4xx from the
prefill (the client's mistake) goes back as it is. Requests the decode side must compute whole anyway (several
prompts in one request, echo / prompt logprobs) skip the prefill.

Data parallel (--replica URL...): each request goes whole to one replica, by prefix-cache affinity and the
requests in flight (policy.py).

Every failure reaches the client as an OpenAI-style error body, never a hang: upstream connections time out
(--connect-timeout, --timeout) and an unreachable instance is a 502 naming it (a decode or replica instance that
refuses the connection is retried once on another).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from infertune.kv_transfer.base import layout_mismatch
from infertune.router.metrics_merge import MergedFamilies
from infertune.router.policy import Instance, Picker, prompt_key

log = logging.getLogger("infertune.router")


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}}, status)


class Router:
    def __init__(
        self,
        prefill: list[str] = (),
        decode: list[str] = (),
        replicas: list[str] = (),
        policy: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        prefix_chars: int = 256,
    ) -> None:
        if replicas and (prefill or decode):
            raise ValueError("give either --prefill and --decode (P/D) or --replica (data parallel), not both")
        if not replicas and not decode:
            raise ValueError("give --decode URL... (with --prefill URL...) or --replica URL...")
        if decode and not prefill:
            raise ValueError("--decode needs --prefill URL... (or use --replica for colocated instances)")
        self.pd = bool(decode)
        strip = lambda urls: [u.rstrip("/") for u in urls]  # noqa: E731
        self.prefill = (
            Picker([Instance(u, "prefill") for u in strip(prefill)], policy or "affinity") if prefill else None
        )
        serving = strip(decode) if decode else strip(replicas)
        role = "decode" if decode else "replica"
        # (unless told otherwise, every role by prefix-cache affinity: a prefill instance that computed a prompt's
        # prefix before computes only the rest; a decode instance that holds it loads only the rest)
        self.serving = Picker([Instance(u, role) for u in serving], policy or "affinity")
        self.prefix_chars = prefix_chars
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.client: httpx.AsyncClient | None = None
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "infertune_router_requests", "Requests routed, by route and mode", ["route", "mode"], registry=r
        )
        self.m_upstream_errors = Counter(
            "infertune_router_upstream_errors",
            "Failed upstream calls, by instance role and kind",
            ["role", "kind"],
            registry=r,
        )
        self.m_prefill_fallbacks = Counter(
            "infertune_router_prefill_fallbacks",
            "Requests sent to a decode instance without a prefill (it failed); the decode side's policy decides",
            registry=r,
        )
        self.m_inflight = Gauge(
            "infertune_router_inflight", "Requests in flight, by instance", ["role", "url"], registry=r
        )
        self.m_affinity = Gauge(
            "infertune_router_affinity_hits",
            "Requests routed to the instance that last served their prompt's prefix, by role",
            ["role"],
            registry=r,
        )
        # (the instances' own metrics, re-labelled by instance: a registry apart, so their names never meet ours)
        self.instance_metrics = MergedFamilies()
        self.instance_registry = CollectorRegistry(auto_describe=False)
        self.instance_registry.register(self.instance_metrics)

    def instances(self) -> list[Instance]:
        return [*(self.prefill.instances if self.prefill else []), *self.serving.instances]

    def check_instances(self, timeout_s: float = 5.0) -> list[str]:
        """Before serving: ask every instance what it is (GET /kv_transfer). A prefill instance that is not a KV
        producer, a decode instance that is not a consumer, a replica that is either, or P and D instances with
        different connectors or KV layouts: a ValueError naming each mismatch and its instance. Returns the instances
        that could not be asked (not running yet, or not infertune): those are checked by their first transfer."""
        want = {"prefill": "producer", "decode": "consumer", "replica": None}
        flag = {"producer": "--kv-role producer", "consumer": "--kv-role consumer", None: "no --kv-role"}
        seen: dict[str, dict] = {}
        unchecked, bad = [], []
        for inst in self.instances():
            try:
                r = httpx.get(inst.url + "/kv_transfer", timeout=timeout_s)
                info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                info = None
            if not isinstance(info, dict) or "kv_role" not in info:
                unchecked.append(inst.url)
                continue
            seen[inst.url] = info
            if info["kv_role"] != want[inst.role]:
                bad.append(
                    f"{inst.role} instance {inst.url} runs with {flag.get(info['kv_role'], info['kv_role'])}, "
                    f"not {flag[want[inst.role]]}"
                )
        producers = [(u, i) for u, i in seen.items() if i["kv_role"] == "producer"]
        consumers = [(u, i) for u, i in seen.items() if i["kv_role"] == "consumer"]
        for url, info in consumers:  # (every pair: any prefill instance may hand any decode instance its blocks)
            for p_url, p_info in producers:
                if info.get("kv_connector") != p_info.get("kv_connector"):
                    bad.append(
                        f"kv_connector: the decode instance {url} has {info.get('kv_connector')!r}, the prefill "
                        f"instance {p_url} {p_info.get('kv_connector')!r}"
                    )
                    continue
                mine, theirs = info.get("layout") or {}, p_info.get("layout") or {}
                for line in layout_mismatch(mine, theirs, "consumer", "producer"):
                    bad.append(f"the decode instance {url} against the prefill instance {p_url}: {line}")
        if bad:
            raise ValueError("the router's instances do not fit together:\n  " + "\n  ".join(bad))
        return unchecked

    # ---- app -------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            # (idle connections are dropped well before uvicorn's 5 s keep-alive ends on the other side: a request
            # sent on a connection the server is closing fails with a ReadError, and a POST is not retried)
            limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=1.0)
            self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
            yield
            await self.client.aclose()

        app = FastAPI(title="infertune router", lifespan=lifespan)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        return app

    async def completions(self, request: Request):
        return await self.route(request, "/v1/completions")

    async def chat_completions(self, request: Request):
        return await self.route(request, "/v1/chat/completions")

    async def models(self, request: Request):
        for inst in self.serving.instances:
            try:
                r = await self.client.get(inst.url + "/v1/models", headers=_forwarded(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return _error(502, "no decode / replica instance answered /v1/models", "bad_gateway", "upstream_unavailable")

    async def health(self):
        async def check(inst: Instance) -> bool:
            try:
                return (await self.client.get(inst.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False

        every = self.instances()
        ok = await asyncio.gather(*(check(i) for i in every))
        status = {i.url: {"role": i.role, "healthy": h, "inflight": i.inflight} for i, h in zip(every, ok)}
        serving = any(h for i, h in zip(every, ok) if i.role != "prefill")
        body = {"status": "ok" if serving else "unavailable", "instances": status}
        return JSONResponse(body, 200 if serving else 503)

    async def metrics(self):
        for inst in self.instances():
            self.m_inflight.labels(inst.role, inst.url).set(inst.inflight)
        for picker in (self.prefill, self.serving):
            if picker is not None:
                self.m_affinity.labels(picker.instances[0].role).set(picker.affinity_hits)

        async def scrape(inst: Instance) -> str | None:
            try:
                r = await self.client.get(inst.url + "/metrics", timeout=2.0)
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 else None

        # every instance's metrics too, each sample labelled engine="<index>" (as vLLM's data-parallel engines are)
        # and role: what `vllm serve --data-parallel-size N`'s port serves, so its dashboards read this one
        every = self.instances()
        texts = await asyncio.gather(*(scrape(i) for i in every))
        try:
            self.instance_metrics.set_from(
                [({"engine": str(n), "role": i.role}, t) for n, (i, t) in enumerate(zip(every, texts)) if t]
            )
        except ValueError as e:  # (an instance that is not infertune answering /metrics with something else)
            log.warning("an instance's /metrics could not be parsed: %s", e)
            self.instance_metrics.set_from([])
        body = generate_latest(self.registry) + generate_latest(self.instance_registry)
        return Response(body, media_type="text/plain; version=0.0.4")

    # ---- one request -----------------------------------------------------------------------------
    async def route(self, request: Request, path: str):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        headers = _forwarded(request)
        key = prompt_key(body, self.prefix_chars)
        if self.pd and _disaggregable(body):
            self.m_requests.labels(path, "pd").inc()
            transfer = await self.prefill_step(path, body, headers, key)
            if isinstance(transfer, Response):
                return transfer  # the prefill's 4xx: the client's mistake, said once
            producer = transfer.pop("producer_url", None)
            body = {**body, "kv_transfer_params": transfer}
            answer = await self.forward(path, body, headers, key, bool(body.get("stream")))
            if answer.status_code >= 400 and producer and transfer.get("transfer_id"):
                # the decode side refused it (a parameter only it checks): nobody will load the prefill's blocks,
                # so the producer frees them now instead of holding them until the lease runs out
                await self._release(producer, transfer["transfer_id"])
            return answer
        self.m_requests.labels(path, "pd_direct" if self.pd else "replica").inc()
        return await self.forward(path, body, headers, key, bool(body.get("stream")))

    async def _release(self, producer: str, transfer_id: str) -> None:
        try:
            await self.client.post(producer + "/kv_transfer/release", json={"transfer_id": transfer_id}, timeout=5.0)
        except httpx.HTTPError as e:
            log.warning("could not end the lease of transfer %s at %s: %s", transfer_id, producer, _describe(e))

    async def prefill_step(
        self, path: str, body: dict, headers: dict, key: tuple[str, ...] | None = None
    ) -> dict | Response:
        """Run the prompt on a prefill instance; its kv_transfer_params (or the reason it failed, for the decode
        side's policy), or its 4xx response."""
        inst = self.prefill.pick(key)
        ask = copy.deepcopy(body)
        for k in ("stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs", "n", "best_of"):
            ask.pop(k, None)
        ask.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        inst.inflight += 1
        try:
            r = await self.client.post(inst.url + path, json=ask, headers=headers)
        except httpx.HTTPError as e:
            return self._prefill_failed(inst, "unreachable", f"prefill instance {inst.url} failed: {_describe(e)}")
        finally:
            inst.inflight -= 1
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code != 200:
            return self._prefill_failed(
                inst, f"http_{r.status_code}", f"prefill instance {inst.url} answered {r.status_code}: {r.text[:300]}"
            )
        inst.served += 1
        params = _json(r).get("kv_transfer_params")
        if not isinstance(params, dict):
            return self._prefill_failed(
                inst,
                "no_params",
                f"prefill instance {inst.url} returned no kv_transfer_params (is it `serve --kv-role producer`?)",
            )
        return {**params, "producer_url": inst.url}  # (where the router ends the lease if the decode side refuses)

    def _prefill_failed(self, inst: Instance, kind: str, reason: str) -> dict:
        inst.failures += 1
        self.m_upstream_errors.labels("prefill", kind).inc()
        self.m_prefill_fallbacks.inc()
        log.warning("%s; the decode instance decides (its kv_load_failure_policy)", reason)
        return {"do_remote_prefill": True, "error": reason}

    async def forward(self, path: str, body: dict, headers: dict, key: tuple[str, ...] | None, stream: bool):
        """Send the request to a decode instance (or replica) and return its answer unchanged."""
        tried: set[str] = set()
        while True:
            inst = self.serving.pick(key, exclude=tried)
            tried.add(inst.url)
            inst.inflight += 1
            req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
            try:
                r = await self.client.send(req, stream=True)
            except httpx.ConnectError as e:  # nothing was sent: another instance may take it
                inst.inflight -= 1
                inst.failures += 1
                self.m_upstream_errors.labels(inst.role, "unreachable").inc()
                if len(tried) < len(self.serving.instances):
                    continue
                return _error(
                    502,
                    f"{inst.role} instance {inst.url} is unreachable: {_describe(e)}",
                    "bad_gateway",
                    "upstream_unavailable",
                )
            except httpx.HTTPError as e:
                inst.inflight -= 1
                inst.failures += 1
                self.m_upstream_errors.labels(inst.role, "failed").inc()
                return _error(
                    502, f"{inst.role} instance {inst.url} failed: {_describe(e)}", "bad_gateway", "upstream_failed"
                )
            break
        if not stream or r.status_code != 200 or "text/event-stream" not in r.headers.get("content-type", ""):
            try:
                content = await r.aread()
            except httpx.HTTPError as e:
                self.m_upstream_errors.labels(inst.role, "failed").inc()
                return _error(
                    502,
                    f"{inst.role} instance {inst.url} failed mid-answer: {_describe(e)}",
                    "bad_gateway",
                    "upstream_failed",
                )
            finally:
                await r.aclose()
                inst.inflight -= 1
            inst.served += 1
            return Response(content, r.status_code, media_type=r.headers.get("content-type"))
        return StreamingResponse(self._relay(inst, r), media_type="text/event-stream")

    async def _relay(self, inst: Instance, r: httpx.Response):
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            inst.served += 1
        except httpx.HTTPError as e:
            self.m_upstream_errors.labels(inst.role, "failed").inc()
            err = {
                "error": {
                    "message": f"{inst.role} instance {inst.url} failed mid-stream: {_describe(e)}",
                    "type": "bad_gateway",
                    "param": None,
                    "code": "upstream_failed",
                }
            }
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await r.aclose()
            inst.inflight -= 1


def _disaggregable(body: dict) -> bool:
    """Whether a prefill instance can compute the prompt for the decode side: one prompt, nothing that needs every
    prompt row's logits on the decode side (echo: prompt logprobs)."""
    if body.get("echo") or body.get("prompt_logprobs") is not None or body.get("max_tokens") == 0:
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1)


def _forwarded(request: Request) -> dict:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def _json(r: httpx.Response) -> dict:
    try:
        value = r.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
