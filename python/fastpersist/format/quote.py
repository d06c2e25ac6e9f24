"""The one bounded repr for error messages: any value quoted from a file or from user state.

A hostile manifest (or a state with a 10 KB dict key) must not turn an error message into a
wall of text, yet the message must still name the thing. :func:`shown` keeps the start and the
end of a long repr (a key path's head says where, its tail which leaf) and says how long it was.

Example:
    >>> shown("state.w")
    "'state.w'"
    >>> text = shown("state." + "x" * 10_000 + ".w")
    >>> len(text) <= 80, text.startswith("'state.xx"), text.endswith("x.w' (10010 chars)")
    (True, True, True)
"""

from __future__ import annotations

__all__ = ["shown"]


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` in at most `limit` characters: its head and tail around ``...`` when longer.

    Never raises: an object whose repr fails (an int past ``sys.get_int_max_str_digits()``,
    a hostile ``__repr__``) is shown by its type name.

    Example:
        >>> shown(b"abc"), shown(None)
        ("b'abc'", 'None')
        >>> len(shown("x" * 1000, limit=40))
        40
    """
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    note = f" ({len(text)} chars)"
    room = max(limit - len(note) - 3, 2)
    tail = room // 3
    return text[: room - tail] + "..." + text[len(text) - tail :] + note
