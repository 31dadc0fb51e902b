"""API keys at the door: who is calling (a `Principal`: key id, tier), or a 401.

Keys come from two places: hashed keys in the store (`assistant keys create`, see assistant/keys.py)
and the static `server.api_keys` list (tier `server.default_tier`), compared in constant time. With
neither configured, the server is open and every caller is the local user (no key, no limits); that
is only allowed on loopback, which `check_bind` enforces at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import HTTPException, Request

from assistant.config import AssistantConfig, TierConfig
from assistant.errors import ConfigError

UNAUTHORIZED = "Missing, wrong or revoked API key: send 'Authorization: Bearer <key>'."


@dataclass(frozen=True)
class Principal:
    key_id: str  # "" = the local user of an open server (no keys configured)
    name: str
    tier_name: str
    tier: TierConfig | None  # None = unlimited (the open server's local user)

    def may_use(self, model: str) -> bool:
        if self.tier is None or self.tier.models.strip() == "*":
            return True
        return model in {m.strip() for m in self.tier.models.split(",")}

    @property
    def priority(self) -> int:
        return self.tier.priority if self.tier is not None else 100


LOCAL = Principal("", "local", "", None)


def _static_id(key: str) -> str:
    return "static" + hashlib.sha256(key.encode()).hexdigest()[:8]


class Authenticator:
    """Turns an Authorization header into a Principal (or None: answer 401)."""

    def __init__(self, keys: Any = None, static_keys: tuple[str, ...] = (), tiers: dict[str, TierConfig] | None = None,
                 default_tier: str = "free") -> None:
        self._keys = keys  # assistant.keys.Keys, or None (static keys only)
        self._static = static_keys
        self._tiers = tiers or {}
        self._default_tier = default_tier

    @classmethod
    def from_config(cls, config: AssistantConfig, keys: Any = None) -> "Authenticator":
        return cls(keys, config.api_keys, dict(config.server.tiers), config.server.default_tier)

    def keys_configured(self) -> bool:
        return bool(self._static) or (self._keys is not None and self._keys.any())

    def authenticate(self, authorization: str) -> Principal | None:
        given = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        if not given:
            return None if self.keys_configured() else LOCAL
        for key in self._static:  # every one compared: the time taken says nothing about the key
            if hmac.compare_digest(given.encode(), key.encode()):
                return self._principal(_static_id(key), "static key", self._default_tier)
        record = self._keys.verify(given) if self._keys is not None else None
        if record is not None:
            return self._principal(record.id, record.name, record.tier)
        if not self.keys_configured():
            return LOCAL  # an open server ignores whatever key a client sends (OpenAI SDKs always send one)
        return None

    def tier_of(self, key_id: str) -> TierConfig | None:
        """The tier of a key already authenticated, by its id (the web chat knows only the id): a static
        key's is `default_tier`, a stored key's its record's; None for the key-less local user."""
        if any(_static_id(key) == key_id for key in self._static):
            return self._principal(key_id, "static key", self._default_tier).tier
        record = next((k for k in self._keys.list() if k.id == key_id), None) if self._keys is not None else None
        return self._principal(key_id, record.name, record.tier).tier if record is not None else None

    def _principal(self, key_id: str, name: str, tier_name: str) -> Principal:
        tier = self._tiers.get(tier_name)
        if tier is None:  # a key of a tier later removed from the config: the most restrictive default
            tier = self._tiers.get(self._default_tier, TierConfig())
        return Principal(key_id, name, tier_name, tier)

    def of(self, request: Request) -> Principal | None:
        return self.authenticate(request.headers.get("authorization", ""))


def key_checker(auth: Authenticator) -> Callable[[Request], Principal]:
    """A FastAPI dependency: the caller's Principal, or a 401."""

    def check(request: Request) -> Principal:
        principal = auth.of(request)
        if principal is None:
            raise HTTPException(401, UNAUTHORIZED)
        request.state.principal = principal
        return principal

    return check


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, auth: Authenticator) -> None:
    """Refuse to serve a non-loopback address without any key (the server would be open to anyone)."""
    if not is_loopback(host) and not auth.keys_configured():
        raise ConfigError(
            f"Refusing to serve on {host} without API keys: anyone who can reach it could use it. Create a key "
            "with `assistant keys create --tier free --name NAME` (same --data-dir / store), or bind to "
            "127.0.0.1 (--host 127.0.0.1).")
