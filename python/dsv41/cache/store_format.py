"""Where the store's byte format used to live: now dsv41.cache.store.format. This name is
an alias of that module, so `from dsv41.cache import store_format` keeps working."""
from __future__ import annotations

import sys

from .store import format as _format

sys.modules[__name__] = _format
