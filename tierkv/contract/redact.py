"""Keep secrets out of logs, reprs, error messages and serialized configs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

SECRET_FIELD_WORDS = ("password", "secret", "token", "credential", "passphrase")
"""A config field whose name contains one of these holds a secret."""

MASK = "***"

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s'\"@:/]*):[^\s'\"@]*@")
"""`scheme://user:password@`; the password may hold `/` or `+` (AWS secret keys do)."""


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (host, port, path and query kept)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def redact_text(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` in it masked: for
    messages that may quote a URL (a plugin's own validation error, for one)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)


def is_secret_field(name: str) -> bool:
    """Whether a config field of this name holds a secret."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_FIELD_WORDS)


def mask_secrets(data: Any) -> Any:
    """A copy of serialized config data (dicts, lists, scalars) with the values of
    secret fields replaced by `***` and passwords in URLs masked."""
    if isinstance(data, Mapping):
        return {
            key: (
                MASK
                if isinstance(key, str) and is_secret_field(key) and data[key] is not None
                else mask_secrets(data[key])
            )
            for key in data
        }
    if isinstance(data, (list, tuple)):
        return type(data)(mask_secrets(v) for v in data)
    if isinstance(data, str):
        return redact_text(data)
    return data
