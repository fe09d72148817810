"""What every config section's `validate` uses: the error type and the checks that raise it with the key named."""
from __future__ import annotations

import ipaddress
import re


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, f"got {value!r}, allowed: {', '.join(allowed)}")


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")


def _is_host(value: str) -> bool:
    """An IP address or a DNS host name: no scheme, no port."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(value) is not None
