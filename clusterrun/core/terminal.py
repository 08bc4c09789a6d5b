"""Text from the hosts made safe for a terminal: colours pass, every other control is shown escaped.

A rank's output may carry escape sequences that a terminal would act on: clear the screen, move
the cursor, set the window title, write the clipboard (OSC 52), or make the terminal answer back.
``safe`` keeps SGR sequences (``ESC [ ... m``, colours and text attributes) when colour is on and
drops them when it is off; every other C0 control but tab and newline, DEL, and C1 controls
(U+0080-U+009F, and the bytes 0x80-0x9F that are not UTF-8, which ``surrogateescape`` carries as
U+DC80-U+DC9F) is replaced by its escaped text (``\\x1b``, ``\\r``, ``\\x9b``): shown, never
interpreted. Text without any of them is returned as it is (a scan in C).

Colour is on for a terminal unless ``NO_COLOR`` is set (https://no-color.org) or ``TERM=dumb``.
This module imports nothing of the package.
"""

from __future__ import annotations

import os
import re
from typing import TextIO

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\udc80-\udc9f]")
# An SGR sequence, or one control character (its escape sequence, if any, then shows as text).
_TOKEN = re.compile("(\x1b\\[[0-9;:]*m)|[\x00-\x08\x0b-\x1f\x7f-\x9f\udc80-\udc9f]")
_NAMES = {"\r": "\\r", "\x1b": "\\x1b"}
# The bytes ASCII text may hold as they are: tab, newline and the printable ones. ``bytes.translate``
# deleting them leaves a chunk's controls: a scan in C ~10 times faster than the regular expression,
# and twice as fast as mapping every byte to a flag and looking for one.
_ASCII_KEPT = b"\t\n" + bytes(range(0x20, 0x7F))


def _escaped(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDC9F:  # an undecodable byte 0x80-0x9F
        code -= 0xDC00
    return _NAMES.get(char) or f"\\x{code:02x}"


def _keep_sgr(match: re.Match[str]) -> str:
    return match.group(1) or _escaped(match.group())


def _drop_sgr(match: re.Match[str]) -> str:
    return "" if match.group(1) else _escaped(match.group())


def safe(text: str, colour: bool = True) -> str:
    """``text`` with SGR kept (``colour``) or dropped, and every other control character escaped."""
    if text.isascii():
        if not text.encode("ascii").translate(None, _ASCII_KEPT):
            return text
    elif _UNSAFE.search(text) is None:
        return text
    return _TOKEN.sub(_keep_sgr if colour else _drop_sgr, text)


def colour_allowed() -> bool:
    """False when the environment asks for no colour: ``NO_COLOR`` set (not empty) or ``TERM=dumb``."""
    return not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def wants_colour(stream: TextIO) -> bool:
    """Colour for ``stream``: a terminal, and the environment does not refuse it."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and colour_allowed()
