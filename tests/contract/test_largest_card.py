"""The largest card every component's parser admits (contract/largestcard.py): one bound on the
operator's value, and a setting that only raises the default's 80 GiB."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.largestcard import card_limits, largest_card_problem
from qgpu_runtime.model.requests import DEFAULT_LIMITS


def test_no_setting_keeps_the_default_limits():
    assert card_limits(None) is DEFAULT_LIMITS


def test_a_larger_card_raises_only_the_largest_card():
    limits = card_limits(143771)
    assert limits.max_card_memory_mib == 143771
    assert (limits.gib_per_shared_pod, limits.min_shared_memory_mib, limits.max_cards_per_node) == (
        DEFAULT_LIMITS.gib_per_shared_pod, DEFAULT_LIMITS.min_shared_memory_mib, DEFAULT_LIMITS.max_cards_per_node)


def test_a_smaller_card_keeps_the_default_bound():
    """Below 80 GiB the setting refuses nothing a cluster without it admits."""
    assert card_limits(16384) == DEFAULT_LIMITS


@pytest.mark.parametrize("value", [0, -1, 1023, 1048577, True, "143771"])
def test_a_value_out_of_bounds_is_refused_naming_the_flag_value_and_rule(value):
    message = f"--largest-card-memory-mib {value}: must be within 1024..1048576 (MiB, a card of 1 GiB to 1 TiB)"
    assert largest_card_problem(value) == message
    with pytest.raises(ValueError) as info:
        card_limits(value)
    assert str(info.value) == message


@pytest.mark.parametrize("value", [1024, 81920, 1048576])
def test_the_bounds_themselves_are_allowed(value):
    assert largest_card_problem(value) is None
