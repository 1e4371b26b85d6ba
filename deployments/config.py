"""Application args (serve_config.yaml ``applications[].args``), validated by one model.

Unknown keys are refused, so a misspelt knob fails at deploy time instead of being
silently ignored. Replica counts, GPUs per replica and the router class stay in the
``deployments:`` section, where Ray Serve users look for them.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import EngineConfig
from pool.shapes import ALL_TARGET_MODULES
from pool.sources import validate_object_store_prefixes, validate_resolver_roots
from routing.settings import RoutingSettings

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def validate_adapter_name(name: str) -> str:
    """Printable, no path separators or spaces, at most 128 characters."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"adapter name {name!r} is invalid: use 1-128 characters from letters, digits, '.', '_', ':', '-', "
            f"starting with a letter or digit (no '/', spaces or control characters)")
    return name


class AdapterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    source: str  # a local folder, a hub repo id, or "demo:<name>" for a generated demo adapter
    revision: Optional[str] = None
    pinned: bool = False
    replicas: Optional[int] = Field(default=None, ge=1)  # pin replication; default: pin_replicas

    _name = field_validator("name")(classmethod(lambda cls, v: validate_adapter_name(v)))


Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bf16 on CUDA, fp32 on the CPU
Device = Literal["auto", "cpu", "cuda"]
EvictionPolicyName = Literal["lru", "fifo", "sieve"]  # pool.eviction.EVICTION_POLICIES (a test keeps them equal)


