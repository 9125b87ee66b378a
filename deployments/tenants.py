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
import ipaddress
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


#: how to give the server keys (said by every refusal to start open)
HOW_TO_SET_KEYS = ("set API keys: OSD_API_KEYS='tenant:key[,tenant:key]' and OSD_ADMIN_KEY='<operator key>' in the "
                   "server's environment, or auth.keys_file (a YAML/JSON list of {tenant, key_sha256}) or auth.keys "
                   "in the config")


#: tenant names the server gives meanings of its own: the admin key's tenant, the metrics' label for
#: tenants past their cap, an open server's clients, refused requests; a key may not use them
RESERVED_TENANTS = frozenset({"admin", "other", "anonymous", "unauthenticated"})


class OpenServerError(RuntimeError):
    """The server would start without keys where clients beyond this machine can reach it."""


def is_loopback(host: str | None) -> bool:
    """Whether an HTTP bind host is reachable from this machine only (None: not served over HTTP
    by Serve, as in one process)."""
    if host is None or host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to any interface


def refuse_open(cfg: AuthConfig, open_: bool, http_host: str | None) -> None:
    """Refuse to start without keys on an HTTP host beyond loopback unless ``auth.allow_open``."""
    if open_ and not is_loopback(http_host) and not cfg.allow_open:
        raise OpenServerError(
            f"refusing to start without API keys while Serve's HTTP host is {http_host!r} (beyond loopback): every "
            f"client that can reach it would have operator rights. {HOW_TO_SET_KEYS}; or bind http_options.host to "
            "127.0.0.1; or set auth.allow_open: true to serve it open on purpose.")


def load_keys(cfg: AuthConfig, environ: dict | None = None) -> list[TenantKey]:
    """Every key the config names: inline, from its file, from the environment. A keys file that
    names no key is an error (an empty file must not leave the server open)."""
    env = os.environ if environ is None else environ
    keys = list(cfg.keys)
    if cfg.keys_file:
        text = Path(cfg.keys_file).read_text()
        rows = json.loads(text) if cfg.keys_file.endswith(".json") else yaml.safe_load(text)
        if not rows:
            raise ValueError(f"auth.keys_file {cfg.keys_file} names no key (a list of {{tenant, key_sha256}} is "
                             "expected); remove auth.keys_file to serve without it")
        if not isinstance(rows, list):
            raise ValueError(f"auth.keys_file {cfg.keys_file}: expected a list of {{tenant, key_sha256}}, "
                             f"got {type(rows).__name__}")
        keys += [TenantKey.model_validate(r) for r in rows]
    for item in filter(None, (env.get(cfg.keys_env) or "").split(",")):
        tenant, sep, key = item.strip().partition(":")
        if not sep or not tenant or not key:
            raise ValueError(f"{cfg.keys_env}: expected tenant:key[,tenant:key], got an item without ':'")
        keys.append(TenantKey(tenant=tenant, key_sha256=digest(key)))
    reserved = sorted({k.tenant for k in keys} & RESERVED_TENANTS)
    if reserved:
        raise ValueError(f"tenant name(s) {', '.join(map(repr, reserved))} are reserved (the server's own: "
                         f"{', '.join(sorted(RESERVED_TENANTS))}); name the tenant otherwise")
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
        self.names = {k.tenant for k in self.by_digest.values()}  # the tenants the keys name
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
        """Whether the tenant's traffic trains only drafts of its own. ``auth.isolate_training``
        (the default for keys that do not say) holds when the keys name several tenants: an open
        server's one tenant, or the one tenant of all the keys, has nobody to be isolated from."""
        if self.open:
            return False
        return self.isolation.get(tenant, self.cfg.isolate_training and len(self.names) > 1)

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

    def admit_more(self, who: Admission, count: int) -> Admission:
        """``count`` more slots for an admitted request that runs several sequences (choices):
        all of them or none. A request asking more than the tenant's ``max_concurrent`` in all can
        never run (400); one that would pass it now waits (429). :meth:`done` frees them. ``who``:
        what :meth:`admit` answered (an open server's has no key and no limits)."""
        lim = None if who.key is None else self.limits(who.key)
        if lim is not None and lim.max_concurrent is not None:
            if 1 + count > lim.max_concurrent:
                return Admission(who.tenant, who.admin, 400, f"the request runs {1 + count} sequences, more than tenant "
                                                             f"{who.tenant!r} may run at once ({lim.max_concurrent})")
            if self.in_flight[who.tenant] + count > lim.max_concurrent:
                return Admission(who.tenant, who.admin, 429, f"tenant {who.tenant!r} has {lim.max_concurrent} requests "
                                                             "in flight", 1.0)
        self.in_flight[who.tenant] += count
        return who

    def done(self, tenant: str, tokens: int, slots: int = 1) -> None:
        """A request ended: free its slots and charge its tokens (prompt + completion)."""
        # a done without its admit (a retried cleanup) frees nothing
        if self.in_flight.get(tenant, 0) > 0:
            self.in_flight[tenant] = max(0, self.in_flight[tenant] - slots)
        if tenant in self.tokens:
            self.tokens[tenant].take(tokens, self.clock())
