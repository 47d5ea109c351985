"""Count the aten ops a piece of code dispatches, and the ones that would stall a GPU.

    with OpCounter() as c:
        engine.step()
    c.total, c.host_syncs, c.by_name.most_common(10)

On the CPU nothing launches or synchronizes, but every op dispatched here becomes a kernel
launch (or a copy) on a GPU, and a few ops need their result on the host before the next
op can be issued: those stall the stream. This counter is the CPU's view of both, used by
bench/bench_decode.py and by the tests that hold the paged step to "no host sync".

A host-sync op is one whose output shape or value the host must read: `.item()` and
`int(t)` (aten::_local_scalar_dense), `nonzero`, boolean-mask indexing and `masked_select`,
`unique`, `repeat_interleave` without output_size, `bincount`, `.tolist()` of a device
tensor (a `_local_scalar_dense` per element or a device-to-host `_to_copy`), and any copy of
a device tensor to the host (`_to_copy`/`copy_` to "cpu" from another device). On the CPU a
device-to-host copy cannot be seen, so it only counts on a GPU.

A custom op (dsv41::*) counts once, as its one launch: the mode does not see inside it.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_SYNC_OPS", "OpCounter"]

# Overload packets (names without the overload) whose result the host must wait for.
HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive",
    "aten.unique_dim", "aten.repeat_interleave", "aten.bincount", "aten.argwhere",
    "aten.index_put_with_bool", "aten.equal", "aten.is_nonzero", "aten._assert_async",
})

# Ops that only reshape metadata: no kernel on a GPU.
_VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.slice",
    "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.t", "aten.transpose",
    "aten.permute", "aten.alias", "aten.as_strided", "aten.detach", "aten.unflatten",
    "aten.flatten", "aten.view_as_complex", "aten.view_as_real", "aten.split",
    "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.narrow", "aten.diagonal",
    "aten.lift_fresh", "aten._reshape_alias", "aten.empty", "aten.empty_strided",
    "aten.empty_like", "aten.new_empty", "aten.new_empty_strided", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_same_size",
})


def _packet(func) -> str:
    name = func.overloadpacket if hasattr(func, "overloadpacket") else func
    return str(name).replace("::", ".")


def _is_host_sync(name: str, func, args, kwargs) -> bool:
    if name in HOST_SYNC_OPS:
        if name == "aten.repeat_interleave":
            return kwargs.get("output_size") is None
        return True
    if name == "aten.index" or name == "aten.index_put" or name == "aten.index_put_":
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())
    if name in ("aten._to_copy", "aten.copy_"):
        src = args[1] if name == "aten.copy_" else args[0]
        dst_device = (args[0].device if name == "aten.copy_" else kwargs.get("device"))
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
                and dst_device is not None and torch.device(dst_device).type == "cpu")
    return False


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten (and dsv41) ops while active. `total` counts every op;
    `launches` leaves out pure view/metadata ops (which launch nothing on a GPU);
    `host_syncs` counts the ops above; `by_name` and `syncs_by_name` say which."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.syncs_by_name: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _packet(func)
        self.by_name[name] += 1
        if _is_host_sync(name, func, args, kwargs):
            self.syncs_by_name[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    @property
    def launches(self) -> int:
        return sum(n for k, n in self.by_name.items() if k not in _VIEW_OPS)

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs_by_name.values())

    def summary(self, top: int = 15) -> dict:
        return {"ops": self.total, "launches": self.launches, "host_syncs": self.host_syncs,
                "top": self.by_name.most_common(top),
                "syncs": dict(self.syncs_by_name)}
