"""API keys: the one check every protected route depends on.

Today keys come from `server.api_keys` (comma-separated); the gateway grows this module (hashed keys
in the store, tiers). With no keys configured the server is open, which is only safe on loopback.
"""

from __future__ import annotations

import hmac
from typing import Callable

from fastapi import HTTPException, Request


def key_ok(request: Request, api_keys: tuple[str, ...]) -> bool:
    """Whether the request may pass: no keys configured, or `Authorization: Bearer <one of them>`
    (compared in constant time)."""
    if not api_keys:
        return True
    header = request.headers.get("authorization", "")
    given = header[7:] if header.startswith("Bearer ") else ""
    return any(hmac.compare_digest(given.encode(), key.encode()) for key in api_keys)


def key_checker(api_keys: tuple[str, ...]) -> Callable[[Request], None]:
    """A FastAPI dependency that refuses requests without one of `api_keys` with a 401."""

    def check(request: Request) -> None:
        if not key_ok(request, api_keys):
            raise HTTPException(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")

    return check
