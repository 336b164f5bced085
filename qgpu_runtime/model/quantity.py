"""Kubernetes quantities ("30", "500m", "1Gi", "1e3"), parsed with bounded work.

The apiserver stores a quantity such as ``1e600000`` as given, and turning that into an integer
costs time quadratic in its digits while holding the GIL: one pod could freeze the webhook, the
extender, ``qgpu validate`` and the node manager alike. So the magnitude is read from the text
(digit count and exponent) and anything above :data:`QUANTITY_LIMIT` is refused before any
number is built; what is built afterwards is at most a few dozen digits.

The accepted text is the documented grammar of k8s.io/apimachinery/pkg/api/resource
(quantity.go)::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>
    <sign>            ::= "+" | "-"
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <digit>           ::= 0 | 1 | ... | 9          (ASCII only)
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <sign>?<digits> | "E" <sign>?<digits>

It is a subset of what ``ParseQuantity`` takes (that also reads "+", "." and "k" as zero), so
nothing is accepted here that the apiserver refuses. Python's own number parsers are not used:
they take "NaN", "Infinity", "5_0" and full-width digits, none of which Kubernetes does.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal
from typing import Any

QUANTITY_LIMIT = 2**63 - 1
"""The largest magnitude accepted, in base units: Kubernetes' own int64 cap (BinarySI values are
clamped to it). No GPU, node or container quantity comes near it."""

MAX_QUANTITY_CHARS = 64
"""Longer text is refused unread; the apiserver's canonical form of any real amount is far
shorter, and the bound keeps every later step a few dozen digits wide."""

MAX_EXPONENT = 100
"""``e`` exponents beyond ±100 are refused: their values are either far above the limit or
far below the nano unit the apiserver rounds to."""

GRAMMAR = "<sign>?<digits>[.<digits>] with ASCII digits, then one of Ki Mi Gi Ti Pi Ei, n u m k M G T P E, e<int> E<int>, or nothing"

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<decimal>[numkMGTPE])|[eE](?P<exp>[+-]?[0-9]+))?"
)
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_POWER = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SHOWN_CHARS = 40
_EXACT = Context(prec=2 * MAX_QUANTITY_CHARS + 20)  # wide enough that no bounded value is rounded


class QuantityError(ValueError):
    """A value that is not a Kubernetes quantity, or one too large to be any real amount.

    ``rule`` is the sentence a user needs (the grammar, or the limit); ``shown`` the value as it
    may be echoed back (truncated when huge).
    """

    def __init__(self, value: Any, rule: str):
        self.shown = show_value(value)
        self.rule = rule
        super().__init__(f"{self.shown}: {rule}")


def show_value(value: Any) -> str:
    """``value`` as text for an error message, cut to a readable length: a megabyte of digits
    must not come back in every log line and API response. A huge int is described, not
    printed: writing out its digits is itself quadratic."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _too_large(value: Any) -> QuantityError:
    return QuantityError(value, f"too large: a quantity may be at most {QUANTITY_LIMIT}")


def parse_quantity(value: Any) -> Decimal:
    """``value`` (quantity text, or a JSON integer as the apiserver also takes) as an exact
    Decimal whose magnitude is at most :data:`QUANTITY_LIMIT`; else :class:`QuantityError`.

    Work is bounded by :data:`MAX_QUANTITY_CHARS` whatever the input: the magnitude is decided
    from the digit count and the suffix before any arithmetic.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > QUANTITY_LIMIT:  # a comparison; no conversion of the int to text
            raise _too_large(value)
        return Decimal(value)
    if not isinstance(value, str):
        raise QuantityError(value, f"not a quantity: a {type(value).__name__}; must be a string: {GRAMMAR}")
    if len(value) > MAX_QUANTITY_CHARS:
        raise QuantityError(value, f"too long: a quantity has at most {MAX_QUANTITY_CHARS} characters")
    match = _QUANTITY.fullmatch(value)
    frac = match and match["frac"]
    if match is None or not (match["int"] or frac):
        raise QuantityError(value, f"not a quantity: {GRAMMAR}")
    digits = match["int"] + (frac or "")
    significant = digits.lstrip("0")
    if not significant:
        return Decimal(0)
    exponent = -len(frac or "")
    power_of_two = 0
    if match["binary"]:
        power_of_two = _BINARY_POWER[match["binary"]]
    elif match["decimal"]:
        exponent += _DECIMAL_EXPONENT[match["decimal"]]
    elif match["exp"]:
        stated = int(match["exp"])  # at most 64 characters: cheap
        if abs(stated) > MAX_EXPONENT:
            if stated > 0:
                raise _too_large(value)
            raise QuantityError(value, f"exponent out of range: at most {MAX_EXPONENT} either way")
        exponent += stated
    # The value is below 10**(len(significant) + exponent) * 2**power_of_two; 2**60 < 10**19.
    if len(significant) + exponent + (19 if power_of_two else 0) > 40:
        raise _too_large(value)
    number = _EXACT.multiply(Decimal(f"{match['sign']}{significant}e{exponent}"), 2**power_of_two)
    if abs(number) > QUANTITY_LIMIT:
        raise _too_large(value)
    return number
