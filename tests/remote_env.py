"""Local Mooncake + Redis servers for the remote-tier tests: skipped with a reason when the
packages are missing (scripts/env.sh installs them; CI has them), always stopped by PID."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest

from dsv41.cache.remote.servers import LocalServers, find_binary


def missing() -> str | None:
    if importlib.util.find_spec("redis") is None:
        return "the redis client is not installed"
    try:
        find_binary("redis-server")
        find_binary("mooncake_master")
        find_binary("mooncake_client")
    except FileNotFoundError as e:
        return str(e)
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mooncake.store does not load ({e}): pip install mooncake-transfer-engine-non-cuda, " \
               "apt-get install libibverbs1"
    return None


@contextlib.contextmanager
def local_servers(workdir, **kw):
    why = missing()
    if why:
        pytest.skip(why)
    s = LocalServers(workdir, **kw)
    try:
        s.start()
        yield s
    finally:
        s.stop()
