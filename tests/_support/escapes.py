"""Rank 0 writes a colour, then escape sequences a terminal would act on, as raw bytes."""

import os
import sys

if os.environ["RANK"] == "0":
    out = sys.stdout.buffer
    out.write(b"\x1b[31mred\x1b[0m plain\n")
    out.write(b"clip \x1b]52;c;aGVsbG8=\x07 title \x1b]0;pwned\x07 clear \x1b[2J\x1b[H end\n")
    out.write(b"bell \x07 cr \r back \x08 c1 \x9b31m done\n")
    out.flush()
