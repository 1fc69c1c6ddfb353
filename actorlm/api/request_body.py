"""From a request body to a typed request: ``RequestDecoder``.

Three steps: a nesting limit (msgspec decodes ``Any`` fields recursively, and JSON nested a
thousand levels deep would end in a RecursionError: a 500 for the client's mistake), msgspec's
strict decode (a 400 naming the field), and one log line for each field name nobody here
knows, as vLLM does: ignored, since OpenAI adds fields all the time, but a typo such as
``tempreature`` should leave a trace.
"""

from __future__ import annotations

import logging
import re

import msgspec
import numpy as np

from actorlm.api.errors import ApiError, bad_request

log = logging.getLogger(__name__)

# an OpenAI request nests five or six levels deep; template kwargs a few more
MAX_JSON_DEPTH = 32
MAX_LOGGED_FIELDS = 1000  # clients inventing names must not grow the log set forever
_STRING = re.compile(rb'"[^"]*"')  # once the escapes are gone
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_Keys = dict[str, msgspec.Raw]


def json_depth(body: bytes) -> int:
    """How deep the body's arrays and objects nest (brackets inside strings do not count)."""
    # escapes come in pairs read left to right: drop the escaped backslashes, then the escaped
    # quotes, and no quote left is inside a string
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets, np.uint8)
    opens = (steps == ord("[")) | (steps == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1)).max())


class RequestDecoder:
    def __init__(self):
        self._logged: set[str] = set()

    def decode(self, body: bytes, type_: type):
        if not body.strip():
            raise ApiError(400, "The request body is empty; expected a JSON object")
        if json_depth(body) > MAX_JSON_DEPTH:
            raise ApiError(400, f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            request = msgspec.json.decode(body, type=type_)
        except msgspec.DecodeError as exc:
            raise bad_request(exc) from None
        if len(self._logged) < MAX_LOGGED_FIELDS:
            self._log_unknown(msgspec.json.decode(body, type=_Keys), type_)
        return request

    def _log_unknown(self, fields: dict, type_: type) -> None:
        for name in fields.keys() - set(type_.__struct_fields__) - self._logged:
            self._logged.add(name)
            log.warning("ignoring the unknown field %r of %s (logged once per name)",
                        name[:100], type_.__name__)
