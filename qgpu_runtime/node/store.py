"""The node's durable allocation store: SQLite in WAL mode.

Why SQLite: one file, atomic multi-row transactions, and WAL recovery makes a ``kill -9`` at any
instant safe — a transaction is either wholly in the file or wholly absent. ``synchronous=FULL``
extends that to power loss at the price of one fsync per Allocate (measured in bench/).

Two kinds of rows:
- ``grants``: what kubelet handed out — resource and device IDs per container. Reconciliation
  compares these with kubelet's pod-resources API.
- ``shares``: what each workload holds on each card (core, memory). ``qgpu status`` and the
  metrics read these. The standalone host manager writes the same ``cards``/``shares``/``meta``
  tables, so one reader serves both. The schema, its migrations and the transaction helper are
  the contract's (contract/store.py; docs/node-manager.md, "Store schema").
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from qgpu_runtime.contract.store import SchemaError, UnsafeJournal, open_store, transaction
from qgpu_runtime.gpu.types import CardInfo


@dataclass(frozen=True)
class Grant:
    """Device IDs of one resource that kubelet allocated to one container."""

    pod_uid: str
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    created_ns: int


@dataclass(frozen=True)
class Share:
    """What one container (or standalone job) holds on one card."""

    workload_id: str
    namespace: str
    workload: str
    container: str
    card_index: int
    card_uuid: str
    core_milli: int
    memory_mib: int
    klass: str
    created_ns: int


@dataclass(frozen=True)
class PreparedClaim:
    """A ResourceClaim the DRA kubelet plugin prepared: what kubelet was answered and where the CDI
    spec lies. Its card shares are ``shares`` rows whose workload_id is ``claim_uid``."""

    claim_uid: str
    namespace: str
    name: str
    devices: tuple[dict, ...]  # the answered devices, as JSON objects (node/dra/plugin.py)
    cdi_spec: str
    created_ns: int
    pods: tuple[ReservedPod, ...] = ()  # its status.reservedFor pods at prepare (table claim_pods)


@dataclass(frozen=True)
class ReservedPod:
    """A pod a claim is reserved for (``status.reservedFor`` entry of resource ``pods``)."""

    uid: str
    name: str


class StoreError(RuntimeError):
    """The store file is unusable; the message names the file and SQLite's reason."""


