"""Which extenders bind now: node commitments only while a second binder really exists (issue 23 §2).

The per-node commitment Lease (commitments.py) costs one API write per GPU bind, and it is needed
only when two processes bind at once. Every binder with node commitments ``auto`` or ``always``
publishes itself in one Lease, ``qgpu-binders`` in the commitment namespace (document:
:func:`~qgpu_runtime.contract.leases.parse_binders`): its identity, a heartbeat count it bumps at
each renewal, its duration, and whether it commits its binds now. Every write of that Lease is
conditional on the resourceVersion it read, so the document's history is one line of writes.

The rules, and why they are safe:

- **Uncommitted only by a write that saw nobody.** A binder stops committing only by writing
  ``committing: false`` on a read that shows no other live entry. A newcomer's entry, once
  written, makes every later such write impossible (the writer reads it first; a write on an older
  read fails with 409).
- **A newcomer binds once every other live binder says it commits.** ``committing: true`` is written
  only after the writer stopped starting uncommitted binds, waited for the ones in flight, and
  wrote each recent uncommitted bind (the last grace period) into its node's Lease as a commitment
  (:meth:`BinderPresence.renew`, ``flush``). So the binds the first binder made without
  commitments are in the Leases the newcomer reads, whatever its watch has delivered yet. Until
  then the newcomer refuses binds (kube-scheduler retries the pod).
- **A newcomer watches one full duration first.** Its first bind waits until it has seen the
  document for ``duration_s`` after its entry went in. A live binder renews its entry well within
  that (every third of it), writing it back should anyone have deleted it, or stops binding; so a
  binder whose entry went missing is in the document again before the newcomer decides, and a
  missing entry cannot turn commitments off while its binder lives.
- **Liveness by the reader's clock.** An entry counts as live until its reader has watched it
  unchanged for twice its duration, by the reader's own monotonic clock (contract/observed.py): no
  two clocks are compared. A binder that could not renew for its own duration stops binding, by
  its own clock, a full duration before any reader can count it gone (a request it sent before and
  that the apiserver holds for longer than that is the one case not covered).
- **Fail safe.** Anything unknown (the Lease unreadable, a malformed document, a write refused)
  means commit, and a binder not yet confirmed refuses to bind. A forged or stale entry can only
  make binders commit (and, one saying ``committing: false``, hold a newcomer back for at most twice
  its duration); a removed entry is written back at its binder's next renewal, and its binder
  cannot stop committing while another live binder is in the document.

Who can write the Lease: the extender's ServiceAccount (the Role in its namespace; the admission
policy ``qgpu-scheduler-own-leases`` holds its Lease writes to ``qgpu-node.*`` and ``qgpu-binders``),
and cluster admins. Tenants cannot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from qgpu_runtime.contract.leases import BinderEntry, BindersError, Commitment, encode_binders, parse_binders
from qgpu_runtime.contract.names import BINDERS_LEASE
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.errors import Conflict
from qgpu_runtime.kube.errors import brief as short
from qgpu_runtime.kube.leasedoc import LeaseDocuments

log = logging.getLogger(__name__)

MODES = ("always", "auto", "off")
DEFAULT_DURATION_S = 15


class NotConfirmed(Exception):
    """This binder may not bind yet: its presence is not written, or another binder has not yet
    confirmed that it commits its binds."""


@dataclass(frozen=True)
class RecentBind:
    """An uncommitted bind, kept for one grace period so it can be written as a commitment."""

    node: str
    commitment: Commitment
    at: float  # this process's monotonic seconds


class BinderPresence:
    """This binder's entry in the binders' Lease, and the mode each bind runs in.

    ``flush`` writes a list of recent uncommitted binds into their nodes' Leases (raising on
    failure); ``recent_s`` is how long a bind counts as recent (the commitments' grace).
    """

    def __init__(self, leases: LeaseDocuments, identity: str, mode: str, flush: Callable[[list[RecentBind]], None],
                 duration_s: int = DEFAULT_DURATION_S, recent_s: float = 60.0,
                 monotonic: Callable[[], float] = time.monotonic, timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        if mode not in ("always", "auto"):
            raise ValueError(f"mode={mode!r}: presence is published in modes always and auto")
        if not 1 <= duration_s <= 3600:
            raise ValueError(f"duration_s={duration_s}: must be within 1..3600")
        if not identity or len(identity) > 253:
            raise ValueError(f"identity={identity!r}: must have 1..253 characters")
        self.leases = leases
        self.identity = identity
        self.mode = mode
        self.duration_s = duration_s
        self.recent_s = recent_s
        self.flush = flush
        self.monotonic = monotonic
        self.timeout = timeout
        self.renewals = 0
        self._cond = threading.Condition()
        self._committing = True  # new binds commit
        self._written_committing: bool | None = None  # what our entry says, None: not written
        self._confirmed = False  # every other live binder says it commits
        self._why_not = "its presence in the binders' Lease is not written yet"
        self._renewed_at: float | None = None  # monotonic time before the read of our last successful write
        self._published_at: float | None = None  # the same, of our first successful write
        self._in_flight = 0  # uncommitted binds not finished
        self._recent: deque[RecentBind] = deque()
        self._beat = 0
        self._seen = FirstSeen()
        self._last_error = ""

    # --- the binds' side ---------------------------------------------------------------------------

    def begin(self) -> bool:
        """Before a bind chooses its cards: True if it must commit through the node's Lease; False
        if it may go without (then :meth:`finish` must follow). Raises :class:`NotConfirmed`."""
        with self._cond:
            if not self._confirmed:
                raise NotConfirmed(self._why_not)
            if self._renewal_stale():
                # another binder counts our entry gone twice its duration after it last changed, and
                # may then bind without commitments: we stop binding well before
                raise NotConfirmed(f"its entry in the binders' Lease was not renewed for {self.duration_s} s "
                                   f"(last error: {self._last_error or 'none'})")
            if self._committing:
                return True
            self._in_flight += 1
            return False

    def finish(self, bound: RecentBind | None) -> None:
        """An uncommitted bind ended; ``bound``: its commitment, if its Binding was created."""
        with self._cond:
            self._in_flight -= 1
            if bound is not None:
                self._recent.append(bound)
                horizon = bound.at - self.recent_s  # older ones a newcomer's watch has long delivered
                while self._recent and self._recent[0].at < horizon:
                    self._recent.popleft()
            self._cond.notify_all()

    @property
    def committing(self) -> bool:
        with self._cond:
            return self._committing

    def _renewal_stale(self) -> bool:
        return self._renewed_at is None or self.monotonic() - self._renewed_at > self.duration_s

    # --- the renewal ------------------------------------------------------------------------------

    def renew(self) -> bool:
        """Read the binders' Lease, decide this binder's mode, write its entry on the version read.
        True when the write landed; a conflict or an error leaves everything committing."""
        started = self.monotonic()
        try:
            lease = self.leases.read(BINDERS_LEASE, timeout=self.timeout)
            entries = parse_binders(lease.text if lease else None)
        except BindersError as exc:
            return self._unsure(f"the binders' Lease is malformed: {exc}")
        except Exception as exc:  # noqa: BLE001 - whatever failed, commit and retry at the next period
            return self._unsure(f"cannot read the binders' Lease: {short(exc)}")
        others = {i: e for i, e in entries.items() if i != self.identity}
        ages = self._seen.ages(BINDERS_LEASE, {i: (e.beat, e.committing) for i, e in others.items()}, started)
        live = {i: e for i, e in others.items() if ages.get(i, 0.0) < 2 * e.duration_s}
        commit = self.mode == "always" or bool(live)
        if commit and self._written_committing is not True:
            try:
                self._stop_uncommitted()
            except Exception as exc:  # noqa: BLE001 - the newcomer waits on our entry meanwhile
                return self._unsure(f"cannot write recent uncommitted binds into their node Leases: {short(exc)}")
        self._beat += 1
        mine = BinderEntry(self._beat, commit, self.duration_s)
        try:
            self.leases.write(BINDERS_LEASE, encode_binders({**live, self.identity: mine}),
                              lease.version if lease else None, timeout=self.timeout)
        except Conflict:
            return self._unsure("another binder wrote the binders' Lease meanwhile", quiet=True)
        except Exception as exc:  # noqa: BLE001
            return self._unsure(f"cannot write the binders' Lease: {short(exc)}")
        waiting = sorted(i for i, e in live.items() if not e.committing)
        with self._cond:
            self.renewals += 1
            self._renewed_at = started
            if self._published_at is None:
                self._published_at = started
            watched = started - self._published_at
            self._written_committing = commit
            self._committing = commit
            self._confirmed = not waiting and watched >= self.duration_s
            if waiting:
                self._why_not = (f"binder(s) {', '.join(waiting)} bind without node commitments and have not yet "
                                 "confirmed they commit; retry shortly")
            elif not self._confirmed:
                self._why_not = (f"it has watched the binders' Lease for {watched:.0f} s of the {self.duration_s} s "
                                 "every live binder renews within; retry shortly")
            else:
                self._why_not = ""
        return True

    def ready(self) -> bool:
        """Whether a bind would be let through now (for ``/readyz``)."""
        with self._cond:
            return self._confirmed and not self._renewal_stale()

    def _stop_uncommitted(self) -> None:
        """Start committing, wait for the uncommitted binds in flight, write the recent ones down."""
        with self._cond:
            self._committing = True
            while self._in_flight:
                self._cond.wait()
            horizon = self.monotonic() - self.recent_s
            while self._recent and self._recent[0].at < horizon:
                self._recent.popleft()
            recent = list(self._recent)
        if recent:
            self.flush(recent)
        with self._cond:
            for _ in recent:
                self._recent.popleft()

    def _unsure(self, why: str, quiet: bool = False) -> bool:
        with self._cond:
            self._committing = True  # our entry may still say false: that only makes newcomers wait
            self._last_error = why
        if not quiet:
            log.warning("binder %s: %s; binds commit through node Leases meanwhile", self.identity, why)
        return False

    def leave(self) -> None:
        """Best effort at shutdown: take this binder's entry out, so a successor need not wait."""
        for _ in range(3):
            try:
                lease = self.leases.read(BINDERS_LEASE, timeout=self.timeout)
                if lease is None:
                    return
                entries = parse_binders(lease.text)
                if self.identity not in entries:
                    return
                entries.pop(self.identity)
                self.leases.write(BINDERS_LEASE, encode_binders(entries), lease.version, timeout=self.timeout)
                return
            except Conflict:
                continue
            except Exception as exc:  # noqa: BLE001 - the entry expires by itself
                log.info("binder %s: could not remove its entry from the binders' Lease: %s", self.identity, short(exc))
                return

    def run(self, stop: threading.Event) -> None:
        """Renew every third of the duration (every second while not confirmed) until ``stop``."""
        while not stop.is_set():
            ok = self.renew()
            with self._cond:
                confirmed = self._confirmed
            stop.wait(self.duration_s / 3 if ok and confirmed else 1.0)
