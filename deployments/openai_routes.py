"""OpenAI-compatible routes: completions, chat completions, models, health."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from .model_guard import ParsedOnceRoute
from .openai_protocol import ChatCompletionRequest, CompletionRequest, completion_body, new_id, to_generate_request
from .sse import CompletionStream
from .traffic_split import families


def base_model_names(args) -> frozenset:
    """The ``model`` values that mean the base model, no adapter (the model guard passes them on too)."""
    return frozenset({args.model_name, args.base_model, "", "base"})


def openai_router(ingress) -> APIRouter:
    """Routes bound to one ``LoRAFleetIngress`` replica (its registry, limiter and worker handles)."""
    router = APIRouter(route_class=ParsedOnceRoute)   # the model guard's parse of the body is the one FastAPI uses
    args = ingress.args

    base_names = base_model_names(args)
    context: dict = {}  # the engine's context window, asked of a worker once

    def adapter_for_model(model: str):
        return None if model in base_names else model

    async def respond(body, chat: bool):
        request = to_generate_request(body, adapter_for_model(body.model))
        model = args.model_name if request.adapter is None else body.model
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:  # errors before the first token become statuses (front_door.py)
            opened = await ingress.front.open_stream(request)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return CompletionStream(opened.upstream, opened.first, model, rid, chat, include_usage,
                                    args.stream_idle_timeout_s, opened.admission.release,
                                    headers=opened.admission.headers(), on_finish=opened.admission.finish)
        result, admission = await ingress.front.generate(request)
        return JSONResponse(completion_body(result, model, rid, chat, body),
                            headers={"x-lorafleet-replica": result.replica_id or "", **admission.headers()})

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
