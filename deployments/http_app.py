"""The ingress's FastAPI app, built per replica from its args (no module-level state)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .admin_routes import admin_router
from .http_errors import install_error_handlers
from .openai_protocol import error_body
from .openai_routes import openai_router


def build_http_app(ingress) -> FastAPI:
    app = FastAPI(title="lorafleet", description="Multi-LoRA serving on Ray Serve (OpenAI-compatible)")
    limit = ingress.args.max_body_bytes

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            return JSONResponse(error_body(413, f"request body of {length} bytes exceeds the limit of {limit} bytes"),
                                status_code=413)
        return await call_next(request)

    install_error_handlers(app)
    app.include_router(openai_router(ingress))
    app.include_router(admin_router(ingress))
    return app
