"""The isolation control law for one card: who may run during the next tick, and why.

Pure on purpose: the same law drives the simulated GPU in tests and benchmarks and the real card
through NVML sampling and SIGSTOP/SIGCONT, so what the tests pin is what runs in production.

The law is time division with a token bucket per tenant, in milli-card-seconds. Every tick a
tenant earns its *allowance rate*. Each tick at most one busy capped tenant gets the card's time
slot (the one owed the most, with a non-negative bucket); it pays the whole slot, and the other
busy capped tenants are held (suspended). Held tenants pay what the sampler charges them (queued
kernels still draining, where the driver's figure can be believed: estimator.py), and debt is
repaid. So over any window a tenant's card time stays within rate x window + the bucket cap + one
tick, and tenants never overlap, which is what makes the shares exact: measured on an H100,
charging measured utilization instead (NVML samples arrive every 200 ms) overshot a 30 % cap by 6
points and starved the smaller of two tenants; measured on an H200 (2026-11-28), this law gives
tenants 30.0 + 60.1 % of the card's time for shares of 30 + 60. Policies differ only in the
allowance rate:

- best-effort: unlimited (no throttling; the card's time slicing splits it among the busy).
- fixed-share: the core share, whatever the rest of the card does.
- burst-share: the core share plus a part of the capacity no busy tenant has a claim on. When a
  tenant that owns that capacity becomes busy, the borrower's rate drops at once and its saved
  credit is cut to the new cap, so it falls back within about one tick plus one bucket window.

Online/offline co-location sits on top of every policy: offline tenants yield to every other
class. While any non-offline tenant of the card is busy, offline tenants' allowance is the
offline floor (0 by default) and they are held within a tick or two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.model import AppClass

CARD_MILLI = 1000


@dataclass(frozen=True)
class Tenant:
    """One workload's share of one card, as booked by placement.

    ``core_milli`` 0 means no compute share was booked: online tenants (which reserve memory only
    and get priority instead) and whole-card users are never throttled for compute.
    """

    key: str
    core_milli: int
    memory_mib: int = 0
    klass: AppClass = AppClass.NORMAL

    def __post_init__(self) -> None:
        if not 0 <= self.core_milli <= CARD_MILLI:
            raise ValueError(f"tenant {self.key!r}: core_milli={self.core_milli} is not allowed: must be 0..{CARD_MILLI} per card")
        if self.memory_mib < 0:
            raise ValueError(f"tenant {self.key!r}: memory_mib={self.memory_mib} is not allowed: must be >= 0")


@dataclass(frozen=True)
class Usage:
    """What a tenant used over the last tick: mean compute (milli of the card) and memory held."""

    used_milli: float
    memory_mib: int = 0


@dataclass(frozen=True)
class ControlParams:
    """Tuning of the law; the defaults suit a 50 ms tick.

    window_s: credit a tenant may save, in seconds of its own rate (the burst a capped tenant may
    take after idling). Larger windows smooth jitter, smaller ones fall back faster.
    max_debt_s: debt floor in seconds of a whole card, so one bad sample cannot hold a tenant for long.
    busy_milli / activity_tau_s: a tenant is busy when its smoothed use exceeds busy_milli;
    tau sets how long a tenant stays busy after it stops (the hysteresis offline work waits out).
    offline_floor_milli: what offline tenants may still use while online work is busy.
    """

    window_s: float = 0.1
    max_debt_s: float = 1.0
    busy_milli: float = 20.0
    activity_tau_s: float = 0.2
    offline_floor_milli: float = 0.0

    def __post_init__(self) -> None:
        for name in ("window_s", "max_debt_s", "activity_tau_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ControlParams.{name}: {getattr(self, name)!r} is not allowed: must be > 0")
        for name in ("busy_milli", "offline_floor_milli"):
            if not 0 <= getattr(self, name) <= CARD_MILLI:
                raise ValueError(f"ControlParams.{name}: {getattr(self, name)!r} is not allowed: must be 0..{CARD_MILLI}")


@dataclass(frozen=True)
class TenantState:
    bucket: float = 0.0
    activity: float = 0.0
    held: bool = False
    scheduled: bool = False  # given the last tick's time slot


@dataclass(frozen=True)
class CardState:
    """The controller's memory between ticks, keyed by tenant; tenants that left are dropped."""

    tenants: Mapping[str, TenantState] = field(default_factory=dict)

    def of(self, key: str) -> TenantState:
        return self.tenants.get(key, TenantState())


@dataclass(frozen=True)
class Verdict:
    """Run or hold a tenant for the next tick. ``rate_milli`` None means unlimited."""

    key: str
    run: bool
    rate_milli: float | None
    reason: str


def _busy(state: TenantState, params: ControlParams) -> bool:
    # A held tenant is busy by construction: only tenants that consumed are ever held.
    return state.held or state.activity > params.busy_milli


