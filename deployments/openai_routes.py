"""OpenAI-compatible routes: completions, chat completions, models, health."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from engine.errors import InvalidRequestError
from engine.request import GenerateRequest

from .openai_protocol import ChatCompletionRequest, CompletionRequest, completion_body, new_id, to_generate_request
from .sse import CompletionStream
from .traffic_split import families


def text_chars(request: GenerateRequest) -> int:
    """Every text field a request carries counts toward the prompt limit: prompt, messages, stops."""
    messages = sum(len(str(value)) for m in request.messages or [] for value in m.values())
    return len(request.prompt or "") + messages + sum(len(s) for s in request.stop_strings)


def openai_router(ingress) -> APIRouter:
    """Routes bound to one ``LoRAFleetIngress`` replica (its registry, limiter and worker handles)."""
    router = APIRouter()
    args = ingress.args

    base_names = {args.model_name, args.base_model, "", "base"}
    context: dict = {}  # the engine's context window, asked of a worker once

    def adapter_for_model(model: str):
        return None if model in base_names else model

    async def respond(body, chat: bool):
        request = to_generate_request(body, adapter_for_model(body.model))
        model = args.model_name if request.adapter is None else body.model
        prompt_chars = text_chars(request)
        if prompt_chars > args.max_prompt_chars:
            raise InvalidRequestError("prompt", f"prompt of {prompt_chars} characters exceeds the limit of "
                                                f"{args.max_prompt_chars}")
        admission = await ingress.gate.admit(request.adapter)  # 404/429 by adapter; picks the version
        request.adapter = admission.adapter
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(request, model, rid, chat, include_usage, admission)
        try:
            result = await ingress.limiter.call(lambda: ingress.worker.generate.remote(request))
        finally:
            admission.release()
        return JSONResponse(completion_body(result, model, rid, chat, body),
                            headers={"x-lorafleet-replica": result.replica_id or "", **admission.headers()})

    async def stream(request: GenerateRequest, model: str, rid: str, chat: bool, include_usage: bool, admission):
        limiter = ingress.limiter

        async def first_item(upstream):
            return upstream, await upstream.__anext__()

        def close() -> None:
            limiter.release()
            admission.release()

        try:
            limiter.acquire()
        except BaseException:
            admission.release()
            raise
        try:  # errors before the first token become statuses (and a lost replica is retried once)
            upstream, first = await limiter.first_result(
                lambda: ingress.worker_stream.generate_stream.remote(request), first_item)
        except BaseException:
            close()
            raise
        return CompletionStream(upstream, first, model, rid, chat, include_usage, args.stream_idle_timeout_s,
                                close, headers=admission.headers())

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(body, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await respond(body, chat=True)

    @router.get("/v1/models")
    async def models():  # the ingress's own copy of the registry (followed by long poll): no directory call
        if "max_model_len" not in context:
            context["max_model_len"] = (await ingress.worker.model_info.remote())["max_model_len"]
        data = [{"id": args.model_name, "object": "model", "created": 0, "owned_by": "lorafleet",
                 "root": args.base_model, "parent": None, "max_model_len": context["max_model_len"]}]
        for name, family in sorted(families(ingress.registry.entries.values()).items()):
            # one model per requested name (versions are the admin API's business, as are sources)
            data.append({"id": name, "object": "model", "created": int(family[0].created), "owned_by": "lorafleet",
                         "root": name, "parent": args.model_name, "max_model_len": context["max_model_len"]})
        return {"object": "list", "data": data}

    @router.get("/health")
    async def health():
        return {"status": "ok", "replicas": len(ingress.registry.replicas)}

    return router
