"""The operator's own middleware (vLLM's ``--middleware``): each an import path, ``module.name``,
of an ASGI middleware class (built as ``cls(app)``) or of an ``async def f(request,
call_next)`` function, as Starlette's ``BaseHTTPMiddleware`` calls one. They wrap the whole
server, outside its CORS, API-key and size checks, the first given outermost, as vLLM adds
them; a path that does not resolve to either stops the start."""

from __future__ import annotations

import importlib
import inspect

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware


def user_middleware(path: str) -> Middleware:
    """The middleware at ``path``; a ValueError naming the flag if there is none."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {path}: cannot import it ({exc})") from None
    if inspect.isclass(found):
        return Middleware(found)
    if inspect.iscoroutinefunction(found):
        return Middleware(BaseHTTPMiddleware, dispatch=found)
    raise ValueError(f"--middleware {path}: not an ASGI middleware class nor an async function "
                     f"of (request, call_next)")
