"""The rule every stage applies to a caller's request id: printable, at most MAX_REQUEST_ID_CHARS.

Ids reach logs, metrics exemplars and error messages, so one bound (and no control characters)
holds from the public API (gateway, OpenAI front) down to the stages that take one (the talker).
"""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 256


def valid_request_id(request_id: str) -> bool:
    """True when `request_id` is printable and at most MAX_REQUEST_ID_CHARS long ("" is valid: unset)."""
    return len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()
