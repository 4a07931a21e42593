"""Markdown as a reader sees it: parsed by markdown-it-py (CommonMark + GFM tables, the parser
rich itself uses), so tests assert on rendered text and on the tokens an input produced."""

from __future__ import annotations

from markdown_it import MarkdownIt

_MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def tokens(doc: str):
    return _MD.parse(doc)


def rendered_text(doc: str) -> str:
    """The visible text of `doc`, whitespace collapsed (escapes and entities resolved)."""
    out = []
    for tok in tokens(doc):
        if tok.type == "inline":
            out += [c.content for c in tok.children or [] if c.type in ("text", "code_inline")]
        elif tok.type in ("fence", "code_block"):
            out.append(tok.content)
    return " ".join(" ".join(out).split())
