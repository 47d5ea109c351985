"""Redis (or Valkey) backend: `redis://[USER:PASSWORD@]HOST:PORT/DB` (rediss:// for TLS).

Values are plain strings. With a TTL, puts are `SET k v PX ttl` and hits `GETEX k PX ttl`,
so a value lives for ttl since its last use; configure the server with
`maxmemory-policy volatile-lru` so only such values are evicted. Per-tenant ACL users
restricted to their key prefix: docs/remote.md.
"""
from __future__ import annotations

from typing import Sequence

from .base import RemoteBackend, RemoteError

__all__ = ["RedisBackend"]


class RedisBackend(RemoteBackend):
    scheme = "redis"
    native_ttl = True
    keeps_first = False

    def __init__(self, url: str, socket_timeout_s: float = 2.0):
        super().__init__(url)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"expected redis://HOST:PORT/DB, got {url!r}")
        self.socket_timeout_s = socket_timeout_s
        self._r = None

    def connect(self) -> None:
        try:
            import redis
        except ImportError as e:
            raise RemoteError(f"the redis client is not installed: pip install redis ({e})") from e
        # A socket timeout bounds a hung worker; Guarded's deadline bounds the request.
        r = redis.Redis.from_url(self.url, socket_timeout=self.socket_timeout_s,
                                 socket_connect_timeout=self.socket_timeout_s)
        r.ping()
        self._r = r

    @property
    def client(self):
        return self._r

    def exists(self, keys: Sequence[str]) -> list[bool]:
        p = self._r.pipeline(transaction=False)
        for k in keys:
            p.exists(k)
        return [bool(x) for x in p.execute()]

    def get(self, keys: Sequence[str], ttl_s: float | None = None) -> list[bytes | None]:
        p = self._r.pipeline(transaction=False)
        for k in keys:
            if ttl_s:
                p.getex(k, px=max(1, int(ttl_s * 1000)))
            else:
                p.get(k)
        return [v if v else None for v in p.execute()]

    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None, overwrite: bool = False) -> None:
        p = self._r.pipeline(transaction=False)
        px = max(1, int(ttl_s * 1000)) if ttl_s else None
        for k, v in items:
            p.set(k, v, px=px, nx=not overwrite)
        for res in p.execute(raise_on_error=False):
            if isinstance(res, Exception):
                raise RemoteError(f"SET: {res}")

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self._r.delete(*keys)

    def close(self) -> None:
        if self._r is not None:
            self._r.close()
            self._r = None
