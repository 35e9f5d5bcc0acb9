"""Stage 4, PII redaction: e-mail addresses, IP addresses and phone numbers become placeholders.

Replacements are `<EMAIL>`, `<IP>`, `<PHONE>` (placeholders, not fake values, so a model never learns
made-up addresses). Non-global IPs (loopback, private, documentation ranges) are kept by default:
`192.168.0.1` in a networking manual is not personal data; neither are section numbers ("6.3.2.1"),
slices ("x[1::2]") or timezone offsets ("+0900"), which the patterns alone would match. Nothing is dropped here; counts go to stats.
"""

from __future__ import annotations

import ipaddress
import re

from .config import PIIConfig

EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![\w-])")
IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){2,7}(?::|[0-9A-Fa-f]{1,4})(?![\w:])|"
                  r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){1,6}:(?:[0-9A-Fa-f]{1,4}:?){0,5}[0-9A-Fa-f]{1,4}(?![\w:])")
PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"  # +44 20 7946 0958, +86 138 ...
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"  # (555) 123-4567
    r"|\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567
    r"|1[3-9]\d{9}"  # Chinese mobile 13812345678
    r")(?![\w])")


def _looks_like_ip(text: str) -> bool:
    """Reject the look-alikes found in manuals and code: section numbers ("6.3.2.1": every octet a
    single digit) and slices or times ("x[1::2]", "12:30:45": fewer than three colons)."""
    if "." in text:
        return any(len(octet) > 1 for octet in text.split("."))
    return text.count(":") >= 3


def _ip_repl(match: re.Match, cfg: PIIConfig, counts: dict) -> str:
    text = match.group(0)
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text  # 999.1.1.1: not an address
    if not _looks_like_ip(text) or (not cfg.redact_non_global_ips and not ip.is_global):
        return text
    counts["ip"] = counts.get("ip", 0) + 1
    return "<IP>"


def _sub(pattern: re.Pattern, placeholder: str, text: str, key: str, counts: dict) -> str:
    text, n = pattern.subn(placeholder, text)
    if n:
        counts[key] = counts.get(key, 0) + n
    return text


def redact(text: str, cfg: PIIConfig, counts: dict | None = None) -> str:
    """Redact PII in `text`; add per-kind replacement counts into `counts`."""
    counts = {} if counts is None else counts
    if cfg.emails:
        text = _sub(EMAIL, "<EMAIL>", text, "email", counts)
    if cfg.ips:
        text = IPV4.sub(lambda m: _ip_repl(m, cfg, counts), text)
        text = IPV6.sub(lambda m: _ip_repl(m, cfg, counts), text)
    if cfg.phones:
        text = PHONE.sub(lambda m: _phone_repl(m, counts), text)
    return text


def _phone_repl(match: re.Match, counts: dict) -> str:
    """Phone numbers have 8-15 digits (E.164); "+0900" (a timezone) or "(+1334)" (a diff count) do not."""
    if not 8 <= sum(c.isdigit() for c in match.group(0)) <= 15:
        return match.group(0)
    counts["phone"] = counts.get("phone", 0) + 1
    return "<PHONE>"