class Store:
    """Thread-safe (one connection behind a lock): gRPC handlers and the sampler share it."""

    def __init__(self, path: Path | str, synchronous: str = "FULL") -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = open_store(self.path, synchronous=synchronous, timeout_s=30, threads=True)
        except (SchemaError, UnsafeJournal) as exc:
            raise StoreError(str(exc)) from None
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open allocation store: {exc}") from exc
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def meta(self, key: str) -> str | None:
        with self._lock:
            return self._get_meta(key)

    def set_meta(self, values: dict[str, str]) -> None:
        with self._lock, self._tx():
            self._db.executemany("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                                 sorted(values.items()))

    def _tx(self):
        return transaction(self._db)

    def sync_cards(self, cards: Sequence[CardInfo]) -> None:
        """Make the cards table equal to what the backend discovered (health starts as discovered)."""
        with self._lock, self._tx():
            self._db.execute("DELETE FROM cards WHERE card_index NOT IN (%s)" % ",".join("?" * len(cards)),
                             [c.index for c in cards])
            self._db.executemany(
                "INSERT INTO cards VALUES (?,?,?,?,?, '') ON CONFLICT(card_index) DO UPDATE SET uuid=excluded.uuid,"
                " model=excluded.model, memory_mib=excluded.memory_mib, healthy=excluded.healthy, reason=''",
                [(c.index, c.uuid, c.model, c.memory_mib, int(c.healthy)) for c in cards])

    def set_card_health(self, index: int, healthy: bool, reason: str) -> None:
        with self._lock, self._tx():
            self._db.execute("UPDATE cards SET healthy=?, reason=? WHERE card_index=?", (int(healthy), reason, index))

    def record(self, grant: Grant, shares: Iterable[Share]) -> None:
        """One Allocate, atomically: the grant and (once per container) its card shares."""
        with self._lock, self._tx():
            self._db.execute(
                "INSERT INTO grants VALUES (?,?,?,?,?,?,?) ON CONFLICT(pod_uid, container, resource)"
                " DO UPDATE SET device_ids=excluded.device_ids, created_ns=excluded.created_ns",
                (grant.pod_uid, grant.namespace, grant.pod, grant.container, grant.resource,
                 json.dumps(sorted(grant.device_ids)), grant.created_ns))
            self._db.executemany(
                "INSERT OR IGNORE INTO shares VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(s.workload_id, s.namespace, s.workload, s.container, s.card_index, s.card_uuid, s.core_milli,
                  s.memory_mib, s.klass, s.created_ns) for s in shares])

    def grants(self) -> list[Grant]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM grants ORDER BY created_ns, pod_uid, container, resource").fetchall()
        return [Grant(r[0], r[1], r[2], r[3], r[4], tuple(json.loads(r[5])), r[6]) for r in rows]

    def shares(self) -> list[Share]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM shares ORDER BY card_index, created_ns, workload_id, container").fetchall()
        return [Share(*r) for r in rows]

    def pod_shares(self) -> list[Share]:
        """The shares booked for pods, not for prepared ResourceClaims, in one read: read apart, a
        claim booked between the two reads looked like the shares of a pod that is gone."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM shares WHERE NOT EXISTS (SELECT 1 FROM claims WHERE claim_uid = shares.workload_id) "
                                    "ORDER BY card_index, created_ns, workload_id, container").fetchall()
        return [Share(*r) for r in rows]

    def cards(self) -> list[tuple[CardInfo, str]]:
        """Cards with their health reason ('' when healthy)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM cards ORDER BY card_index").fetchall()
        return [(CardInfo(r[0], r[1], r[2], r[3], minor=r[0], healthy=bool(r[4])), r[5]) for r in rows]

    def release_pods(self, pod_uids: Iterable[str]) -> int:
        """Forget every grant and share of these pods; returns how many rows went. The shares of a
        prepared ResourceClaim are never among them: kubelet releases those (NodeUnprepareResources)."""
        uids = sorted(set(pod_uids))
        if not uids:
            return 0
        marks = ",".join("?" * len(uids))
        with self._lock, self._tx():
            a = self._db.execute(f"DELETE FROM grants WHERE pod_uid IN ({marks})", uids).rowcount
            b = self._db.execute(f"DELETE FROM shares WHERE workload_id IN ({marks}) "
                                 "AND NOT EXISTS (SELECT 1 FROM claims WHERE claim_uid = shares.workload_id)", uids).rowcount
        return a + b

    def release_grant(self, pod_uid: str, container: str, resource: str) -> None:
        with self._lock, self._tx():
            self._db.execute("DELETE FROM grants WHERE pod_uid=? AND container=? AND resource=?", (pod_uid, container, resource))
            left = self._db.execute("SELECT 1 FROM grants WHERE pod_uid=? AND container=?", (pod_uid, container)).fetchone()
            if not left:
                self._db.execute("DELETE FROM shares WHERE workload_id=? AND container=?", (pod_uid, container))

    def reassign(self, moves: dict[tuple[str, str, str], tuple[str, str, str, str]]) -> None:
        """Move grants (and their containers' shares) to the owner kubelet says holds them.

        ``moves`` maps (pod uid, container, resource) to (new uid, namespace, pod, container). All
        moves happen in one transaction, so two containers that swapped cards swap cleanly.
        """
        if not moves:
            return
        with self._lock, self._tx():
            grants, shares = [], {}
            for (uid, container, resource), new in moves.items():
                row = self._db.execute("SELECT * FROM grants WHERE pod_uid=? AND container=? AND resource=?",
                                       (uid, container, resource)).fetchone()
                if row is None:
                    continue
                grants.append((new, row))
                if (uid, container) not in shares:
                    shares[(uid, container)] = (new, self._db.execute(
                        "SELECT * FROM shares WHERE workload_id=? AND container=?", (uid, container)).fetchall())
            for _, row in grants:
                self._db.execute("DELETE FROM grants WHERE pod_uid=? AND container=? AND resource=?", (row[0], row[3], row[4]))
            for (uid, container) in shares:
                self._db.execute("DELETE FROM shares WHERE workload_id=? AND container=?", (uid, container))
            for (nuid, ns, pod, container), row in grants:
                self._db.execute("INSERT OR REPLACE INTO grants VALUES (?,?,?,?,?,?,?)", (nuid, ns, pod, container, *row[4:]))
            for (nuid, ns, pod, container), rows in shares.values():
                self._db.executemany("INSERT OR REPLACE INTO shares VALUES (?,?,?,?,?,?,?,?,?,?)",
                                     [(nuid, ns, pod, container, *r[4:]) for r in rows])

    def _claim_of(self, row: tuple) -> PreparedClaim:
        pods = self._db.execute("SELECT pod_uid, pod FROM claim_pods WHERE claim_uid=? ORDER BY pod, pod_uid",
                                (row[0],)).fetchall()
        return PreparedClaim(row[0], row[1], row[2], tuple(json.loads(row[3])), row[4], row[5],
                             tuple(ReservedPod(uid, name) for uid, name in pods))

    def prepared_claim(self, claim_uid: str) -> PreparedClaim | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM claims WHERE claim_uid=?", (claim_uid,)).fetchone()
            return None if row is None else self._claim_of(row)

    def prepared_claims(self) -> list[PreparedClaim]:
        """Every prepared claim with the pods it is reserved for (the isolation loop's input)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM claims ORDER BY namespace, name, claim_uid").fetchall()
            return [self._claim_of(r) for r in rows]

    def claim_uids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT claim_uid FROM claims")}

    def book_claim(self, claim: PreparedClaim, shares: Sequence[Share],
                   check: Callable[[list[Share]], None]) -> None:
        """Book a prepared claim and its shares in one transaction, replacing an earlier booking of
        the same claim (a repeated prepare books once). ``check`` gets every other share of the
        node, read inside the transaction, and raises to refuse; nothing is written then."""
        with self._lock, self._tx():
            rows = self._db.execute("SELECT * FROM shares WHERE workload_id<>?", (claim.claim_uid,)).fetchall()
            check([Share(*r) for r in rows])
            self._db.execute("DELETE FROM shares WHERE workload_id=?", (claim.claim_uid,))
            self._db.executemany(
                "INSERT INTO shares VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(s.workload_id, s.namespace, s.workload, s.container, s.card_index, s.card_uuid, s.core_milli,
                  s.memory_mib, s.klass, s.created_ns) for s in shares])
            self._db.execute(
                "INSERT INTO claims VALUES (?,?,?,?,?,?) ON CONFLICT(claim_uid) DO UPDATE SET namespace=excluded.namespace,"
                " name=excluded.name, devices=excluded.devices, cdi_spec=excluded.cdi_spec, created_ns=excluded.created_ns",
                (claim.claim_uid, claim.namespace, claim.name, json.dumps(list(claim.devices), sort_keys=True),
                 claim.cdi_spec, claim.created_ns))
            self._db.execute("DELETE FROM claim_pods WHERE claim_uid=?", (claim.claim_uid,))
            self._db.executemany("INSERT OR REPLACE INTO claim_pods VALUES (?,?,?,?)",
                                 [(claim.claim_uid, p.uid, claim.namespace, p.name) for p in claim.pods])

    def release_claim(self, claim_uid: str) -> bool:
        """Forget a prepared claim and its shares; False when it was not booked (already released)."""
        with self._lock, self._tx():
            a = self._db.execute("DELETE FROM claims WHERE claim_uid=?", (claim_uid,)).rowcount
            b = self._db.execute("DELETE FROM shares WHERE workload_id=?", (claim_uid,)).rowcount
            self._db.execute("DELETE FROM claim_pods WHERE claim_uid=?", (claim_uid,))
        return bool(a or b)

    def integrity(self) -> str:
        with self._lock:
            return self._db.execute("PRAGMA integrity_check").fetchone()[0]
