"""Application args (serve_config.yaml ``applications[].args``), validated by one model.

Unknown keys are refused, so a misspelt knob fails at deploy time instead of being
silently ignored. Replica counts, GPUs per replica and the router class stay in the
``deployments:`` section, where Ray Serve users look for them.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from pool.eviction import EVICTION_POLICIES
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
EvictionPolicyName = Literal[tuple(EVICTION_POLICIES)]  # the pool's policies, named once (pool.eviction)


class AppArgs(BaseModel):
    """Every setting of the application and its single set of defaults (engine and router derive from it).

    Each field's docstring is its documentation: README.md's configuration table is rendered from them
    (``python -m deployments.config_table``), so a field without one fails that table's test.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_model: str = "demo"
    """`demo` (generated tiny Llama), a local folder, or a hub repo id (Llama, Mistral, Qwen2/3; `HF_TOKEN`,
    `HF_HUB_OFFLINE` honoured; safetensors only)"""
    served_model_name: Optional[str] = None
    """the base model's id in `/v1/models` and responses (unset: the folder's or repo's last part, `demo` for the demo)"""
    revision: Optional[str] = None
    """hub revision of the base model"""
    dtype: Dtype = "auto"
    """`auto` (bf16 on CUDA, fp32 on the CPU), `float32`, `bfloat16`, `float16`"""
    device: Optional[Device] = None
    """`cuda`, `cpu`, or unset / `auto`: `cuda` when `torch.cuda.is_available()`, else `cpu`"""
    max_loras_per_batch: int = Field(default=4, ge=1)
    """adapter slots per replica, the base model's slot included"""
    max_lora_rank: int = Field(default=16, ge=1)
    """buffer rank; higher-rank adapters are refused (400, both numbers named)"""
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_TARGET_MODULES))
    """which of q/k/v/o/gate/up/down get LoRA buffers"""
    eviction_policy: EvictionPolicyName = "lru"
    """`lru`, `fifo` or `sieve` (live-changeable through `user_config`)"""
    host_cache_bytes: int = Field(default=1 << 30, ge=0)
    """host-memory tier per replica (pinned memory on CUDA): a re-load is a copy, not a file read"""
    adapters: Optional[list[AdapterSpec]] = None
    """`[{name, source, revision?, pinned?, replicas?}]` registered at start; `source: "demo:demo-N"` names a
    generated demo adapter (unset with `base_model: demo`: the demo adapters)"""
    max_batch_size: int = Field(default=8, ge=1)
    """running requests per replica (also bounded by free KV blocks); `build_fleet` makes it (plus `engine_queue`
    and the routing setting `oldest_queue`) LoRAWorker's `max_ongoing_requests`, so a replica spills only when its
    batch is full"""
    engine_queue: int = Field(default=0, ge=0)
    """requests a replica admits beyond `max_batch_size`, waiting in its engine in arrival order: a freed row
    starts the oldest of them at once, whichever router sent it, instead of going to whichever router first
    learns of it (the demo at concurrency 64 through three routers, 4 interleaved runs: e2e p99 2.25 s against
    3.14 s, p50 0.61 s against 0.41 s, the same req/s); the routers count these admissions as rows. 0: only the
    places of the routing setting `oldest_queue`, which the routers keep for the fleet's oldest request waiting for
    the replica, wait there; every other waiting request waits in its router"""
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=1)
    """tokens one engine step feeds; longer prompts are prefilled in chunks beside running decodes (unset: 8192
    on CUDA, 1024 on the CPU, at least `max_batch_size`)"""
    long_prefill_tokens: Optional[int] = Field(default=None, ge=1)
    """a prompt with more tokens left than this is long: it is prefilled `long_prefill_chunk_tokens` a step at most, and
    not in a step that already prefills a shorter prompt, so short requests' first tokens do not wait behind its chunks (unset: 128
    on the CPU with the default `max_num_batched_tokens`, else no cap)"""
    long_prefill_chunk_tokens: Optional[int] = Field(default=None, ge=1)
    """tokens a step feeds of a long prompt (one with more than `long_prefill_tokens` left); smaller chunks are
    shorter steps for the decodes and short prompts beside it (unset: on the CPU with the default
    `max_num_batched_tokens` and `long_prefill_tokens`, 64 shrinking as the prompt's cached context grows, so its
    last chunks, which also attend over the first, cost about as much as its first; else `long_prefill_tokens`)"""
    max_model_len: Optional[int] = Field(default=None, ge=16)
    """context window (unset: the model's, at most 2048)"""
    kv_cache_bytes: Optional[int] = Field(default=None, ge=1)
    """paged KV cache budget per replica (unset: on CUDA `kv_cache_memory_fraction` of free memory, on the CPU
    enough for `max_batch_size` full-length sequences)"""
    kv_cache_memory_fraction: float = Field(default=0.8, gt=0, le=1)
    """on CUDA with `kv_cache_bytes` unset: the fraction of free GPU memory the KV cache takes"""
    kv_block_size: int = Field(default=16, ge=1)
    """token positions per KV block"""
    enable_prefix_caching: bool = True
    """requests with the same adapter uid and prompt prefix share KV blocks (keyed by uid: a re-registered
    adapter never reuses stale KV)"""
    max_tokens_limit: int = Field(default=512, ge=1)
    """cap on a request's `max_tokens`"""
    max_waiting_requests: int = Field(default=64, ge=1)
    """requests waiting in one engine beyond its running batch; beyond it 503"""
    max_bypass_steps: int = Field(default=16, ge=0)
    """steps later requests may pass a blocked queue head (then it goes first: no starvation)"""
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    """every routing tunable, each with its unit: the policy's tie and spill terms, the router's feed, the plan's
    hysteresis (e.g. `{tie_epsilon: 0.5, grow_after_s: 10}`; table: [docs/routing_settings.md](docs/routing_settings.md),
    generated from `routing/settings.py`)"""
    _routing = field_validator("routing", mode="before")(classmethod(
        lambda cls, v: v if isinstance(v, RoutingSettings) else RoutingSettings.from_mapping(v)))
    pin_replicas: int = Field(default=1, ge=1)
    """a pinned adapter is pinned on its first N replicas in rendezvous order"""
    admin_token_env: str = "LORAFLEET_ADMIN_TOKEN"
    """env var holding the admin bearer token (unset variable: the admin API is off)"""
    adapter_roots: Optional[list[str]] = None
    """allowed local folders for adapter sources (unset: any)"""
    hub_orgs: Optional[list[str]] = None
    """allowed hub organisations for adapter sources (unset: any)"""
    object_store_prefixes: Optional[list[str]] = None
    """allowed `s3://bucket[/prefix]` and `gs://bucket[/prefix]` adapter sources (unset: any)"""
    adapter_cache_dir: Optional[str] = None
    """node-local download cache for object-store adapters, shared by the node's replicas (unset:
    `~/.cache/lorafleet/adapters`)"""
    adapter_cache_bytes: Optional[int] = Field(default=10 << 30, ge=0)
    """disk budget (bytes) of each node-local adapter download cache: object-store downloads in
    `adapter_cache_dir`, and hub adapter snapshots in the hub cache (the base model is never removed); least
    recently used out first, never one used in the last minute (unset: unbounded)"""
    adapter_resolvers: Optional[list[str]] = None
    """roots tried in order for an unregistered adapter name on its first request: a folder, an s3/gs prefix or
    a hub org (unset: off)"""
    adapter_resolver_negative_ttl_s: float = Field(default=30.0, ge=0)
    """how long a resolver miss is remembered"""
    adapter_resolver_lookups_per_s: float = Field(default=5.0, gt=0)
    """fleet-wide resolver lookup rate, over all ingress replicas (beyond: 429 `resolver_busy`)"""
    adapter_resolver_max_concurrent_lookups: int = Field(default=4, ge=1)
    """fleet-wide resolver lookups at once"""
    adapter_resolver_entry_ttl_s: Optional[float] = Field(default=3600.0, gt=0)
    """how long a resolver-made registration lives (unset: kept)"""
    _prefixes = field_validator("object_store_prefixes")(classmethod(lambda cls, v: validate_object_store_prefixes(v)))
    _resolvers = field_validator("adapter_resolvers")(classmethod(lambda cls, v: validate_resolver_roots(v)))
    quota_lease_batch: int = Field(default=8, ge=1)
    """most quota leases one grant hands an ingress (far from a limit)"""
    quota_lease_heartbeat_s: float = Field(default=0.5, gt=0)
    """how often an ingress holding quota leases reports"""
    quota_lease_ttl_s: float = Field(default=5.0, gt=0)
    """silent this long, an ingress's quota leases return (it is taken for dead)"""
    quota_recall_wait_s: float = Field(default=1.0, ge=0)
    """how long a quota grant at the limit waits for other ingresses' spares"""
    max_queued_requests: int = Field(default=256, ge=1)
    """queue bound per worker and per ingress; beyond it 429"""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """per-request timeout (504); replicas drain this plus 10 s on a scale-down or redeploy (`build_fleet`)"""
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    """a stream with no token for this long ends with an error event"""
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """request body size limit (413)"""
    max_prompt_chars: int = Field(default=32_000, ge=1)
    """prompt length limit in characters (400)"""
    prewarm_timeout_s: float = Field(default=30.0, gt=0)
    """a traffic PUT waits at most this for pre-warming"""
    version_retire_grace_s: Optional[float] = Field(default=None, ge=0)
    """a version at 0% stays resolvable this long (unset: `request_timeout_s`)"""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """how long an unregistered adapter's in-flight requests may finish"""
    warm_start_timeout_s: float = Field(default=60.0, ge=0)
    """how long a new replica may load its warm-start plan before taking traffic (0: start cold)"""
    replicas_follow_plan: bool = True
    """a replica reads what the placement plan newly puts on it into its host tier (and a free slot) before
    traffic reaches it, and evicts the plan's adapters last"""
    host_standby_share: float = Field(default=0.5, ge=0, le=1)
    """share of the host tier that may hold standby copies: every registered adapter waits in the host tier of
    its rendezvous-first replica, where a request goes while no replica holds it and the plan places it nowhere,
    so that request copies it into a slot instead of reading the file (0: none; only with `replicas_follow_plan`)"""
    demand_window_s: float = Field(default=60.0, gt=0)
    """the window of requested adapters (and loads/s) the autoscaling policy counts as the working set"""

    @model_validator(mode="after")
    def _engine_queue_fits_the_engine(self) -> "AppArgs":
        queued = self.engine_queue + self.routing.oldest_queue
        if queued > self.max_waiting_requests:
            raise ValueError(f"engine_queue + routing.oldest_queue ({self.engine_queue} + {self.routing.oldest_queue}) "
                             f"must not exceed max_waiting_requests ({self.max_waiting_requests}): the engine would "
                             f"refuse what Serve admits")
        return self

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
