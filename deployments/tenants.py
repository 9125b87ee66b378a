"""API keys -> tenants, and per-tenant limits (requests and tokens per minute, concurrency).

Ray-free and clock-injected so that it is tested by hand. Keys are kept only as SHA-256 digests;
a presented key is hashed and compared with every stored digest in constant time (the digest
table is the only secret-derived state).
Limits are token buckets refilled continuously; a refused request is told how long to wait
(``Retry-After``). Each ingress replica enforces its own buckets: with R ingress replicas a
tenant gets up to R times its limits (say so to tenants, or keep one ingress replica).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from config import AuthConfig, TenantKey, TenantLimits


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def load_keys(cfg: AuthConfig, environ: dict | None = None) -> list[TenantKey]:
    """Every key the config names: inline, from its file, from the environment."""
    env = os.environ if environ is None else environ
    keys = list(cfg.keys)
    if cfg.keys_file:
        text = Path(cfg.keys_file).read_text()
        rows = json.loads(text) if cfg.keys_file.endswith(".json") else yaml.safe_load(text)
        keys += [TenantKey.model_validate(r) for r in rows or []]
    for item in filter(None, (env.get(cfg.keys_env) or "").split(",")):
        tenant, sep, key = item.strip().partition(":")
        if not sep or not tenant or not key:
            raise ValueError(f"{cfg.keys_env}: expected tenant:key[,tenant:key], got an item without ':'")
        keys.append(TenantKey(tenant=tenant, key_sha256=digest(key)))
    if env.get(cfg.admin_key_env):
        keys.append(TenantKey(tenant="admin", key_sha256=digest(env[cfg.admin_key_env]), admin=True))
    return keys


@dataclass
class Bucket:
    """Capacity ``rate`` per minute, refilled continuously."""

    rate: float
    level: float | None = None  # None: full (not used yet); negative: overdrawn
    at: float = 0.0

    def _refill(self, now: float) -> None:
        if self.level is None:
            self.level, self.at = self.rate, now
        self.level = min(self.rate, self.level + (now - self.at) * self.rate / 60.0)
        self.at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0: now)."""
        self._refill(now)
        missing = min(amount, self.rate) - self.level
        return max(0.0, missing * 60.0 / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount  # may go negative: a long answer is paid for by waiting later


@dataclass
class Admission:
    tenant: str
    admin: bool
    status: int = 200  # 200, 401 or 429
    message: str = ""
    retry_after: float = 0.0
    key: TenantKey | None = None


class Tenants:
    def __init__(self, cfg: AuthConfig, keys: list[TenantKey] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.by_digest = {k.key_sha256: k for k in (load_keys(cfg) if keys is None else keys)}
        #: tenants whose keys set isolate_training (any key that says True isolates the tenant)
        self.isolation: dict[str, bool] = {}
        for k in self.by_digest.values():
            if k.isolate_training is not None:
                self.isolation[k.tenant] = self.isolation.get(k.tenant, False) or k.isolate_training
        self.clock = clock
        self.requests: dict[str, Bucket] = {}
        self.tokens: dict[str, Bucket] = {}
        self.in_flight: dict[str, int] = {}

    @property
    def open(self) -> bool:
        """No keys configured: every request is served as tenant "anonymous"."""
        return not self.by_digest

    def _match(self, presented: str) -> TenantKey | None:
        """The key whose digest equals ``presented``: every stored digest is compared, each in
        constant time (``hmac.compare_digest``), so the time taken says nothing about how close
        a guess came or which key matched."""
        found = None
        for stored, key in self.by_digest.items():
            if hmac.compare_digest(stored, presented):
                found = key
        return found

    def isolated(self, tenant: str) -> bool:
        """Whether the tenant's traffic trains only drafts of its own."""
        return self.isolation.get(tenant, self.cfg.isolate_training)

    def limits(self, key: TenantKey) -> TenantLimits:
        return key.limits or self.cfg.default_limits

    def identify(self, authorization: str | None) -> Admission:
        """The tenant behind an ``Authorization: Bearer <key>`` header (401 when unknown)."""
        if self.open:
            return Admission("anonymous", admin=False)
        scheme, _, key = (authorization or "").partition(" ")
        found = self._match(digest(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if found is None:
            return Admission("", False, 401, "a valid API key is required (Authorization: Bearer <key>)")
        return Admission(found.tenant, found.admin, key=found)

    def admit(self, authorization: str | None) -> Admission:
        """Identify, then check the tenant's request rate, token rate and concurrency; on success
        the request counts as in flight until :meth:`done`."""
        who = self.identify(authorization)
        if who.status != 200 or self.open:
            if who.status == 200:
                self.in_flight[who.tenant] = self.in_flight.get(who.tenant, 0) + 1
            return who
        lim, now = self.limits(who.key), self.clock()
        if lim.max_concurrent is not None and self.in_flight.get(who.tenant, 0) >= lim.max_concurrent:
            return Admission(who.tenant, who.admin, 429, f"tenant {who.tenant!r} has {lim.max_concurrent} requests in flight", 1.0)
        waits = []
        if lim.requests_per_minute is not None:
            waits.append(("requests per minute", self.requests.setdefault(who.tenant, Bucket(lim.requests_per_minute)).wait_for(1, now)))
        if lim.tokens_per_minute is not None:
            waits.append(("tokens per minute", self.tokens.setdefault(who.tenant, Bucket(lim.tokens_per_minute)).wait_for(1, now)))
        over = [(name, w) for name, w in waits if w > 0]
        if over:
            name, wait = max(over, key=lambda x: x[1])
            return Admission(who.tenant, who.admin, 429, f"tenant {who.tenant!r} is over its {name} limit", wait)
        if lim.requests_per_minute is not None:
            self.requests[who.tenant].take(1, now)
        self.in_flight[who.tenant] = self.in_flight.get(who.tenant, 0) + 1
        return who

    def done(self, tenant: str, tokens: int) -> None:
        """A request ended: free its slot and charge its tokens (prompt + completion)."""
        if self.in_flight.get(tenant, 0) > 0:  # a done without its admit (a retried cleanup) frees nothing
            self.in_flight[tenant] -= 1
        if tenant in self.tokens:
            self.tokens[tenant].take(tokens, self.clock())
