"""LoRAFleetIngress: the HTTP front door and the Python entry point for other Ray apps.

``serve.get_app_handle(app)`` returns this deployment's handle, whose ``generate`` /
``generate_stream`` / ``register_adapter`` / ... methods take the same typed objects the
HTTP routes build. The FastAPI app is built per replica (``__serve_build_asgi_app__``)
from its args: routes in openai_routes.py and admin_routes.py, statuses in http_errors.py.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Optional

from pydantic import ValidationError
from ray import serve

from engine.errors import InvalidRequestError
from engine.request import GenerateRequest, GenerateResult
from routing.directory_feed import stop_feeds

from .admission import RequestLimiter
from .front_door import FrontDoor
from .config import AdapterSpec, AppArgs
from .derived_options import check_deployment
from .adapter_gate import build_gate
from .http_app import build_http_app
from .registry import RegistryFollower
from .versions import VersionedFleetAdmin

STARTUP_REGISTRATIONS = 16  # startup adapters registered at once


@serve.deployment(name="LoRAFleetIngress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class LoRAFleetIngress:
    async def __init__(self, args: dict, worker, directory, quota_leases, derived: Optional[dict] = None):
        """``derived``: the options build_fleet derived (``derived_options.expected``), checked against Serve's."""
        check_deployment("LoRAFleetIngress", serve.get_replica_context()._deployment_config, derived)
        self.args = AppArgs(**args)
        self.worker = worker.options(stream=False)
        self.worker_stream = worker.options(stream=True)
        self.registry = RegistryFollower(directory)
        self.admin = VersionedFleetAdmin(self.worker, directory, self.registry, self.args)
        self.gate = build_gate(self.admin, self.args, quota_leases)
        self.limiter = RequestLimiter(self.args.max_queued_requests, self.args.request_timeout_s)
        self.front = FrontDoor(self.args, self.gate, self.limiter, self.worker, self.worker_stream)
        await self.registry.refresh()
        await self._register_startup_adapters()
        self._follow = asyncio.get_running_loop().create_task(self.registry.run())

    async def _register_startup_adapters(self) -> None:
        """The config's adapters, ``STARTUP_REGISTRATIONS`` at a time: one by one, each registration's
        registry change reached every worker before the next began (256 adapters took 3 minutes on
        16 replicas); concurrent ones share those refreshes."""
        gate = asyncio.Semaphore(STARTUP_REGISTRATIONS)

        async def register(spec: AdapterSpec) -> None:
            async with gate:
                await self.admin.register(spec)

        await asyncio.gather(*(register(spec) for spec in self.args.startup_adapters()
                               if spec.name not in self.registry.entries))

    def __del__(self):
        """Serve's graceful stop, after the drain: withdraw this process's long polls on the directory (the
        registry's and the worker handles' routers'). The directory counts each as an ongoing request; left
        out, a deleted app's directory waited them out (up to their 5 s timeout) after this process was gone."""
        if hasattr(self, "_follow"):
            self._follow.cancel()
        if hasattr(self, "registry"):
            self.registry.withdraw()
        stop_feeds()

    def __serve_build_asgi_app__(self):
        return build_http_app(self)

    # ------------------------------------------------------------------ Python handle API

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The HTTP routes' admission (front_door.py): prompt limit, places, timeout, retry, re-pick."""
        result, _ = await self.front.generate(request)
        return result

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator:
        """Token deltas, then the final ``GenerateResult``; admitted like an HTTP stream."""
        stream = await self.front.open_stream(request)
        try:
            if isinstance(stream.first, GenerateResult):
                stream.exhausted = True
                await stream.admission.finish()   # places back before the caller sees the end
                yield stream.first
            else:
                yield stream.first
                async for item in stream.rest():
                    yield item
        finally:
            stream.close()  # the caller cancelled or stopped reading: the work upstream stops too

    async def register_adapter(self, name: str, source: str, revision: Optional[str] = None, pinned: bool = False,
                               replicas: Optional[int] = None) -> dict:
        """Validate on a worker (the real shapes and limits), then publish fleet-wide."""
        try:
            spec = AdapterSpec(name=name, source=source, revision=revision, pinned=pinned, replicas=replicas)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "name"
            raise InvalidRequestError(field, f"invalid field {field}: {first['msg']}") from None
        return await self.admin.register(spec)

    async def unregister_adapter(self, name: str) -> dict:
        return await self.admin.unregister(name)

    async def pin_adapter(self, name: str, replicas: Optional[int] = None) -> dict:
        return await self.admin.pin(name, replicas)

    async def unpin_adapter(self, name: str) -> dict:
        return await self.admin.unpin(name)

    async def list_adapters(self) -> dict:
        return await self.admin.describe()

    def admission_stats(self) -> dict:
        """This ingress replica's front-door counters (benchmarks.abuse reads them; cheap, no I/O)."""
        resolver = self.gate.resolver
        return {"pid": os.getpid(), "registry_version": self.registry.version, "inflight": self.limiter.inflight,
                "quota_peak_inflight": dict(self.gate.quotas.state.peak_inflight), "retries": self.limiter.retries,
                "quota_holder": self.gate.quotas.holder, "quota_inflight": dict(self.gate.quotas.inflight),
                "quota_round_trips": self.gate.quotas.state.round_trips, "quota_local": self.gate.quotas.state.local,
                "repicks": self.front.repicks, "registry_lookups": self.gate.lookups,
                "early_refusals": self.gate.early_refusals, "guard_asked": self.gate.guard_asked,
                "resolver_lookups": resolver.lookups if resolver else 0,
                "resolver_refused": resolver.limiter.refused if resolver and resolver.limiter else 0,
                "resolver_misses_held": len(resolver.misses) if resolver else 0}
