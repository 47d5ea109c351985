"""Who is asking, and which cache namespace their request runs in.

    keys = ApiKeys.load(["k1", "k2"], key_file="keys.txt")   # or ApiKeys() for no auth
    tenancy = Tenancy(keys, require_salt=False, cached_tokens="own")
    tenant = tenancy.authenticate(authorization_header)      # APIError 401 without a valid key
    ns, own = tenancy.namespace(tenant, salt)                # the engine's namespace; whether
                                                             # usage may report cached_tokens

The prefix cache is shared by every request in one namespace, and a hit is observable: a
response's `cached_tokens` counts it and its time to first token drops. Whoever can send
prompts into a namespace can therefore test guesses about the prompts others sent there
(docs/serve.md, "Tenants"). So:

- With API keys, each key is a tenant with a namespace of its own; keys listed in a key
  file with the same tenant name share one (the operator's declaration that they trust
  each other). A tenant can never reach another's namespace: its salt only subdivides its
  own.
- Without keys, requests without a salt share the default namespace. `cached_tokens` is
  reported only in a namespace that is the caller's own (a key's, or one it salted), unless
  the operator asks for it everywhere (cached_tokens="always", a single-user server).
  --require-salt refuses requests without a salt.

Namespaces on the wire and on disk never hold a key: a key's tenant is named by a digest
of it (`key-` + 16 hex digits of its SHA-256). Composition is injective: "" (anonymous,
unsalted), "/SALT" (anonymous, salted), "TENANT" and "TENANT/SALT", where TENANT never
contains "/".
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..argcheck import read_regular_file
from .protocol import APIError

__all__ = ["ApiKeys", "Tenancy", "Tenant", "CACHED_TOKENS_POLICIES", "KEY_FILE_MAX_BYTES"]

CACHED_TOKENS_POLICIES = ("own", "always")
KEY_FILE_MAX_BYTES = 1 << 20   # ~10,000 'KEY TENANT' lines; a key file is read whole
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller's tenant: `name` is its namespace root (None: anonymous)."""

    name: str | None


ANONYMOUS = Tenant(None)


class ApiKeys:
    """The keys a server accepts, each mapped to its tenant. Lookups go through the key's
    SHA-256, so the time a lookup takes says nothing about how close a guess was."""

    def __init__(self, tenants: dict[str, str] | None = None):
        """tenants: key -> tenant name (None values: the key's own tenant)."""
        self._by_digest: dict[bytes, Tenant] = {}
        for key, name in (tenants or {}).items():
            self.add(key, name)

    def add(self, key: str, tenant: str | None = None) -> None:
        if not key or key != key.strip() or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and hold no whitespace")
        if tenant is None:
            tenant = "key-" + _digest(key).hex()[:16]
        elif not _TENANT_NAME.fullmatch(tenant) or tenant.startswith("key-"):
            raise ValueError(f"tenant name {tenant!r}: 1-64 of [A-Za-z0-9._-], not starting with 'key-'")
        d = _digest(key)
        if d in self._by_digest and self._by_digest[d].name != tenant:
            raise ValueError("an API key is listed twice with different tenants")
        self._by_digest[d] = Tenant(tenant)

    @classmethod
    def load(cls, keys=(), key_file: str | Path | None = None) -> "ApiKeys":
        """Keys given one by one (each its own tenant) and a key file: one key per line,
        optionally followed by a tenant name that keys sharing a namespace have in common;
        blank lines and lines starting with # are skipped. The file must be a regular file
        of at most KEY_FILE_MAX_BYTES of UTF-8 text (a FIFO or /dev/zero is refused, never
        read): ValueError otherwise, OSError when it cannot be opened."""
        out = cls()
        for k in keys:
            out.add(k)
        if key_file is not None:
            raw = read_regular_file(key_file, KEY_FILE_MAX_BYTES)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{key_file}: not UTF-8 text (byte {e.start})") from None
            for n, line in enumerate(text.splitlines(), 1):
                words = line.split()
                if not words or words[0].startswith("#"):
                    continue
                if len(words) > 2:
                    raise ValueError(f"{key_file}:{n}: expected 'KEY' or 'KEY TENANT'")
                try:
                    out.add(words[0], words[1] if len(words) == 2 else None)
                except ValueError as e:
                    raise ValueError(f"{key_file}:{n}: {e}") from None
        return out

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant(self, key: str) -> Tenant | None:
        return self._by_digest.get(_digest(key))


class Tenancy:
    def __init__(self, keys: ApiKeys | None = None, *, require_salt: bool = False,
                 cached_tokens: str = "own"):
        if cached_tokens not in CACHED_TOKENS_POLICIES:
            raise ValueError(f"cached_tokens must be one of {CACHED_TOKENS_POLICIES}, got {cached_tokens!r}")
        self.keys = keys or ApiKeys()
        self.require_salt = require_salt
        self.cached_tokens = cached_tokens

    @property
    def auth(self) -> bool:
        return len(self.keys) > 0

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant from its Authorization header; 401 in OpenAI's shape when keys
        are configured and none of them was presented."""
        if not self.auth:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if not authorization:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
        tenant = self.keys.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def namespace(self, tenant: Tenant, salt: str | None) -> tuple[str, bool]:
        """(the engine's namespace, whether the caller may see cached_tokens in it)."""
        if salt is None and self.require_salt:
            raise APIError(400, "this server requires a cache_salt (or the X-Cache-Namespace header) "
                           "on every request", param="cache_salt")
        root = tenant.name or ""
        ns = root if salt is None else f"{root}/{salt}"
        own = tenant.name is not None or salt is not None or self.cached_tokens == "always"
        return ns, own
