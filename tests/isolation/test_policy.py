import pytest

from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy, parse_policy, policy_of_node


@pytest.mark.parametrize("raw,expected", [
    ("best-effort", Policy.BEST_EFFORT), ("be", Policy.BEST_EFFORT),
    ("fixed-share", Policy.FIXED_SHARE), ("FS", Policy.FIXED_SHARE),
    ("burst-share", Policy.BURST_SHARE), (" bs ", Policy.BURST_SHARE),
])
def test_full_names_and_qgpu_aliases_are_accepted(raw, expected):
    assert parse_policy(raw) is expected


def test_node_without_the_label_is_best_effort():
    assert policy_of_node({"kubernetes.io/hostname": "n1"}) is Policy.BEST_EFFORT


def test_node_label_chooses_the_policy():
    assert policy_of_node({POLICY_LABEL: "fs"}) is Policy.FIXED_SHARE


def test_unknown_label_value_names_the_label_the_value_and_the_choices():
    with pytest.raises(ValueError) as err:
        policy_of_node({POLICY_LABEL: "strict"})
    assert POLICY_LABEL in str(err.value) and "'strict'" in str(err.value) and "burst-share" in str(err.value)
