"""Typed errors for adapter loading and pool operations.

Each names what was refused and why. Which HTTP status each family maps to is the
ingress's business (deployments/http_errors.py): this layer knows nothing of HTTP.
"""

from __future__ import annotations


def _rebuild_error(cls, message, state):
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class LoRAFleetError(Exception):
    """Base of every error this project raises on purpose.

    Errors cross process boundaries (Ray Serve replicas to handle callers), so pickling
    keeps the message and attributes whatever the subclass's ``__init__`` takes.
    """

    def __reduce__(self):
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


# --- adapter loading and validation: the caller's adapter is wrong ---


class AdapterError(LoRAFleetError):
    """The adapter itself is unusable here (format, rank, shapes, features)."""


class AdapterNotFoundError(AdapterError):
    """Unknown adapter name/uid, or a source folder that does not exist."""


class AdapterFormatError(AdapterError):
    """Missing files, bad adapter_config.json, or unparseable tensor names."""


class PickleWeightsRefusedError(AdapterFormatError):
    """``adapter_model.bin`` (pickle) can run code on load; only safetensors is accepted."""


class CorruptWeightsError(AdapterFormatError):
    """The safetensors file is truncated or its header is invalid."""


class RankTooLargeError(AdapterError):
    def __init__(self, name: str, rank: int, max_rank: int):
        super().__init__(
            f"adapter {name!r} has rank {rank}, above this pool's max_lora_rank {max_rank}"
        )
        self.rank = rank
        self.max_rank = max_rank


class UnsupportedTargetModulesError(AdapterError):
    """The adapter adapts modules the pool has no buffers for."""


class ShapeMismatchError(AdapterError):
    """A LoRA matrix does not fit the base model's layer."""


class UnsupportedAdapterFeatureError(AdapterError):
    """DoRA, biases, modules_to_save, embedding/lm_head LoRA, added tokens."""


class AdapterTooLargeError(AdapterError):
    """The weights file is larger than any adapter this pool can hold could be (checked before reading)."""


class SourceNotAllowedError(AdapterError):
    """The source lies outside the configured allow-lists (folders, hub organisations)."""


# --- pool operations: a valid request that the pool's state forbids now ---


class PoolError(LoRAFleetError):
    """The pool's current state refuses the operation; it may succeed later."""


class BatchTooLargeError(PoolError):
    """More distinct adapters in one batch than the pool has slots, pins counted."""


class NoEvictableSlotError(PoolError):
    """Every resident adapter is pinned or in the running batch."""


class PinRefusedError(PoolError):
    """Pinning would leave no slot for unpinned adapters (starvation guard)."""


class AdapterNotStagedError(PoolError):
    """A slot load found the adapter in neither the pool nor the host tier; it must be read first,
    off the step that asked (a file read never runs on the engine thread or under the pool's lock)."""

    def __init__(self, uid: str):
        super().__init__(f"adapter {uid!r} is not in the host tier yet")
        self.uid = uid


class AdapterInUseError(PoolError):
    """An in-flight batch uses the adapter; it cannot be unloaded now."""


# --- adapter sources: object stores and the node-local download cache ---


class InvalidAdapterSourceError(AdapterError):
    """The source string is malformed: an unknown URL scheme, no bucket, '..' segments."""


class SourceBackendMissingError(LoRAFleetError):
    """The server lacks the optional package for this scheme (s3fs for s3://, gcsfs for gs://)."""


class SourceAccessDeniedError(AdapterError):
    """The object store refused this server's credentials for the source."""


class SourceUnavailableError(LoRAFleetError):
    """The object store could not be reached or the download failed; retrying may succeed."""
