"""The one spelling of a refused value, shared by every policy module."""

from __future__ import annotations

from typing import Any


def field_error(field: str, value: Any, accepted: str, why: str = "") -> ValueError:
    """ValueError "<field>=<value> is not valid (<why>); accepted: <accepted>"."""
    why = f" ({why})" if why else ""
    return ValueError(f"{field}={value!r} is not valid{why}; accepted: {accepted}")
