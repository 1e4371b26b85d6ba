"""Request-level errors of the engine (the pool's adapter errors are in pool.errors).

The HTTP status of each lives in the ingress (deployments/http_errors.py), not here.
"""

from pool.errors import LoRAFleetError, PoolError


class InvalidRequestError(LoRAFleetError):
    """A request parameter is out of range; ``field`` names it (OpenAI's ``param``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class AdapterUnregisteredError(LoRAFleetError):
    """The adapter was unregistered while this request waited or ran past the drain timeout."""


class AdapterExistsError(PoolError):
    """The name is registered already, from another source."""


class EngineShutdownError(LoRAFleetError):
    """The engine is stopping: retry on another replica."""


class RequestCancelledError(LoRAFleetError):
    """The caller went away (disconnect, timeout, cancel); the sequence was dropped from the engine."""


class EngineOverloadedError(LoRAFleetError):
    """The engine's waiting queue is full: retry later or elsewhere."""


class EngineUnhealthyError(LoRAFleetError):
    """Steps keep failing on this replica; Serve will replace it."""
