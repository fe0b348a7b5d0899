"""The engine's checkpoint store on its own: fencing of rows under concurrent restores (K3)."""

from __future__ import annotations

from helios.runtime.checkpoint_store import CheckpointStore
from helios.scheduler.types import RequestHandle

SHARED = tuple(range(1, 9))


def store_holding_one_checkpoint() -> CheckpointStore:
    store = CheckpointStore(rows=1)
    row = store.destination(RequestHandle(0, 0))
    store.captured(row, SHARED, prompt_length=len(SHARED), message_ends=())
    return store


def admit(store: CheckpointStore, handle: RequestHandle, tail: int):
    reuse, found = store.admission(SHARED + (tail,), ())
    assert reuse.cached_tokens == len(SHARED)
    store.admitted(handle, found)
    return found


def test_K3_a_row_stays_fenced_until_the_last_pending_restore_from_it_completes():
    store = store_holding_one_checkpoint()
    first, second = RequestHandle(1, 0), RequestHandle(2, 0)
    admit(store, first, 100)
    admit(store, second, 200)
    store.restored(first)
    # the second restore has not copied yet: a snapshot must not overwrite its source row
    assert store.destination(RequestHandle(3, 0)) == -1
    store.restored(second)
    assert store.destination(RequestHandle(3, 0)) == 0


def test_K3_a_failed_admission_does_not_unfence_a_row_another_request_restores_from():
    store = store_holding_one_checkpoint()
    admit(store, RequestHandle(1, 0), 100)
    _, found = store.admission(SHARED + (200,), ())
    store.released(RequestHandle(2, 0), found)  # the second admission failed before ``admitted``
    assert store.destination(RequestHandle(3, 0)) == -1
    store.released(RequestHandle(1, 0))
    assert store.destination(RequestHandle(3, 0)) == 0