class AppArgs(BaseModel):
    """Every setting of the application and its single set of defaults (engine and router derive from it)."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = "demo"
    served_model_name: Optional[str] = None  # the base model's id in /v1/models and responses (None: its name)
    revision: Optional[str] = None
    dtype: Dtype = "auto"
    device: Optional[Device] = None  # None or auto: cuda when torch.cuda.is_available()
    max_loras_per_batch: int = Field(default=4, ge=1)
    max_lora_rank: int = Field(default=16, ge=1)
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_TARGET_MODULES))
    eviction_policy: EvictionPolicyName = "lru"
    host_cache_bytes: int = Field(default=1 << 30, ge=0)
    adapters: Optional[list[AdapterSpec]] = None  # None with base_model demo: the demo adapters
    max_batch_size: int = Field(default=8, ge=1)
    # tokens one engine step feeds; longer prompts are prefilled in chunks sharing steps with decodes.
    # None: 8192 on CUDA, 256 on the CPU (engine.kv_setup.DEFAULT_TOKEN_BUDGET), at least max_batch_size
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=1)
    max_model_len: Optional[int] = Field(default=None, ge=16)
    kv_cache_bytes: Optional[int] = Field(default=None, ge=1)  # per replica; None: 80% of free GPU memory, CPU: rows
    kv_cache_memory_fraction: float = Field(default=0.8, gt=0, le=1)  # CUDA, kv_cache_bytes None
    kv_block_size: int = Field(default=16, ge=1)  # token positions per KV block
    enable_prefix_caching: bool = True  # share KV blocks of equal (adapter uid, prompt prefix)
    max_tokens_limit: int = Field(default=512, ge=1)
    max_waiting_requests: int = Field(default=64, ge=1)  # per replica engine queue, beyond its running batch
    max_bypass_steps: int = Field(default=16, ge=0)  # steps a blocked queue head may be bypassed (no starvation)
    # every routing tunable (routing.settings.RoutingSettings; docs/routing_settings.md), e.g. {tie_epsilon: 0.5}
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    _routing = field_validator("routing", mode="before")(classmethod(
        lambda cls, v: v if isinstance(v, RoutingSettings) else RoutingSettings.from_mapping(v)))
    pin_replicas: int = Field(default=1, ge=1)
    admin_token_env: str = "LORAFLEET_ADMIN_TOKEN"
    adapter_roots: Optional[list[str]] = None
    hub_orgs: Optional[list[str]] = None
    object_store_prefixes: Optional[list[str]] = None  # allowed s3://bucket[/prefix], gs://bucket[/prefix] (None: any)
    adapter_cache_dir: Optional[str] = None  # node-local object-store download cache (None: ~/.cache/lorafleet/adapters)
    adapter_resolvers: Optional[list[str]] = None  # tried for an unregistered name: folder, s3/gs prefix or hub org
    adapter_resolver_negative_ttl_s: float = Field(default=30.0, ge=0)  # how long a resolver miss is remembered
    adapter_resolver_lookups_per_s: float = Field(default=5.0, gt=0)  # fleet-wide, over all ingress replicas
    adapter_resolver_max_concurrent_lookups: int = Field(default=4, ge=1)  # fleet-wide
    adapter_resolver_entry_ttl_s: Optional[float] = Field(default=3600.0, gt=0)  # resolver-made entries (None: kept)
    _prefixes = field_validator("object_store_prefixes")(classmethod(lambda cls, v: validate_object_store_prefixes(v)))
    _resolvers = field_validator("adapter_resolvers")(classmethod(lambda cls, v: validate_resolver_roots(v)))
    quota_lease_batch: int = Field(default=8, ge=1)  # most quota leases one grant hands an ingress (far from a limit)
    quota_lease_heartbeat_s: float = Field(default=0.5, gt=0)  # an ingress holding leases reports this often
    quota_lease_ttl_s: float = Field(default=5.0, gt=0)  # silent this long, an ingress's leases return (dead)
    quota_recall_wait_s: float = Field(default=1.0, ge=0)  # a grant at the limit waits this long for spares
    max_queued_requests: int = Field(default=256, ge=1)
    request_timeout_s: float = Field(default=120.0, gt=0)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)  # a stream with no token for this long is closed
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_prompt_chars: int = Field(default=32_000, ge=1)
    prewarm_timeout_s: float = Field(default=30.0, gt=0)  # a traffic PUT waits this long for pre-warming, at most
    version_retire_grace_s: Optional[float] = Field(default=None, ge=0)  # 0% version kept; None: request_timeout_s
    drain_timeout_s: float = Field(default=30.0, ge=0)
    warm_start_timeout_s: float = Field(default=60.0, ge=0)  # a new worker's warm-up bound (0: start cold)
    replicas_follow_plan: bool = True  # a replica reads ahead what the plan newly puts on it, evicts those last
    demand_window_s: float = Field(default=60.0, gt=0)  # window of the loads/s and working set the autoscaler sees

    @property
    def model_name(self) -> str:
        """The base model's public id: ``served_model_name``, else the folder's or hub repo's last part."""
        if self.served_model_name:
            return self.served_model_name
        return self.base_model.rstrip("/").rsplit("/", 1)[-1] or self.base_model

    def engine_config(self, replica_id: str = "local") -> EngineConfig:
        """The engine's settings: AppArgs' fields of the same names, plus the replica's id."""
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name != "replica_id"}
        values["target_modules"] = tuple(self.target_modules)
        return EngineConfig(**values, replica_id=replica_id)

    def router_kwargs(self) -> dict:
        """``request_router_kwargs`` for the worker deployment: the routing settings that differ from the defaults
        (each router rebuilds the one ``RoutingSettings`` from them; routing.ray_router checks the names)."""
        return self.routing.changed()

    def startup_adapters(self) -> list[AdapterSpec]:
        if self.adapters is not None:
            return list(self.adapters)
        if self.base_model == "demo":
            return [AdapterSpec(name=f"demo-{i}", source=f"demo:demo-{i}") for i in range(6)]
        return []


def resolve_demo_source(source: str) -> str:
    """``demo:<name>`` -> the generated demo adapter's folder; other sources unchanged."""
    if not source.startswith("demo:"):
        return source
    from engine.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    name = source[len("demo:"):]
    if name not in assets.adapters:
        index = int(name.rsplit("-", 1)[1]) if re.fullmatch(r"demo-\d{1,3}", name) else -1
        if index < 0:
            from pool.errors import AdapterNotFoundError

            raise AdapterNotFoundError(f"demo adapter {name!r} does not exist (demo-0, demo-1, ...)")
        assets = ensure_demo_assets(num_adapters=index + 1)
    return str(assets.adapters[name])
