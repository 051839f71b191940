"""Bearer-token auth for the HTTP API; the matching token's name is the audit actor.

Tokens come from `TAILWATCH_API_TOKEN` (actor "api-token") and the named `api.tokens`
of the settings file. They are compared with `hmac.compare_digest` and never logged.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from monitor.settings import Settings

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"


class AuthConfigError(ValueError):
    """Auth is on but no token is configured."""

    field = "api_token"

    def __init__(self) -> None:
        super().__init__(
            "api.auth is on but no API token is set: set TAILWATCH_API_TOKEN or api.tokens "
            "in the settings file, or turn auth off with TAILWATCH_API__AUTH=false"
        )


class AuthError(Exception):
    """A request lacks valid credentials (status 401 or 403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Authenticator:
    """Check `Authorization: Bearer <token>` headers against the configured tokens.

    Example:
        auth = Authenticator.from_settings(settings)
        actor = auth.actor("Bearer s3cret")  # -> "api-token", or raises AuthError
    """

    enabled: bool
    read_auth: bool
    tokens: tuple[tuple[str, bytes], ...]  # (actor name, token bytes)

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        """Build from settings; raise AuthConfigError when auth is on without tokens."""
        tokens = tuple((name, tok.encode()) for name, tok in settings.all_tokens().items())
        if settings.api.auth and not tokens:
            raise AuthConfigError()
        return cls(enabled=settings.api.auth, read_auth=settings.api.read_auth, tokens=tokens)

    def actor(self, authorization: str | None, *, write: bool = True) -> str:
        """Return the actor named by the header; raise AuthError when it is not allowed."""
        if not self.enabled or (not write and not self.read_auth):
            return self._optional_actor(authorization)
        presented = _bearer(authorization)
        if presented is None:
            raise AuthError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        name = self._match(presented)
        if name is None:
            log.info("auth: rejected a request with an unknown token")
            raise AuthError(403, "invalid API token")
        return name

    def _optional_actor(self, authorization: str | None) -> str:
        presented = _bearer(authorization)
        if presented is not None:
            name = self._match(presented)
            if name is not None:
                return name
        return ANONYMOUS

    def _match(self, presented: str) -> str | None:
        raw = presented.encode()
        found = None
        # Compare against every token so timing does not reveal which name matched.
        for name, token in self.tokens:
            if hmac.compare_digest(raw, token) and found is None:
                found = name
        return found


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
