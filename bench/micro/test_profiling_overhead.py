"""What dsv41.profiling costs while off (the default): a traced call beside the same
function undecorated. Off, a range is one check of a module global."""
from __future__ import annotations

import pytest

from dsv41 import profiling


def _work(x):
    return x + 1


_traced = profiling.traced("bench.work", lambda x: {"tokens": x})(_work)


@pytest.mark.parametrize("impl", ["plain", "traced_off"])
def test_traced_call_off(benchmark, impl):
    benchmark.group = "profiling-off-overhead"
    if profiling.enabled():
        pytest.skip("profiling is on in this process")
    fn = _work if impl == "plain" else _traced

    def calls():
        for i in range(1000):
            fn(i)

    benchmark(calls)
