"""The ingress's FastAPI app, built per replica from its args (no module-level state)."""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve

from .admin_routes import admin_router
from .body_limit import BodyLimitMiddleware
from .config import NAME_RE
from .edge_hints import refusal_hint
from .http_errors import install_error_handlers
from .model_guard import ModelGuard
from .openai_routes import base_model_names, openai_router
from .version_routes import version_router


def build_http_app(ingress) -> FastAPI:
    app = FastAPI(title="lorafleet", description="Multi-LoRA serving on Ray Serve (OpenAI-compatible)")
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=ingress.args.max_body_bytes)
    base_names = base_model_names(ingress.args)
    # added last, so outermost: a known-bogus model is refused before routing, parsing or the body limit
    app_name = serve.get_replica_context().app_name
    app.add_middleware(ModelGuard, refusal=lambda model: None if model in base_names else
                       ingress.gate.refusal_now(model),
                       hint=lambda model, status, waited_s: refusal_hint(ingress.gate, NAME_RE, app_name, base_names,
                                                                         model, status, waited_s),
                       wait=lambda model: 0.0 if model in base_names else ingress.gate.rate_refusal_ends_in_s(model))
    install_error_handlers(app)
    app.include_router(openai_router(ingress))
    app.include_router(admin_router(ingress))
    app.include_router(version_router(ingress))
    return app
