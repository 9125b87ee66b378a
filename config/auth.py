"""API keys, tenants and their limits."""

from __future__ import annotations


from pydantic import Field

from .base import _Strict


class TenantLimits(_Strict):
    """Per-tenant limits (None: unlimited), enforced by each ingress replica."""

    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)  # prompt + completion tokens
    max_concurrent: int | None = Field(default=None, ge=1)


class TenantKey(_Strict):
    """One API key of a tenant, stored as the SHA-256 hex digest of the key (never the key)."""

    tenant: str = Field(min_length=1)
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    admin: bool = False
    limits: TenantLimits | None = None  # None: AuthConfig.default_limits
    #: the tenant's traffic trains only drafts of its own (``<draft>@<tenant>`` for the draft the
    #: router picked, starting from the base draft or from what the tenant's own general draft
    #: ``general@<tenant>`` has learned) and never a shared one: acceptance timing cannot
    #: reveal to others what its prompts taught a draft; its requests are routed by named domains
    #: only (never a router cluster) and its usage names no cluster. None: ``AuthConfig.isolate_training``
    isolate_training: bool | None = None


class AuthConfig(_Strict):
    """API keys and tenants. Keys come from ``keys_file`` (YAML or JSON: a list of TenantKey) and
    from the environment variable named by ``keys_env`` (``tenant:key,tenant:key``, hashed at start),
    the admin key from ``admin_key_env``. With no key at all the server is open (and says so);
    open on an HTTP host beyond loopback only with ``allow_open: true``, else it refuses to start."""

    keys: tuple[TenantKey, ...] = ()
    keys_file: str | None = None
    keys_env: str = "OSD_API_KEYS"
    admin_key_env: str = "OSD_ADMIN_KEY"
    default_limits: TenantLimits = TenantLimits(requests_per_minute=600, tokens_per_minute=200_000, max_concurrent=16)
    #: every tenant's traffic trains only that tenant's drafts and is routed by named domains only
    #: (see ``TenantKey.isolate_training``). On by default: a shared suffix tree, draft or router
    #: cluster lets one tenant read another's outputs from timing and chunking; set it false (or
    #: false on a key) for tenants that may learn from each other. Applies when the keys name
    #: several tenants: an open server's one tenant, or the one tenant of all the keys, is not
    #: isolated unless its key says so.
    isolate_training: bool = True
    #: serve without any key although Serve's HTTP host is beyond loopback (every client that can
    #: reach it then has operator rights); without it such a start is refused
    allow_open: bool = False
