"""One neutralizing function per output sink, for every string that came from a snapshot.

Snapshots come from strangers, and so do the frame names, file names, module names, provenance
and paths inside them (and every title, cause or warning that quotes them). Each renderer passes
each such string through exactly one function here before it reaches its sink:

- `terminal`: control characters (C0, DEL, C1: ESC, CSI, OSC...), bidi overrides and line
  separators are shown as visible escapes (`\\x1b`, `\\u202e`): nothing can move the cursor,
  retitle the window, plant an OSC 8 link or write the clipboard (OSC 52). rich renders our
  text with markup parsing off (registry.Screen.console), so `[link=...]` or `[/]` is text.
- `markdown`: inline text (paragraphs, headings, table cells): the terminal neutralization (a
  newline cannot end a cell or start a heading), then `<` before a tag and `&` before an
  entity as entities (no raw HTML) and a backslash before every character that Markdown would
  read as syntax where it stands, `|` included (not before `.` in `72.0 MiB` or a lone `~`).
- `markdown_span`: inline code (a rule id), delimited by a backtick run longer than any inside.
- `markdown_code`: a fenced block whose fence is longer than any run of backticks inside, so no
  line can close it.
- `html`: `html.escape`, quotes included.
JSON stays exact (orjson escapes what JSON needs).

Every function also caps the length where the string is shown (`NAME`, `FRAME`, `TEXT`), with
an ellipsis and the original length, so a report grows with what it summarizes, never with the
longest string in the input.
"""

from __future__ import annotations

import html as _html
import re
from collections.abc import Iterable

NAME = 200  # module, category, rule, label, source, provenance value
FRAME = 300  # one stack frame, one line of a command or of the fix
TEXT = 2000  # a cause or a warning: our sentence quoting names from the snapshot
ROWS = 50  # items of a list shown (warnings, provenance keys, iterations, modules)
FRAMES = 40  # frames of one stack shown

_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029]
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_VISIBLE = {c: _NAMED.get(c, f"\\x{c:02x}") for c in [*range(0x20), *range(0x7F, 0xA0)]}
_VISIBLE.update({c: f"\\u{c:04x}" for c in _BIDI})
# Markdown inline syntax, escaped only where Markdown would read it as syntax, so the raw text
# people paste stays clean (`72.0 MiB`, `+0.0%`, `~62.0 MiB`, not `72\\.0`, `\\+0.0`, `\\~62`):
# code, links/images, tables, headings' closing #s, raw HTML (`<` before a tag or an autolink,
# `&` before an entity) and what GitHub turns into autolinks (www., ://, @). `_` inside a word
# is never emphasis (CommonMark's flanking rule), so snake_case names stay readable.
_MD_INLINE = re.compile(r"[\\`\[\]|#]|<(?=[A-Za-z/!?])|&(?=#?\w+;)|(?<![A-Za-z0-9])_"
                        r"|_(?![A-Za-z0-9])|(?i:(?<=www)\.)|:(?=//)|@")
# Emphasis, strikethrough (GFM: one or two tildes) and math (`$...$`) need a closing delimiter:
# a string with a single one of these cannot open anything, so it is escaped only when the
# string holds two or more. Every call is one inline context (a cell, an item, a paragraph).
_MD_PAIRED = "*~$"
# At the start of a line: a list item (`-`, `+`, `*` or `1.`/`1)` before a space), a quote, a
# setext underline or thematic break, a heading (`#` is escaped everywhere above).
_MD_START = re.compile(r"^(?:[-+*](?=\s|$)|>|[-=]+\s*$|\d{1,9}(?=[.)](?:\s|$)))")
_ENTITY = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_TICKS = re.compile("`+")


def cap(s: object, limit: int) -> str:
    if isinstance(s, int) and s.bit_length() > 4 * limit:  # str() of a 10**5000 raises
        return f"(an integer of {s.bit_length():,} bits)"
    s = s if isinstance(s, str) else str(s)
    return s if len(s) <= limit else f"{s[:limit]}… ({len(s):,} chars)"


def terminal(s: object, limit: int = NAME) -> str:
    return cap(s, limit).translate(_VISIBLE)


def markdown(s: object, limit: int = NAME) -> str:
    text = terminal(s, limit)
    paired = "".join(c for c in _MD_PAIRED if text.count(c) > 1)
    text = _MD_INLINE.sub(lambda m: _ENTITY.get(m[0]) or "\\" + m[0], text)
    if paired:
        text = re.sub(f"[{re.escape(paired)}]", lambda m: "\\" + m[0], text)
    return _MD_START.sub(_start, text)


def _start(m: re.Match) -> str:
    """Escape a line-start marker: `1\\.` for an ordered-list number, `\\-` otherwise."""
    if m[0][0].isdigit():
        return m[0] + "\\"
    return "&gt;" if m[0] == ">" else "\\" + m[0]


def markdown_span(s: object, limit: int = NAME) -> str:
    """Inline code outside tables: delimited by more backticks than any run inside."""
    body = terminal(s, limit)
    ticks = "`" * (_longest_run(body) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{ticks}{pad}{body}{pad}{ticks}"


def _longest_run(text: str) -> int:
    """The longest run of backticks in `text`."""
    return max(map(len, _TICKS.findall(text)), default=0)


def markdown_code(lines: Iterable[object], lang: str = "", limit: int = FRAME) -> list[str]:
    """A fenced code block of `lines` (each neutralized and capped) that nothing inside can
    close."""
    body = [terminal(x, limit) for x in lines]
    fence = "`" * max(3, max(map(_longest_run, body), default=0) + 1)
    return [fence + lang, *body, fence]


def html(s: object, limit: int = NAME) -> str:
    return _html.escape(cap(s, limit), quote=True)


def lines(text: str | None, max_lines: int = 200) -> list[str]:
    """A multi-line string (a fix, a stack) as at most `max_lines` lines; each line is still
    raw: pass it to the sink's function."""
    out = (text or "").splitlines()
    if len(out) > max_lines:
        out = out[:max_lines] + [f"… ({len(out) - max_lines} more lines)"]
    return out
