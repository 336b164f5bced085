"""One store schema for the node manager and the standalone host (contract/store.py): files of the
previous release open with every row kept, a newer file is refused, the previous release's status
reader still reads what this release writes, and one transaction helper serves both stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from qgpu_runtime.contract import store as schema
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.node.store import Grant, Share
from qgpu_runtime.node.store import Store as NodeStore
from qgpu_runtime.node.store import StoreError as NodeStoreError
from qgpu_runtime.standalone.store import Store as HostStore
from qgpu_runtime.standalone.store import StoreError as HostStoreError
from qgpu_runtime.status_cmd import StatusSourceError, read_store_status

PREVIOUS = Path(__file__).parent / "previous_release"

# FROZEN COPY, for version-skew tests only: the queries `qgpu status` of qgpu 0.1.0 (commit 959444c,
# status_cmd.read_store_status) ran against a store file.
PREVIOUS_STATUS_QUERIES = (
    "SELECT key, value FROM meta",
    "SELECT card_index, uuid, model, memory_mib FROM cards ORDER BY card_index",
    "SELECT namespace, workload, container, card_index, core_milli, memory_mib, class "
    "FROM shares ORDER BY card_index, created_ns, workload, container",
)


def _restore(dump: str, path: Path) -> Path:
    db = sqlite3.connect(path)
    db.executescript((PREVIOUS / dump).read_text())
    db.close()
    return path


def _tables(path: Path) -> dict[str, str]:
    db = sqlite3.connect(path)
    try:
        return {name: sql for name, sql in db.execute("SELECT name, sql FROM sqlite_master WHERE type='table'")
                if not name.startswith("sqlite_")}
    finally:
        db.close()


def test_a_node_store_of_the_previous_release_opens_with_every_row(tmp_path):
    store = NodeStore(_restore("node_store_v1.sql", tmp_path / "meta.db"))
    try:
        (grant,) = store.grants()
        assert grant == Grant("uid-1", "team-a", "train-0", "main", "tke.cloud.tencent.com/qgpu-core",
                              ("qgpu-core-0-0", "qgpu-core-0-1"), 1732000000000000000)
        assert store.shares() == [Share("uid-1", "team-a", "train-0", "main", 0, "GPU-aaaa", 300, 4096, "offline", 1732000000000000000)]
        assert [(c.index, c.healthy, why) for c, why in store.cards()] == [(0, True, ""), (1, False, "XID 79")]
        assert store.meta("node") == "gpu-node-1" and store.meta("schema_version") == str(schema.SCHEMA_VERSION)
    finally:
        store.close()
    assert {"jobs", "events"} <= set(_tables(tmp_path / "meta.db"))


def test_a_host_store_of_the_previous_release_opens_with_every_row(tmp_path):
    path = _restore("standalone_store_v1.sql", tmp_path / "host.db")
    store = HostStore(str(path))
    try:
        assert [c.uuid for c in store.cards()] == ["GPU-sim-0"]
        assert store.get_meta("policy") == "burst-share"
    finally:
        store.close()
    db = sqlite3.connect(path)  # the job's supervisor is long gone, so a Store read would reap it
    assert db.execute("SELECT id, name, core_milli, memory_mib, command FROM jobs").fetchall() == \
        [("job-1", "train", 400, 2048, "python train.py")]
    db.close()
    assert "grants" in _tables(path)


def test_both_kinds_of_store_have_one_schema(tmp_path):
    NodeStore(tmp_path / "node.db").close()
    HostStore(str(tmp_path / "host.db")).close()
    assert _tables(tmp_path / "node.db") == _tables(tmp_path / "host.db")


@pytest.mark.parametrize("opener, error", [
    (lambda p: NodeStore(p), NodeStoreError),
    (lambda p: HostStore(str(p)), HostStoreError),
    (lambda p: read_store_status(p), StatusSourceError),
])
def test_a_store_of_a_newer_qgpu_is_refused_naming_file_and_versions(tmp_path, opener, error):
    path = tmp_path / "future.db"
    NodeStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(schema.SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(error, match=rf"future.db: schema version {schema.SCHEMA_VERSION + 1} is newer than this qgpu reads "
                                    rf"\(versions 1..{schema.SCHEMA_VERSION}\)"):
        opener(path)


def test_the_previous_status_reader_reads_what_this_release_writes(tmp_path):
    for path in (tmp_path / "node.db", tmp_path / "host.db"):
        store = NodeStore(path)
        store.sync_cards([CardInfo(0, "GPU-x", "Tesla T4", 15109, 0)])
        store.set_meta({"node": "n1", "policy": "fixed-share"})
        store.record(Grant("u", "ns", "p", "c", "r", ("d",), 1), [Share("u", "ns", "p", "c", 0, "GPU-x", 250, 1024, "normal", 1)])
        store.close()
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        meta, cards, shares = (db.execute(q).fetchall() for q in PREVIOUS_STATUS_QUERIES)
        db.close()
        assert dict(meta)["node"] == "n1" and cards == [(0, "GPU-x", "Tesla T4", 15109)]
        assert shares == [("ns", "p", "c", 0, 250, 1024, "normal")]
        status = read_store_status(path)
        assert (status.name, status.cards[0].core_allocated_milli) == ("n1", 250)


def test_one_transaction_helper_rolls_back_on_error_and_nests(tmp_path):
    db = schema.open_store(tmp_path / "t.db")
    with pytest.raises(RuntimeError):
        with schema.transaction(db):
            db.execute("INSERT INTO meta VALUES ('a', '1')")
            with schema.transaction(db):  # inner use joins the outer transaction
                db.execute("INSERT INTO meta VALUES ('b', '2')")
            raise RuntimeError("boom")
    assert db.execute("SELECT key FROM meta WHERE key IN ('a', 'b')").fetchall() == []
    with schema.transaction(db):
        db.execute("INSERT INTO meta VALUES ('a', '1')")
    assert db.execute("SELECT value FROM meta WHERE key='a'").fetchone() == ("1",)
    db.close()


def test_migrations_are_numbered_up_to_the_version_written():
    assert [m.version for m in schema.MIGRATIONS] == list(range(1, schema.SCHEMA_VERSION + 1))
    assert all(m.why for m in schema.MIGRATIONS)


def test_a_version_that_is_not_a_number_is_refused(tmp_path):
    path = tmp_path / "odd.db"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); INSERT INTO meta VALUES ('schema_version', 'two');")
    db.close()
    with pytest.raises(schema.SchemaError, match=r"odd.db: schema_version='two': not a version number"):
        schema.open_store(path)


# FROZEN COPY, for version-skew tests only: how the DRA kubelet plugin of commit c64d41b (before the
# claim_pods table) booked and read a prepared claim (node/store.py book_claim / prepared_claim).
PREVIOUS_CLAIM_INSERT = "INSERT INTO claims VALUES (?,?,?,?,?,?)"
PREVIOUS_CLAIM_SELECT = "SELECT * FROM claims WHERE claim_uid=?"


def test_a_dra_store_written_before_claim_pods_opens_with_its_claim_and_no_reserved_pods(tmp_path):
    store = NodeStore(_restore("node_store_v1_dra.sql", tmp_path / "meta.db"))
    try:
        (claim,) = store.prepared_claims()
        assert (claim.claim_uid, claim.namespace, claim.name, claim.pods) == ("claim-uid-1", "team-a", "train", ())
        assert claim.devices[0]["device"] == "gpu-0"
        assert store.shares() == [Share("claim-uid-1", "team-a", "train", "gpu", 0, "GPU-aaaa", 300, 4096, "normal",
                                        1764000000000000000)]
        assert store.meta("schema_version") == "1"  # a table only: the previous release still opens the file
    finally:
        store.close()
    assert "claim_pods" in _tables(tmp_path / "meta.db")


def test_the_previous_dra_plugin_still_books_and_reads_claims_in_a_file_this_release_wrote(tmp_path):
    from qgpu_runtime.node.store import PreparedClaim, ReservedPod

    path = tmp_path / "meta.db"
    store = NodeStore(path)
    store.book_claim(PreparedClaim("new-claim", "ns", "c", ({"device": "gpu-0"},), "/cdi/x.json", 5,
                                   (ReservedPod("pod-uid", "p"),)), [], lambda others: None)
    store.close()
    db = sqlite3.connect(path)  # what a manager rolled back to c64d41b does with the same file
    db.execute(PREVIOUS_CLAIM_INSERT, ("old-claim", "ns", "d", "[]", "/cdi/y.json", 6))
    db.commit()
    assert db.execute(PREVIOUS_CLAIM_SELECT, ("new-claim",)).fetchone() == ("new-claim", "ns", "c", '[{"device": "gpu-0"}]',
                                                                             "/cdi/x.json", 5)
    db.execute("DELETE FROM claims WHERE claim_uid='new-claim'")  # its release_claim: claim_pods rows stay behind
    db.commit()
    db.close()
    store = NodeStore(path)
    try:
        assert [(c.claim_uid, c.pods) for c in store.prepared_claims()] == [("old-claim", ())]  # leftovers name no claim
    finally:
        store.close()


def test_a_commit_that_fails_leaves_no_transaction_open_and_later_writes_are_committed(tmp_path: Path) -> None:
    """A COMMIT that fails may leave SQLite's transaction open; every later `transaction()` then
    took the re-entrant branch and its writes were never committed while their callers believed
    them durable (helper audit, 2026-12-01). A deferred foreign key makes COMMIT fail for real."""
    path = tmp_path / "s.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA foreign_keys=ON")
    db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    db.execute("CREATE TABLE child (id INTEGER PRIMARY KEY, parent INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(sqlite3.IntegrityError):
        with schema.transaction(db):
            db.execute("INSERT INTO child VALUES (1, 42)")  # no parent 42: refused at COMMIT
    assert not db.in_transaction
    with schema.transaction(db):
        db.execute("INSERT INTO parent VALUES (7)")
    other = sqlite3.connect(path)
    assert other.execute("SELECT id FROM parent").fetchall() == [(7,)]  # committed, seen by another connection
    assert other.execute("SELECT id FROM child").fetchall() == []
