"""The annotation writer (node/annotationwriter.py): writes off the admission path, merged per pod,
in order, retried with backoff, bounded, and drained at shutdown."""

from __future__ import annotations

import threading

import pytest

from qgpu_runtime.node.annotationwriter import AnnotationWriter


class Api:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[tuple[str, str, dict]] = []

    def patch(self, namespace: str, name: str, values) -> None:
        self.calls.append((namespace, name, dict(values)))
        if self.failures:
            self.failures -= 1
            raise ConnectionError("apiserver away")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_writes_go_out_in_the_order_pods_asked_and_merge_per_pod():
    api = Api()
    writer = AnnotationWriter(api.patch)
    writer.submit("ns", "a", {"qgpu.io/assigned": '["c0"]'})
    writer.submit("ns", "b", {"qgpu.io/assigned": '["c0"]'})
    writer.submit("ns", "a", {"qgpu.io/assigned": '["c0", "c1"]'})
    assert api.calls == []  # nothing is written by submit itself
    while writer.pending():
        writer.run_once()
    assert api.calls == [("ns", "a", {"qgpu.io/assigned": '["c0", "c1"]'}), ("ns", "b", {"qgpu.io/assigned": '["c0"]'})]


def test_a_failed_write_is_retried_after_a_growing_backoff_and_a_newer_value_wins():
    api, clock = Api(failures=2), Clock()
    writer = AnnotationWriter(api.patch, retry_base_s=1.0, clock=clock)
    done = writer.submit("ns", "a", {"k": "1"})
    writer.run_once()  # fails: retried after 1 s
    writer.submit("ns", "a", {"k": "2"})  # queued meanwhile: merged into the retry
    clock.now = 1.0
    writer.run_once()  # fails again: after 2 s more
    assert not done.is_set()
    clock.now = 3.0
    writer.run_once()
    assert done.is_set() and api.calls == [("ns", "a", {"k": "1"}), ("ns", "a", {"k": "2"}), ("ns", "a", {"k": "2"})]
    assert (writer.written, writer.failed) == (1, 0)


def test_a_write_that_keeps_failing_is_given_up_and_counted():
    api = Api(failures=99)
    writer = AnnotationWriter(api.patch, attempts=2, retry_base_s=0.0)
    done = writer.submit("ns", "a", {"k": "1"})
    writer.run_once()
    writer.run_once()
    assert done.is_set() and writer.failed == 1 and writer.pending() == 0 and len(api.calls) == 2


def test_past_the_bound_the_oldest_write_is_dropped_and_counted():
    api = Api()
    writer = AnnotationWriter(api.patch, max_pending=2)
    first = writer.submit("ns", "a", {"k": "1"})
    writer.submit("ns", "b", {"k": "1"})
    writer.submit("ns", "c", {"k": "1"})
    assert first.is_set() and writer.dropped == 1
    while writer.pending():
        writer.run_once()
    assert [name for _, name, _ in api.calls] == ["b", "c"]


def test_a_value_that_already_landed_is_not_written_again():
    api = Api()
    writer = AnnotationWriter(api.patch)
    writer.submit("ns", "a", {"k": "1"})
    writer.run_once()
    assert writer.submit("ns", "a", {"k": "1"}).is_set() and writer.pending() == 0
    writer.forget("ns", "a")  # the pod is gone: a pod of that name again is written anew
    writer.submit("ns", "a", {"k": "1"})
    assert writer.pending() == 1


def test_shutdown_writes_what_is_queued_once_more_and_ends_the_worker():
    api = Api(failures=1)
    writer = AnnotationWriter(api.patch, retry_base_s=60.0)
    writer.submit("ns", "a", {"k": "1"})
    writer.submit("ns", "b", {"k": "1"})
    stop = threading.Event()
    worker = threading.Thread(target=writer.serve, args=(stop,))
    worker.start()
    assert not writer.flush(0.3)  # a's retry waits out its 60 s backoff
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert sorted(name for _, name, _ in api.calls) == ["a", "a", "b"]  # a retried at once on shutdown


def test_bad_bounds_are_refused_naming_them():
    with pytest.raises(ValueError, match="max_pending=0"):
        AnnotationWriter(Api().patch, max_pending=0)
