"""Checks of command-line values every component spells the same way: Kubernetes object names,
listen addresses and log levels. Each returns why a value is refused, naming the flag, the value
(cut to a readable length) and the rule, or None; the caller prints it and exits non-zero."""

from __future__ import annotations

import re
import socket

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""RFC 1123 label: a namespace's name (at most 63 characters)."""
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""RFC 1123 subdomain: a node's or a scheduler's name (at most 253 characters)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SHOWN_CHARS = 64


def shown(value: object) -> str:
    """``value`` as a message quotes it: repr, cut to :data:`SHOWN_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"… ({len(str(value))} characters)"


def subdomain_problem(flag: str, value: str, what: str) -> str | None:
    if DNS_SUBDOMAIN.fullmatch(value or ""):
        return None
    return (f"{flag} {shown(value)}: must be {what}: a DNS subdomain (lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters)")


def label_problem(flag: str, value: str, what: str) -> str | None:
    if DNS_LABEL.fullmatch(value or ""):
        return None
    return f"{flag} {shown(value)}: must be {what} (lowercase letters, digits and '-', at most 63 characters)"


MAX_NAME_CHARS = 253
"""The longest free-form name a flag takes (a job's, a binder's, a standalone host's): a
Kubernetes object name's limit, so the same thing may be named both ways."""


def printable_problem(flag: str, value: str | None, limit: int = MAX_NAME_CHARS) -> str | None:
    """A free-form name printed in tables, logs and Lease documents: 1..``limit`` printable
    characters (a newline would forge a second row or log line, an empty name says nothing)."""
    if value is not None and 1 <= len(value) <= limit and value.isprintable():
        return None
    return f"{flag} {shown(value)}: must have 1..{limit} printable characters (no newline or control character)"


def log_level_problem(flag: str, value: str) -> str | None:
    if str(value).upper() in LOG_LEVELS:
        return None
    return f"{flag} {shown(value)}: not a level: use one of {', '.join(LOG_LEVELS)}"


def address_problem(flag: str, address: str) -> str | None:
    """A listen address that cannot be resolved (``999.1.1.1``, an empty string: all interfaces,
    which the default says explicitly as 0.0.0.0) is refused before anything starts."""
    if not address:
        return f"{flag} '': must be an IP address or host name to listen on (0.0.0.0 for all interfaces)"
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as exc:
        return f"{flag} {shown(address)}: not an address to listen on ({getattr(exc, 'strerror', None) or exc})"
    return None


def port_problem(flag: str, port: int, disabled: int | None = None) -> str | None:
    """A TCP port 1..65535 (or ``disabled``, the value that turns the listener off)."""
    if 1 <= port <= 65535 or (disabled is not None and port == disabled):
        return None
    return f"{flag} {port}: must be a port 1..65535" + (f", or {disabled} for none" if disabled is not None else "")


def int_within(low: int, high: int, unit: str):
    """An argparse ``type``: an integer within ``low..high`` (``unit`` says what it counts), or
    argparse's error naming the option, with the value and the rule."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text.strip()) <= 20 else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{shown(text)}: must be an integer within {low}..{high} ({unit})")
        return value
    return parse


def read_small_text(source, limit: int, where: str, what: str) -> str:
    """The UTF-8 text of the file an option names (a path, or a binary stream such as stdin's), at
    most ``limit`` bytes read (``/dev/zero`` never ends); ValueError naming ``where`` (the option
    and the file) and the rule otherwise."""
    try:
        if hasattr(source, "read"):
            raw = source.read(limit + 1)
        else:
            with open(source, "rb") as handle:
                raw = handle.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise ValueError(f"{where}: larger than {limit} bytes; not {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                         "a binary file?") from None
