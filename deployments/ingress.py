"""HTTP ingress: OpenAI-compatible completions and chat, models, health, and the fleet admin API.

It is also the Python entry point for other Ray apps: ``serve.get_app_handle(app)``
returns this deployment's handle, whose ``generate`` / ``generate_stream`` /
``register_adapter`` / ... methods take the same typed objects the HTTP routes build.
"""


import asyncio
import hmac
import json
import logging
import os
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from engine.errors import AdapterExistsError, InvalidRequestError
from engine.request import GenerateRequest, GenerateResult
from pool.errors import AdapterNotFoundError, LoRAFleetError, PinRefusedError
from routing.hashing import rendezvous_order

from .config import AppArgs, validate_adapter_name
from .openai_protocol import (
    STREAM_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameter,
    completion_body,
    error_body,
    new_id,
    stream_chunk,
    to_generate_request,
)
from .registry import RegistryEntry, RegistryFollower, mint_uid

log = logging.getLogger("ray.serve")
api = FastAPI(title="lorafleet", description="Multi-LoRA serving on Ray Serve (OpenAI-compatible)")


class AdminRegisterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    source: str
    revision: Optional[str] = None
    pinned: bool = False
    replicas: Optional[int] = Field(default=None, ge=1)


class AdminPinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: Optional[int] = Field(default=None, ge=1)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after


def unwrap(exc: BaseException) -> BaseException:
    """The user-level exception inside Ray's task-error wrapper."""
    from ray.exceptions import RayTaskError

    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def error_response(exc: BaseException) -> JSONResponse:
    from ray.serve.exceptions import BackPressureError

    exc = unwrap(exc)
    headers = {}
    if isinstance(exc, HTTPError):
        status, message, param, code = exc.status, str(exc), exc.param, exc.code
        if exc.retry_after:
            headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, InvalidRequestError):
        status, message, param, code = 400, str(exc), exc.field, None
    elif isinstance(exc, AdapterNotFoundError):
        status, message, param, code = 404, str(exc), "model", "model_not_found"
    elif isinstance(exc, LoRAFleetError):
        status, message, param, code = exc.http_status, str(exc), None, type(exc).__name__
        if status == 503:
            headers["Retry-After"] = "1"
    elif isinstance(exc, UnsupportedParameter):
        status, message, param, code = 400, str(exc), exc.param, "unsupported_parameter"
    elif isinstance(exc, (ValidationError, ValueError)):
        status, message, param, code = 400, str(exc), None, None
    elif isinstance(exc, BackPressureError):
        status, message, param, code = 429, "the fleet's queues are full; retry later", None, "overloaded"
        headers["Retry-After"] = "1"
    else:
        log.exception("lorafleet ingress: unexpected error", exc_info=exc)
        status, message, param, code = 500, f"internal error: {type(exc).__name__}", None, None
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    return JSONResponse(error_body(400, f"invalid field {field}: {first.get('msg', 'invalid request')}", field),
                        status_code=400)


@api.middleware("http")
async def _limit_body(request: Request, call_next):
    limit = getattr(request.app.state, "max_body_bytes", None)
    length = request.headers.get("content-length")
    if limit and length and length.isdigit() and int(length) > limit:
        return JSONResponse(error_body(413, f"request body of {length} bytes exceeds the limit of {limit} bytes"),
                            status_code=413)
    return await call_next(request)


