"""User code named by a dotted path (`task.reward_fn`, `task.environment`): imported once, with errors that name the
setting, the path and what went wrong."""
from __future__ import annotations

import importlib
from typing import Any


def import_callable(dotted: str, setting: str, error: type[Exception], expected: str) -> Any:
    """The callable `package.module.name` names; `error(message)` when the path is malformed, the module does not
    import, or the name is missing or not callable. `expected` shows the path's form, e.g. 'package.module.function'."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise error(f"{setting} {dotted!r}: expected a dotted path {expected!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise error(f"{setting} {dotted!r}: cannot import module {module_name!r} "
                    f"({type(exc).__name__}: {exc})") from None
    found = getattr(module, attr, None)
    if found is None:
        raise error(f"{setting} {dotted!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(found):
        raise error(f"{setting} {dotted!r}: {attr!r} is a {type(found).__name__}, not a callable")
    return found
