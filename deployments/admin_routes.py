"""The fleet admin API (``/v1/adapters``), behind the bearer-token dependency."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from .admin_auth import AdminAuth
from .config import AdapterSpec


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: Optional[int] = Field(default=None, ge=1)


def admin_router(ingress) -> APIRouter:
    router = APIRouter(prefix="/v1/adapters", dependencies=[Depends(AdminAuth(ingress.args.admin_token_env))])
    admin = ingress.admin

    @router.get("")
    async def list_adapters():
        return await admin.describe()

    @router.post("", status_code=201)
    async def register(spec: AdapterSpec):
        return await admin.register(spec)

    @router.delete("/{name}")
    async def unregister(name: str):
        return await admin.unregister(name)

    @router.post("/{name}/pin")
    async def pin(name: str, body: Optional[PinBody] = None):
        return await admin.pin(name, body.replicas if body else None)

    @router.post("/{name}/unpin")
    async def unpin(name: str):
        return await admin.unpin(name)

    return router
