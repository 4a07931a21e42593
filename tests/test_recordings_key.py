"""The recordings cache's key covers every source a recording is made of: a recording is reused
until one of them changes (`recordings.SOURCES`), so a module of the example or of the recorder
left out of the key would let a change to it reuse recordings made before it."""

from __future__ import annotations

import ast
from pathlib import Path

from recordings import REPO, SOURCES


def _module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(path: Path) -> set[str]:
    """The snapforensics modules `path` imports (also inside functions), parents included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
            if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for n in names:
            parts = n.split(".")
            if parts[0] == "snapforensics":
                out |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    return out


def _covered(path: Path) -> bool:
    rel = path.relative_to(REPO)
    return any(rel == Path(s) or Path(s) in rel.parents for s in SOURCES)


def test_every_module_a_recording_is_made_of_is_in_its_key():
    # what runs to make a recording: the job runners, the example's modules (the matrix runner
    # included), what `snapforensics record` runs; and everything they import, transitively
    todo = [REPO / "tests" / "record_example.py", REPO / "snapforensics" / "commands" / "record.py",
            *sorted((REPO / "snapforensics" / "examples").rglob("*.py"))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [f for m in _imports(path) if (f := _module_file(m)) is not None]
    # report/ only shapes text the user sees (errors.py neutralizes an error message with
    # report/sanitize.py), never what a recording holds
    made_of = {p for p in seen if not p.is_relative_to(REPO / "snapforensics" / "report")}
    assert len(made_of) > 10, sorted(made_of)  # the walk found the examples and the recorder
    assert {"run.py", "layouts.py", "fsdp_ckpt.py"} <= {p.name for p in made_of}
    missing = sorted(str(p.relative_to(REPO)) for p in made_of if not _covered(p))
    assert not missing, f"recordings.SOURCES lacks {missing}"
