"""Admin routes for versions, traffic splits and quotas (``/v1/adapters/{name}/...``), behind the token."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Body, Depends
from pydantic import BaseModel, ConfigDict, Field

from .admin_auth import AdminAuth


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str
    source: str
    revision: Optional[str] = None


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_concurrency: Optional[int] = Field(default=None, ge=1)
    requests_per_s: Optional[float] = Field(default=None, gt=0)


def version_router(ingress) -> APIRouter:
    router = APIRouter(prefix="/v1/adapters", dependencies=[Depends(AdminAuth(ingress.args.admin_token_env))])
    admin = ingress.admin

    @router.post("/{name}/versions", status_code=201)
    async def add_version(name: str, body: VersionBody):
        """A new version with 0% traffic, validated on a worker like any registration."""
        return await admin.add_version(name, body.version, body.source, body.revision)

    @router.put("/{name}/traffic")
    async def set_traffic(name: str, split: dict[str, int] = Body(...)):
        """``{"v1": 90, "v2": 10}``: pre-warms versions about to get traffic, retires those left at 0%."""
        return await admin.set_traffic(name, split)

    @router.put("/{name}/quota")
    async def set_quota(name: str, body: QuotaBody):
        """``{"max_concurrency": 4, "requests_per_s": 20}``; a field left out or null means no limit."""
        return await admin.set_quota(name, body.max_concurrency, body.requests_per_s)

    return router
