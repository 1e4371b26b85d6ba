"""Bearer-token auth for the fleet admin API, as a FastAPI dependency.

The token is read from the environment variable named in app args on every call, so
setting or rotating it needs no redeploy; unset means the admin API is off (403).
"""

from __future__ import annotations

import hmac
import os
from typing import Optional

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .http_errors import HTTPError

_bearer = HTTPBearer(auto_error=False)


class AdminAuth:
    def __init__(self, token_env: str):
        self.token_env = token_env

    async def __call__(self, credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> None:
        token = os.environ.get(self.token_env)
        if not token:
            raise HTTPError(403, f"the admin API is off: set {self.token_env} on the cluster to enable it",
                            code="admin_disabled")
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPError(401, "missing or wrong bearer token", code="unauthorized")
