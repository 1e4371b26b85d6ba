"""Request-level errors of the engine (the pool's adapter errors are in pool.errors)."""

from pool.errors import LoRAFleetError, PoolError


class InvalidRequestError(LoRAFleetError):
    """A request parameter is out of range; ``field`` names it (OpenAI's ``param``)."""

    http_status = 400

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class AdapterUnregisteredError(LoRAFleetError):
    """The adapter was unregistered while this request waited or ran past the drain timeout."""

    http_status = 410


class AdapterExistsError(PoolError):
    http_status = 409


class EngineShutdownError(LoRAFleetError):
    http_status = 503