def allowance_rates(
    policy: Policy,
    tenants: Sequence[Tenant],
    busy: Mapping[str, bool],
    activity: Mapping[str, float],
    params: ControlParams,
) -> dict[str, tuple[float | None, str]]:
    """Each tenant's allowance rate (milli of the card, None = unlimited) and the reason for it.

    A normal-class tenant that reserved no compute (``core_milli`` 0: HAMi's ``gpumem`` without
    ``gpucores``, KAI's ``gpu-fraction``, T9k's percent, memory-only claims) runs unlimited while
    no tenant that reserved a share is busy; while some are, the unreserved tenants share only what
    the busy shares leave (the card less their shares), so a share that was booked and charged is
    never diluted by tenants that booked none. Before, seven such tenants cut a busy 500-milli
    share to 63 milli under fixed-share."""
    online_busy = any(busy[t.key] for t in tenants if t.klass is not AppClass.OFFLINE)
    yielding = {t.key for t in tenants if t.klass is AppClass.OFFLINE and online_busy}
    unreserved = [t for t in tenants if t.klass is AppClass.NORMAL and t.core_milli == 0 and t.key not in yielding]
    reserved_busy = sum(float(t.core_milli) for t in tenants if t.core_milli and busy[t.key] and t.key not in yielding)

    rates: dict[str, tuple[float | None, str]] = {}
    for t in tenants:
        if t.key in yielding:
            rates[t.key] = (params.offline_floor_milli, "offline: online work is busy")
        elif policy is Policy.BEST_EFFORT or t.core_milli == 0:
            rates[t.key] = (None, "unlimited")
        else:
            rates[t.key] = (float(t.core_milli), "share")
    if policy is not Policy.BEST_EFFORT and unreserved and reserved_busy > 0:
        left = max(0.0, CARD_MILLI - reserved_busy)
        sharing = max(1, sum(1 for t in unreserved if busy[t.key]))
        for t in unreserved:
            rates[t.key] = (left / sharing, "no share reserved: what busy shares leave")
    if policy is not Policy.BURST_SHARE:
        return rates

    # Capacity no busy tenant has a claim on: busy capped tenants claim their share, busy
    # uncapped ones (online) what they were seen using.
    claimed = 0.0
    for t in tenants:
        if t.key in yielding or not busy[t.key]:
            continue
        claimed += t.core_milli if t.core_milli else activity[t.key]
    spare = max(0.0, CARD_MILLI - claimed)
    borrowers = [t for t in tenants if t.key not in yielding and t.core_milli and busy[t.key]]
    weight = sum(t.core_milli for t in borrowers)
    for t in tenants:
        rate, _ = rates[t.key]
        if rate is None or t.key in yielding or not t.core_milli:
            continue
        if t in borrowers:
            extra = spare * t.core_milli / weight
        else:
            extra = spare  # idle now; when it wakes it is counted as a borrower next tick
        rates[t.key] = (min(float(CARD_MILLI), rate + extra), "share + idle capacity" if extra > 0 else "share")
    return rates


def step(
    policy: Policy,
    params: ControlParams,
    tenants: Sequence[Tenant],
    usage: Mapping[str, Usage],
    state: CardState,
    dt_s: float,
) -> tuple[CardState, tuple[Verdict, ...]]:
    """Advance one card's controller by ``dt_s`` seconds of measured ``usage``.

    Tenants missing from ``usage`` used nothing. A negative use is a refund (a later sample showed an
    earlier estimate too high): it credits the bucket but never counts as activity. Returns the new
    state and one verdict per tenant, in the order given.
    """
    if not dt_s > 0:
        raise ValueError(f"dt_s: {dt_s!r} is not allowed: must be > 0")
    keys = [t.key for t in tenants]
    if len(set(keys)) != len(keys):
        raise ValueError(f"tenants: keys {keys} are not allowed: each tenant key must appear once per card")

    decay = 1.0 - math.exp(-dt_s / params.activity_tau_s)
    used = {t.key: float(usage[t.key].used_milli) if t.key in usage else 0.0 for t in tenants}
    activity: dict[str, float] = {}
    busy: dict[str, bool] = {}
    for t in tenants:
        old = state.of(t.key)
        activity[t.key] = old.activity + (max(0.0, used[t.key]) - old.activity) * decay
        busy[t.key] = _busy(TenantState(old.bucket, activity[t.key], old.held), params)

    rates = allowance_rates(policy, tenants, busy, activity, params)
    floor = -params.max_debt_s * CARD_MILLI
    buckets: dict[str, float] = {}
    for t in tenants:
        rate, _ = rates[t.key]
        if rate is None:
            continue
        old = state.of(t.key)
        # A tenant given the card's time slot pays for the slot, used or not: that is what makes
        # time division exact. Anything measured beyond it (queued work draining while held) is
        # charged as measured.
        charge = max(float(CARD_MILLI), used[t.key]) if old.scheduled else used[t.key]
        cap = rate * params.window_s
        buckets[t.key] = min(cap, max(floor, min(old.bucket, cap) + (rate - charge) * dt_s))

    # Time division among capped tenants: the busy one owed the most (bucket relative to its rate)
    # gets the next tick, alone, so overlapping tenants never split a slot (which would shortchange
    # both). Idle tenants are left alone; an unlimited tenant always runs.
    contenders = [t for t in tenants if rates[t.key][0] is not None and rates[t.key][0] > 0 and busy[t.key]]
    eligible = [t for t in contenders if buckets[t.key] >= 0]
    chosen = max(eligible, key=lambda t: (buckets[t.key] / rates[t.key][0], t.key), default=None)

    new_states: dict[str, TenantState] = {}
    verdicts: list[Verdict] = []
    for t in tenants:
        rate, reason = rates[t.key]
        if rate is None:
            new_states[t.key] = TenantState(0.0, activity[t.key], False, False)
            verdicts.append(Verdict(t.key, True, None, reason))
            continue
        bucket = buckets[t.key]
        if rate == 0:
            run, scheduled = False, False
        elif chosen is not None and t.key == chosen.key:
            run, scheduled = True, True
        elif busy[t.key]:
            run, scheduled = False, False
            reason = f"{reason}; holding to repay {-bucket:.1f} milli-card-seconds" if bucket < 0 else f"{reason}; waiting for its time slot"
        else:
            run, scheduled = True, False  # idle: nothing to throttle; measured and charged if it wakes
        new_states[t.key] = TenantState(bucket, activity[t.key], not run, scheduled)
        verdicts.append(Verdict(t.key, run, rate, reason))
    return CardState(new_states), tuple(verdicts)
