"""The rate limits of limits.py in Redis, so every replica of the server shares one key's limits.

Each decision is one Lua script run by Redis atomically: read both buckets and the day's counter,
refill, decide, and write back (or write nothing on a refusal), with Redis's own clock (`TIME`), so
replicas with skewed clocks still agree. Keys, all with the key id as a hash tag (cluster-safe):

    asst:rl:{<key id>}:req          hash {level, ts}: the request bucket
    asst:rl:{<key id>}:tok          hash {level, ts}: the token bucket
    asst:rl:{<key id>}:day:<day>    integer: tokens used in that UTC day (expires after it)

Numbers come back as strings: Redis would truncate Lua floats to integers.
"""

from __future__ import annotations

import time
from typing import Any

from assistant.config import TierConfig
from assistant.errors import AssistantError, ConfigError
from assistant.server.limits import DAY_S, UNLIMITED, Decision, Limiter, utc_day

_REFILL = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1000000
local function level(key, cap)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'level', 'ts')
  local l, ts = tonumber(v[1]), tonumber(v[2])
  if l == nil then return cap end
  return math.min(cap, l + math.max(0, now - ts) * cap / 60)
end
local function store(key, cap, l)
  redis.call('HSET', key, 'level', tostring(l), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((cap - l) * 60 / cap) + 60)
end
"""

# KEYS: req, tok, day.  ARGV: rpm, tpm, estimate, daily_quota, seconds to UTC midnight
ADMIT = _REFILL + """
local rpm, tpm, estimate, quota, midnight = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local req = level(KEYS[1], rpm)
local tok = level(KEYS[2], tpm)
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local need = math.min(estimate, tpm)
if quota > 0 and used >= quota then
  return {'0', tostring(req), tostring(tok), tostring(midnight), 'daily_quota'}
end
if rpm > 0 and req < 1 then
  return {'0', tostring(req), tostring(tok), tostring((1 - req) * 60 / rpm), 'requests'}
end
if tpm > 0 and tok < need then
  return {'0', tostring(req), tostring(tok), tostring((need - tok) * 60 / tpm), 'tokens'}
end
if rpm > 0 then req = req - 1; store(KEYS[1], rpm, req) end
if tpm > 0 then tok = tok - estimate; store(KEYS[2], tpm, tok) end
return {'1', tostring(req), tostring(tok), '0', ''}
"""

# KEYS: tok, day.  ARGV: tpm, reserved - used, used, day key ttl
SETTLE = _REFILL + """
local tpm, delta, used, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tpm > 0 then store(KEYS[1], tpm, math.min(tpm, level(KEYS[1], tpm) + delta)) end
if used > 0 then
  redis.call('INCRBY', KEYS[2], used)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return 1
"""


class LimiterUnavailable(AssistantError):
    """Redis could not be reached: the request cannot be admitted (the server answers 503)."""


class RedisLimiter(Limiter):
    def __init__(self, client: Any, prefix: str = "asst:rl") -> None:
        self._client = client
        self._prefix = prefix
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)

    @classmethod
    def from_url(cls, url: str) -> "RedisLimiter":
        return cls(redis_client(url, socket_timeout=2))

    def _keys(self, key_id: str) -> tuple[str, str, str]:
        base = f"{self._prefix}:{{{key_id}}}"
        return f"{base}:req", f"{base}:tok", f"{base}:day:{utc_day(time.time())}"

    def admit(self, key_id: str, tier: TierConfig, estimate: int) -> Decision:
        if not (tier.rpm or tier.tpm or tier.daily_tokens):
            return UNLIMITED
        now = time.time()
        try:
            allowed, req, tok, wait, reason = self._admit(
                keys=list(self._keys(key_id)),
                args=[tier.rpm, tier.tpm, estimate, tier.daily_tokens, DAY_S - now % DAY_S])
        except Exception as e:  # redis.RedisError and connection failures
            raise LimiterUnavailable(f"The rate limiter (Redis) is unavailable: {e}") from e
        return Decision(allowed in (b"1", "1"), tier.rpm, tier.tpm, float(req), float(tok), float(wait),
                        reason.decode() if isinstance(reason, bytes) else str(reason))

    def settle(self, key_id: str, tier: TierConfig, reserved: int, used: int) -> None:
        _, tok, day = self._keys(key_id)
        try:
            self._settle(keys=[tok, day], args=[tier.tpm, reserved - used, used, DAY_S + 3600])
        except Exception as e:
            raise LimiterUnavailable(f"The rate limiter (Redis) is unavailable: {e}") from e

    def close(self) -> None:
        self._client.close()


def redis_client(url: str, *, socket_timeout: float) -> Any:
    """A client for `server.redis_url` (the limiter's and the turn registry's), or a ConfigError that
    says how to install the client library."""
    try:
        import redis
    except ImportError as e:
        raise ConfigError("server.redis_url is set but the redis client is not installed: "
                          "pip install -e '.[gateway]' (make does it).") from e
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=2)
