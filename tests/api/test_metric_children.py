"""The front end's labelled metrics: each child looked up once, the same child as labels()."""

from __future__ import annotations

from api.edge.metrics import FrontEndMetrics


def test_a_labelled_child_is_the_labels_child_and_is_looked_up_once(monkeypatch):
    metrics = FrontEndMetrics(multiprocess_dir=None)
    child = metrics.labelled(metrics.engine_calls, "127.0.0.1:8000", "served")
    assert child is metrics.engine_calls.labels(engine="127.0.0.1:8000", outcome="served")
    asked: list[tuple[str, ...]] = []
    real = type(metrics.engine_calls).labels
    monkeypatch.setattr(
        type(metrics.engine_calls), "labels", lambda m, *v, **k: asked.append(v) or real(m, *v, **k)
    )
    for _ in range(3):
        metrics.labelled(metrics.engine_calls, "127.0.0.1:8000", "served").inc()
    metrics.labelled(metrics.engine_calls, "127.0.0.1:8000", "failed").inc()
    assert asked == [("127.0.0.1:8000", "failed")]
    assert child._value.get() == 3


def test_record_call_counts_by_dialect_and_outcome_in_that_order():
    metrics = FrontEndMetrics(multiprocess_dir=None)
    metrics.record_call("chat", "captured")
    metrics.record_call("chat", "captured")
    metrics.record_call("anthropic", "incomplete")
    sample = metrics.registry.get_sample_value
    assert sample("tokcap_calls_total", {"dialect": "chat", "outcome": "captured"}) == 2
    assert sample("tokcap_calls_total", {"dialect": "anthropic", "outcome": "incomplete"}) == 1
