"""The quantity parser: the apiserver's grammar, and a bound on work whatever the input."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgpu_runtime.model import CardLimits, RequestError, parse_pod
from qgpu_runtime.model.quantity import MAX_QUANTITY_CHARS, QUANTITY_LIMIT, QuantityError, parse_quantity

CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"

# Written from the BNF in k8s.io/apimachinery/pkg/api/resource/quantity.go, independently of
# the parser's own pattern.
APISERVER_GRAMMAR = re.compile(
    r"[+-]?([0-9]+|[0-9]+\.[0-9]+|[0-9]+\.|\.[0-9]+)"
    r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
)
HUGE = "1e600000000"  # as an int this has 600 million digits: converting it would never finish


def pod(limits):
    return {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


def problems(limits):
    with pytest.raises(RequestError) as info:
        parse_pod(pod(limits), CardLimits())
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize("text,value", [
    ("30", 30), ("+30", 30), ("-3", -3), ("1.5", Decimal("1.5")), ("1.", 1), (".5", Decimal("0.5")),
    ("500m", Decimal("0.5")), ("1k", 1000), ("1Ki", 1024), ("1Gi", 2**30), ("1Ei", 2**60),
    ("1e3", 1000), ("1E+3", 1000), ("15e-1", Decimal("1.5")), ("0e600000000", 0), ("1n", Decimal("1e-9")),
])
def test_grammar_forms_parse_exactly(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", [
    "NaN", "Infinity", "inf", "５０", "5_0", " 5", "5 ", "5\n", "", "+", ".", "k", "1e", "1e1.5", "0x10", "1KI", "1ki", "1Kib",
])
def test_forms_outside_the_apiserver_grammar_are_refused_with_the_grammar(text):
    with pytest.raises(QuantityError) as info:
        parse_quantity(text)
    assert info.value.rule.startswith("not a quantity: <sign>?<digits>")


def test_a_huge_exponent_is_refused_before_any_conversion():
    with pytest.raises(QuantityError) as info:
        parse_quantity(HUGE)
    assert info.value.rule == f"too large: a quantity may be at most {QUANTITY_LIMIT}"


def test_a_huge_binary_quantity_is_refused():
    with pytest.raises(QuantityError, match="too large"):
        parse_quantity("9" * 40 + "Ei")


def test_a_huge_json_integer_is_refused_without_printing_it():
    with pytest.raises(QuantityError) as info:
        parse_quantity(10**100000)
    assert info.value.shown == f"an integer of {(10**100000).bit_length()} bits"


def test_a_long_text_is_refused_unread_and_shown_truncated():
    with pytest.raises(QuantityError) as info:
        parse_quantity("1" * 1_000_000)
    assert info.value.rule == f"too long: a quantity has at most {MAX_QUANTITY_CHARS} characters"
    assert info.value.shown == "1" * 40 + "... (1000000 characters)"


def test_a_float_is_refused_as_not_a_string():
    with pytest.raises(QuantityError, match="not a quantity: a float; must be a string"):
        parse_quantity(float("nan"))


def test_a_huge_gpu_request_names_field_value_and_limit():
    assert problems({CORE: HUGE, MEM: "2"}) == [
        f"container 'main': {CORE}={HUGE}: too large: a quantity may be at most {QUANTITY_LIMIT}; "
        "qgpu-core is percent of one card: 1-99, or a multiple of 100"
    ]


def test_full_width_digits_in_a_gpu_request_are_refused():
    assert problems({CORE: "５０", MEM: "2"}) == [
        f"container 'main': {CORE}=５０: not a quantity: <sign>?<digits>[.<digits>] with ASCII digits, then one of "
        "Ki Mi Gi Ti Pi Ei, n u m k M G T P E, e<int> E<int>, or nothing; qgpu-core is percent of one card: 1-99, or a multiple of 100"
    ]


def test_a_fraction_by_exponent_is_refused_where_integers_are_required():
    (message,) = problems({CORE: "5e-1", MEM: "2"})
    assert "=5e-1: fractions are not allowed" in message


quantity_like = st.text(alphabet="0123456789+-.eEKMGTPEinumk ５_", max_size=30)


@settings(max_examples=500, deadline=None)
@given(st.one_of(quantity_like, st.text(max_size=30), st.integers()))
def test_any_input_is_bounded_or_refused_and_agrees_with_the_grammar(raw):
    try:
        value = parse_quantity(raw)
    except QuantityError as exc:
        if isinstance(raw, str) and APISERVER_GRAMMAR.fullmatch(raw):
            assert exc.rule.startswith(("too large", "too long", "exponent out of range"))
        return
    assert abs(value) <= QUANTITY_LIMIT
    assert isinstance(raw, int) or APISERVER_GRAMMAR.fullmatch(raw)


@settings(max_examples=200, deadline=None)
@given(mantissa=st.from_regex(r"[0-9]{1,20}(\.[0-9]{0,20})?", fullmatch=True),
       exponent=st.integers(-(10**12), 10**12))
def test_any_exponent_is_decided_from_the_text(mantissa, exponent):
    """Exponents up to a trillion: were any of these converted, the test would never end."""
    try:
        value = parse_quantity(f"{mantissa}e{exponent}")
    except QuantityError:
        return
    assert abs(value) <= QUANTITY_LIMIT
