"""Mask secrets by name and by value in anything shown to a person (config, error lines).

A secret can live in:
    a key or header named like one   api_token, X-Api-Key, X-Auth-Token, X-Signing-Key
    a URL's userinfo                 postgresql://app:PASSWORD@db/tw, https://u:PW@hook
    a URL's query parameters         ?password=..., ?sslpassword=..., ?token=...
and, once known, its value can reappear anywhere (an error message quoting a URL or a
header). `Masker.from_settings(settings)` collects every secret value; `Masker.text()`
hides them all, plus any URL userinfo or secret-named query parameter it sees, and never
echoes a URL it cannot parse.

Example:
    masker = Masker.from_settings(settings)
    click.echo(masker.text(str(exc)))
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

MASK = "**********"
URL_MASK = "***"  # inside URLs, as SQLAlchemy renders a hidden password
UNPARSABLE_URL = "<unparsable URL hidden>"
# Whole words of a name split on '-', '_', '.', or camelCase: "max_new_tokens" is no secret.
_SECRET_WORDS = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "secret", "token", "apikey",
    "authorization", "auth", "credential", "credentials", "signature", "sig", "cookie",
    "session", "private", "privatekey", "key", "sslpassword", "sslkey",
})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
# A URL-looking run in free text: a scheme, "://", then up to whitespace or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")
_MIN_SECRET_LEN = 3  # shorter values would mask ordinary words


def is_secret_name(name: str) -> bool:
    """Return whether a key, header or query parameter name says it holds a secret."""
    words = [w.lower() for w in _WORD.findall(name)]
    joined = "".join(words)
    return any(w in _SECRET_WORDS for w in words) or joined in _SECRET_WORDS


def mask_url(url: str) -> str:
    """Return `url` with its userinfo password and secret-named query values masked.

    A string that does not parse as a URL is replaced whole: it may be a URL with a
    password in a place the parser cannot find.
    """
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a malformed port
    except ValueError:
        return UNPARSABLE_URL
    if not parts.scheme or "://" not in url:
        return UNPARSABLE_URL  # "user:pw@host/db" would parse with the password as a path
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{URL_MASK}@{host}" if ":" in userinfo else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, URL_MASK if is_secret_name(k) and v else v) for k, v in pairs],
                          safe="*", quote_via=quote)
    # Built by hand: urlunsplit drops the empty authority of sqlite:///path.
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


def mask_webhook_url(url: str) -> str:
    """Return scheme, host and port only: Slack-style hooks carry their secret in the path."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return UNPARSABLE_URL
    if not parts.scheme or not parts.hostname:
        return UNPARSABLE_URL
    hidden = "/" + URL_MASK if parts.path.strip("/") or parts.query else ""
    return f"{parts.scheme}://{parts.hostname}{port}{hidden}"


def url_secrets(url: str) -> set[str]:
    """Return the secret values inside `url` (userinfo password, secret query values)."""
    out: set[str] = set()
    try:
        parts = urlsplit(url)
    except ValueError:
        return out
    if parts.password:
        out |= {parts.password, unquote(parts.password)}
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if is_secret_name(k) and v:
            out |= {v, quote(v, safe="")}
    return out


def _collect(value: Any, key: str, out: set[str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _collect(v, str(k), out)
    elif isinstance(value, list | tuple):
        for v in value:
            _collect(v, key, out)
    elif isinstance(value, str) and value:
        if is_secret_name(key):
            out.add(value)
        if "://" in value:
            out |= url_secrets(value)


@dataclass(frozen=True)
class Masker:
    """Hide known secret values, URL userinfo and secret query values in text and data."""

    values: frozenset[str] = frozenset()

    @classmethod
    def from_data(cls, data: Any) -> Masker:
        """Return a masker knowing every secret value found in `data` (plain dicts/lists)."""
        found: set[str] = set()
        _collect(data, "", found)
        return cls(frozenset(v for v in found if len(v) >= _MIN_SECRET_LEN))

    @classmethod
    def from_settings(cls, settings: Any) -> Masker:
        """Return a masker for a monitor.settings.Settings (secret strings revealed to find them)."""
        data = settings.model_dump(mode="python")
        return cls.from_data(_reveal(data))

    def text(self, text: str) -> str:
        """Return `text` with every URL masked and every known secret value replaced."""
        out = _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), text)
        # Longest first: a secret that contains another is replaced whole.
        for v in sorted(self.values, key=len, reverse=True):
            out = out.replace(v, MASK)
        return out

    def data(self, value: Any, key: str = "") -> Any:
        """Return plain data with secret-named values, URL secrets and known values masked."""
        if isinstance(value, Mapping):
            return {k: self.data(v, str(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v, key) for v in value]
        if isinstance(value, str) and value and is_secret_name(key):
            return MASK
        if isinstance(value, str) and value and key == "url":  # a webhook target
            return mask_webhook_url(value)
        if isinstance(value, str) and value and key.endswith("_url"):
            return self.text(mask_url(value))
        if isinstance(value, str):
            return self.text(value)
        return value


def _reveal(value: Any) -> Any:
    # pydantic SecretStr dumps as a mask in python mode: read the real value to find it.
    get = getattr(value, "get_secret_value", None)
    if get is not None:
        return get()
    if isinstance(value, Mapping):
        return {k: _reveal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_reveal(v) for v in value]
    return value
