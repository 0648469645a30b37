"""Bash's glob patterns (`case`, `[[ == ]]`, `${v#pat}`, `${v//pat/x}`) as regular expressions."""

from __future__ import annotations

import re


def glob_regex(pieces: list[tuple[str, bool]]) -> str:
    """Translate a glob pattern (unquoted `*`, `?`, `[...]` special; quoted text literal) to a regex."""
    out: list[str] = []
    for text, quoted in pieces:
        if quoted:
            out.append(re.escape(text))
            continue
        i = 0
        while i < len(text):
            char = text[i]
            if char == "*":
                out.append(".*")
            elif char == "?":
                out.append(".")
            elif char == "[" and "]" in text[i + 2 :] + text[i + 1 : i + 2]:
                end = text.index("]", i + 2 if text[i + 1 : i + 2] in ("]", "!", "^") else i + 1)
                body = text[i + 1 : end]
                if body.startswith(("!", "^")):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
            elif char == "\\" and i + 1 < len(text):
                i += 1
                out.append(re.escape(text[i]))
            else:
                out.append(re.escape(char))
            i += 1
    return "".join(out)