@serve.deployment(name="LoRAFleetIngress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class LoRAFleetIngress:
    async def __init__(self, args: dict, worker, directory):
        self.args = AppArgs(**args)
        self.worker = worker.options(stream=False)
        self.worker_stream = worker.options(stream=True)
        self.directory = directory
        self.model_name = self.args.base_model
        api.state.max_body_bytes = self.args.max_body_bytes
        self.inflight = 0
        self.registry = RegistryFollower(directory)
        await self.registry.refresh()
        for spec in self.args.startup_adapters():
            if spec.name not in self.registry.entries:
                await self.register_adapter(spec.name, spec.source, spec.revision, spec.pinned, spec.replicas)
        self._follow = asyncio.get_running_loop().create_task(self.registry.run())

    # ------------------------------------------------------------------ Python handle API

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self._check_adapter(request.adapter)
        return await self._with_limits(self.worker.generate.remote(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator:
        """Token deltas, then the final ``GenerateResult``."""
        await self._check_adapter(request.adapter)
        async for item in self.worker_stream.generate_stream.remote(request):
            yield item

    async def register_adapter(self, name: str, source: str, revision: Optional[str] = None, pinned: bool = False,
                               replicas: Optional[int] = None) -> dict:
        """Validate on a worker (the real shapes and limits), then publish fleet-wide."""
        try:
            validate_adapter_name(name)
        except ValueError as exc:
            raise InvalidRequestError("name", str(exc)) from None
        current = self.registry.entries.get(name)
        if current is not None:
            if (current.source, current.revision) == (source, revision):
                return current.to_dict()
            raise AdapterExistsError(f"adapter {name!r} is already registered from {current.source!r}; "
                                     f"unregister it first")
        replicas = replicas or self.args.pin_replicas
        if pinned:
            self._check_pin_capacity(name, replicas)
        uid = mint_uid(name)
        facts = await self.worker.validate_adapter.remote(name, source, revision, uid)
        entry = RegistryEntry(name=name, uid=uid, source=source, revision=revision, pinned=pinned,
                              replicas=replicas, rank=facts["rank"])
        stored = await self.directory.put_adapter.remote(entry.to_dict())
        await self.registry.refresh()
        if stored["uid"] != uid:
            raise AdapterExistsError(f"adapter {name!r} was registered concurrently from {stored['source']!r}")
        return stored

    async def unregister_adapter(self, name: str) -> dict:
        removed = await self.directory.remove_adapter.remote(name)
        self.registry.entries.pop(name, None)  # refuse new requests here at once
        return {"name": name, "uid": removed["uid"], "status": "unregistered"}

    async def pin_adapter(self, name: str, replicas: Optional[int] = None) -> dict:
        entry = self._entry(name)
        replicas = replicas or entry.replicas
        self._check_pin_capacity(name, replicas)
        result = await self.directory.set_pinned.remote(name, True, replicas)
        await self.registry.refresh()
        return result

    async def unpin_adapter(self, name: str) -> dict:
        self._entry(name)
        result = await self.directory.set_pinned.remote(name, False)
        await self.registry.refresh()
        return result

    async def list_adapters(self) -> dict:
        await self.registry.refresh()
        view = await self.directory.view.remote()
        counts = await self.directory.adapter_counts.remote()
        replicas = view["replicas"]
        data = []
        for entry in self.registry.entries.values():
            resident = sorted(r for r, s in replicas.items() if entry.uid in s["resident"])
            pinned_on = sorted(r for r, s in replicas.items() if entry.uid in s["pinned"])
            c = counts.get(entry.uid, {})
            data.append({**entry.to_dict(), "object": "adapter", "resident_on": resident, "pinned_on": pinned_on,
                         "loads": c.get("load", 0), "evictions": c.get("evict", 0)})
        data.sort(key=lambda d: d["name"])
        summary = {r: {k: s[k] for k in ("slots", "free_slots", "resident", "pinned", "queue_len", "seq")}
                   for r, s in replicas.items()}
        return {"object": "list", "data": data, "replicas": summary}

    # ------------------------------------------------------------------ helpers

    def _entry(self, name: str) -> RegistryEntry:
        entry = self.registry.entries.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return entry

    async def _check_adapter(self, name: Optional[str]) -> None:
        if name is not None and name not in self.registry.entries:
            await self.registry.refresh()
            self._entry(name)

    def _check_pin_capacity(self, name: str, replicas: int) -> None:
        """Refuse a pin that would leave some replica with no unpinned slot (each pool's guard)."""
        live = self.registry.replicas
        if not live:
            return
        limit = self.args.max_loras_per_batch - 1
        count = {r: 0 for r in live}
        for other in self.registry.entries.values():
            if other.pinned and other.name != name:
                for r in rendezvous_order(other.name, live)[: other.replicas]:
                    count[r] += 1
        for r in rendezvous_order(name, live)[:replicas]:
            if count[r] + 1 > limit:
                raise PinRefusedError(
                    f"cannot pin {name!r}: replica {r} already pins {count[r]} of its {self.args.max_loras_per_batch} "
                    f"slots and at least one slot must stay unpinned")

    def _admit(self) -> None:
        """The ingress's own queue bound (the workers' is Serve's max_queued_requests)."""
        if self.inflight >= self.args.max_queued_requests:
            raise HTTPError(429, f"{self.inflight} requests in flight at this ingress; retry later",
                            code="overloaded", retry_after=1)

    async def _with_limits(self, response):
        try:
            self._admit()
        except HTTPError:
            response.cancel()
            raise
        self.inflight += 1
        try:
            return await asyncio.wait_for(response, self.args.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise HTTPError(504, f"request exceeded the {self.args.request_timeout_s:.0f}s timeout",
                            code="timeout") from None
        finally:
            self.inflight -= 1

    def _adapter_for_model(self, model: str) -> Optional[str]:
        return None if model in (self.model_name, "", "base") else model

    def _admin(self, request: Request) -> None:
        token = os.environ.get(self.args.admin_token_env)
        if not token:
            raise HTTPError(403, f"the admin API is off: set {self.args.admin_token_env} on the cluster to enable it",
                            code="admin_disabled")
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), token.encode()):
            raise HTTPError(401, "missing or wrong bearer token", code="unauthorized")

    # ------------------------------------------------------------------ OpenAI routes

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._openai(body, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._openai(body, chat=True)

    async def _openai(self, body, chat: bool):
        try:
            request = to_generate_request(body, self._adapter_for_model(body.model), self.args.max_tokens_limit)
            prompt_chars = len(request.prompt or "") + sum(len(m["content"]) for m in request.messages or [])
            if prompt_chars > self.args.max_prompt_chars:
                raise InvalidRequestError("prompt", f"prompt of {prompt_chars} characters exceeds the limit of "
                                                    f"{self.args.max_prompt_chars}")
            await self._check_adapter(request.adapter)
            rid = new_id("chatcmpl" if chat else "cmpl")
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream(request, body.model, rid, chat, include_usage)
            result = await self._with_limits(self.worker.generate.remote(request))
            return JSONResponse(completion_body(result, body.model, rid, chat),
                                headers={"x-lorafleet-replica": result.replica_id or ""})
        except Exception as exc:
            return error_response(exc)

    async def _stream(self, request: GenerateRequest, model: str, rid: str, chat: bool, include_usage: bool):
        self._admit()
        self.inflight += 1
        try:
            gen = self.worker_stream.generate_stream.remote(request)
            iterator = gen.__aiter__()
            first = await asyncio.wait_for(iterator.__anext__(), self.args.request_timeout_s)  # errors -> statuses
        except BaseException:
            self.inflight -= 1
            raise

        async def events():
            try:
                if chat:
                    yield stream_chunk(None, model, rid, chat, first=True)
                item = first
                while True:
                    if isinstance(item, GenerateResult):
                        if include_usage:
                            yield stream_chunk(None, model, rid, chat, usage=item.usage)
                        break
                    yield stream_chunk(item, model, rid, chat)
                    try:
                        item = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                yield STREAM_DONE
            finally:
                self.inflight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.get("/v1/models")
    async def models(self):
        await self.registry.refresh()
        created = 0
        data = [{"id": self.model_name, "object": "model", "created": created, "owned_by": "lorafleet", "root":
                 self.model_name, "parent": None}]
        for entry in sorted(self.registry.entries.values(), key=lambda e: e.name):
            data.append({"id": entry.name, "object": "model", "created": int(entry.created), "owned_by": "lorafleet",
                         "root": entry.source, "parent": self.model_name})
        return {"object": "list", "data": data}

    @api.get("/health")
    async def health(self):
        return {"status": "ok", "replicas": len(self.registry.replicas)}

    # ------------------------------------------------------------------ admin routes

    async def _admin_call(self, request: Request, action, status: int = 200):
        """Check the bearer token, run ``action()``, and turn any error into OpenAI's error body."""
        try:
            self._admin(request)
            return JSONResponse(await action(), status_code=status)
        except Exception as exc:
            return error_response(exc)

    @staticmethod
    async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
        raw = await request.body()
        try:
            return model(**(json.loads(raw) if raw else {}))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise HTTPError(400, f"invalid field {field}: {first['msg']}", param=field) from None
        except (json.JSONDecodeError, TypeError):
            raise HTTPError(400, "the request body must be a JSON object") from None

    @api.get("/v1/adapters")
    async def admin_list(self, request: Request):
        return await self._admin_call(request, self.list_adapters)

    @api.post("/v1/adapters")
    async def admin_register(self, request: Request):
        async def register():
            body = await self._body(request, AdminRegisterBody)
            return await self.register_adapter(body.name, body.source, body.revision, body.pinned, body.replicas)

        return await self._admin_call(request, register, status=201)

    @api.delete("/v1/adapters/{name}")
    async def admin_unregister(self, name: str, request: Request):
        return await self._admin_call(request, lambda: self.unregister_adapter(name))

    @api.post("/v1/adapters/{name}/pin")
    async def admin_pin(self, name: str, request: Request):
        async def pin():
            return await self.pin_adapter(name, (await self._body(request, AdminPinBody)).replicas)

        return await self._admin_call(request, pin)

    @api.post("/v1/adapters/{name}/unpin")
    async def admin_unpin(self, name: str, request: Request):
        return await self._admin_call(request, lambda: self.unpin_adapter(name))
