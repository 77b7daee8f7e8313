"""Text the perf tables print, kept to the labs' width: a line longer than 100 characters is
broken at spaces, its continuation lines indented."""
from __future__ import annotations

import textwrap

WIDTH = 100


def fit(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """Each line of ``text`` as it is when it fits in ``width`` characters, else broken at
    spaces, the continuation lines indented ``indent`` past the line's own indent."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        own = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(line, width, subsequent_indent=own + indent,
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)
