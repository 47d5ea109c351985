"""OpCounter: what it counts as an op, a launch and a host synchronization."""
from __future__ import annotations

import torch

from dsv41.opcount import OpCounter


def test_counts_ops_launches_and_host_syncs():
    x = torch.arange(12.0).view(3, 4)
    with OpCounter() as c:
        y = (x * 2).sum(0)            # mul, sum: launches
        y.view(2, 2)                  # a view: an op, not a launch
        int(y[0])                     # select (view) + _local_scalar_dense: a sync
        x[x > 3]                      # boolean mask: gt, then index with a bool mask: a sync
        torch.nonzero(x)              # a sync
        torch.repeat_interleave(torch.tensor([1, 2]), 2, output_size=4)   # no sync: size given
    assert c.host_syncs == 3, c.syncs_by_name
    assert set(c.syncs_by_name) == {"aten._local_scalar_dense", "aten.index", "aten.nonzero"}
    assert c.by_name["aten.view"] >= 1 and c.launches < c.total
    s = c.summary(3)
    assert s["ops"] == c.total and s["host_syncs"] == 3 and len(s["top"]) == 3


def test_custom_ops_count_once():
    from dsv41 import ops
    x = torch.randn(4, 32)
    with OpCounter() as c:
        ops.rms_norm(x, None, 1e-6)
    assert c.by_name == {"dsv41.rms_norm": 1}
