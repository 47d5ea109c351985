"""Kernel fallbacks (a CUDA call that ran the generic kernel where a tensor-core kernel was
wanted) reach the operator: Engine.metrics() and the server's /metrics text."""
from __future__ import annotations

from dsv41.config import ModelConfig
from dsv41.engine import Engine
from dsv41.model import Model
from dsv41.ops.fallbacks import fallbacks
from dsv41.server.metrics import fallback_metrics


def test_fallbacks_are_counted_in_engine_and_server_metrics():
    fallbacks.clear()
    try:
        assert "dsv41_kernel_fallbacks_total{" not in fallback_metrics()
        fallbacks.record("sparse_attention", 'head_dim 96 has no "mma" tiles')
        fallbacks.record("sparse_attention", 'head_dim 96 has no "mma" tiles')
        text = fallback_metrics()
        assert "# TYPE dsv41_kernel_fallbacks_total counter" in text
        assert ('dsv41_kernel_fallbacks_total{op="sparse_attention",'
                'reason="head_dim 96 has no \\"mma\\" tiles"} 2') in text
        eng = Engine(Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0))
        assert eng.metrics()["kernel_fallbacks"] == {
            'sparse_attention: head_dim 96 has no "mma" tiles': 2}
    finally:
        fallbacks.clear()
