"""Words shared by every renderer, so all formats say the same thing in the same order.

These build raw sentences (names from the snapshot capped, not yet escaped); each renderer
passes them through its sink's function in report/sanitize.py.
"""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis, Finding, saving_rank
from snapforensics.analysis.evidence import human
from snapforensics.analysis.identity import WRAPPERS
from snapforensics.analysis.rules import BY_ID
from snapforensics.analysis.vocab import Verdict
from snapforensics.report.sanitize import NAME, cap

__all__ = [
    "by_saving",
    "dump_line",
    "peak_stacks",
    "finding_lines",
    "headline",
    "human",
    "peak_line",
    "phase_peaks",
    "provenance_line",
    "framework_line",
    "ratio",
    "saving_peak",
    "verdict_order",
]

VERDICT_ORDER = {Verdict.ANOMALOUS: 0, Verdict.EXPECTED: 1, Verdict.INFO: 2}
# An info finding whose fix would save at least this share of the peak is named in the
# headline even without an anomaly: a fifth of the peak is the same bar the fragmentation rule
# uses for "significant", and a saving a user would act on before buying memory.
HEADLINE_INFO_SHARE = 0.20


def by_saving(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=saving_rank, reverse=True)


def verdict_order(findings: list[Finding]) -> list[Finding]:
    """Anomalies first, then expected, then info; inside each, by peak saving then bytes."""
    return sorted(by_saving(findings), key=lambda f: VERDICT_ORDER.get(f.verdict, 3))


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def saving_peak(d: Diagnosis, f: Finding) -> tuple[str, int]:
    """Which peak `f.saving_bytes` is a saving of ("reserved" or "allocated") and its size."""
    dev = next((x for x in d.devices if x.device == f.device), d.primary)
    rule = BY_ID.get(f.rule)
    if rule and rule.reserved_peak:  # its saving is of reserved memory, not allocated
        res = rule.reserved_peak(f.evidence or {})
        return "reserved", int(res or (dev.segments.get("reserved_bytes", 0) if dev else 0))
    return "allocated", int(dev.peaks["overall_bytes"] if dev else d.peaks["overall_bytes"])


def _saving(d: Diagnosis, f: Finding) -> str:
    kind, peak = saving_peak(d, f)
    share = f" ({100 * f.saving_bytes / peak:.0f}% of the {kind} peak)" if peak else ""
    return f"~{human(f.saving_bytes)}{share}"


def headline(d: Diagnosis) -> str:
    anomalies = by_saving(d.anomalies)
    if anomalies:
        n, top = len(anomalies), anomalies[0]
        save = f", fixing it saves {_saving(d, top)}" if top.saving_bytes else ""
        return f"{n} anomal{'y' if n == 1 else 'ies'} found: {cap(top.title, NAME)}{save}"
    if not d.devices:
        return "empty snapshot: nothing was allocated"
    for f in by_saving([f for f in d.findings if f.verdict == Verdict.INFO and f.saving_bytes]):
        peak = saving_peak(d, f)[1]
        if peak and f.saving_bytes >= HEADLINE_INFO_SHARE * peak:
            return f"no anomaly; {cap(f.title, NAME)} would save {_saving(d, f)}"
    return "no anomaly found"


def peak_line(d: Diagnosis) -> str:
    p = d.peaks
    if p["forward_bytes"] and p["backward_bytes"]:
        return (f"peak {human(p['overall_bytes'])}; forward {human(p['forward_bytes'])}, "
                f"backward {human(p['backward_bytes'])} "
                f"(backward/forward {ratio(p['backward_bytes'], p['forward_bytes'])})")
    return f"peak {human(p['overall_bytes'])}"


def provenance_line(d: Diagnosis) -> str:
    f, p = d.format, d.provenance
    parts = [f"backend {cap(f.get('backend', '?'), NAME)}", cap(f.get("era", ""), NAME)]
    if d.rank is not None:
        ws = p.get("world_size")
        parts.append(f"rank {d.rank}" + (f"/{cap(ws, NAME)}" if ws else ""))
    if p.get("stacks"):
        parts.append(f"stacks={cap(p['stacks'], NAME)}")
    if p.get("max_entries"):
        parts.append(f"max_entries={cap(p['max_entries'], NAME)}")
    if p.get("cpu_recorded"):
        parts.append("CPU-recorded (profiler allocator events, no caching allocator; device memory "
                     "outside the allocator not measured)")
    ranges = f.get("ranges")
    if isinstance(ranges, str) and ranges.startswith(("recording thread only (", "none (")):
        parts.append(f"record_function ranges: {cap(ranges, NAME)}")
    return ", ".join(x for x in parts if x)


def framework_line(d: Diagnosis) -> str | None:
    """"framework: HF Trainer (accelerate, transformers), FSDP2; layer LlamaDecoderLayer at
    model.layers.N (N = 0-3)", or None for a file that shows no framework and no FSDP."""
    fw = d.framework or {}
    label = fw.get("label")
    if not label or (fw.get("owner") == "torch" and not fw.get("fsdp")
                     and not fw.get("layer_class")):
        return None
    out = f"framework: {cap(label, NAME)}"
    cls, cont = fw.get("layer_class"), fw.get("layer_container")
    if cls or cont:
        ix = fw.get("layer_indices") or []
        where = f" at {cap(cont, NAME)}.N" + (f" (N = {ix[0]}-{ix[-1]})" if ix else "") \
            if cont else ""
        out += f"; layer {cap(cls or '(class not in the file)', NAME)}{where}"
    return out


def command_line(d: Diagnosis) -> str | None:
    cmd = d.provenance.get("command")
    if not cmd:
        return None
    return " ".join(map(str, cmd[:64])) if isinstance(cmd, (list, tuple)) else str(cmd)


def phase_peaks(iteration: dict) -> list[str]:
    """Recompute and optimizer peaks of one iteration ("-" where the phase did not occur)."""
    ph = iteration.get("phases", {})
    return [human(ph[p]["peak_bytes"]) if p in ph else "-" for p in ("recompute", "optimizer")]


def finding_lines(d: Diagnosis, f: Finding) -> list[str]:
    """Key figures of a finding as short lines, and how they relate (`bytes_account`)."""
    out = [f"{human(f.bytes)} in {f.blocks} blocks (device {f.device})"]
    if f.predicted_peak_bytes is not None:
        out.append(f"predicted peak after the fix: {human(f.predicted_peak_bytes)}"
                   + (f", saving {_saving(d, f)}" if f.saving_bytes else ""))
    elif f.saving_bytes:
        out.append(f"the fix saves {_saving(d, f)}")
    account = bytes_account(d, f)
    return [*out, account] if account else out


def finding_category(f: Finding) -> str | None:
    """What made the finding's blocks (the category of its representative stacks)."""
    cats = {s.get("category") for s in f.stacks if isinstance(s, dict)}
    return cats.pop() if len(cats) == 1 else None


def bytes_account(d: Diagnosis, f: Finding) -> str | None:
    """One sentence relating a finding's three figures, which differ by design: its bytes
    (the most its blocks hold at once), their category's total at the peak (those blocks and
    any others of that kind alive then) and what the fix saves (the peak minus the replay's
    peak without them, which is lower when the peak moves to a moment the fix does not
    touch)."""
    dev = next((x for x in d.devices if x.device == f.device), None)
    cat = finding_category(f)
    at_peak = int(dev.categories_at_peak.get(cat, 0)) if dev is not None and cat else 0
    parts = [f"how the figures relate: {human(f.bytes)} is the most these {f.blocks} blocks "
             "hold at once"]
    if at_peak > f.bytes:
        parts.append(f"at the peak {cat} totals {human(at_peak)}: these blocks and "
                     f"{human(at_peak - f.bytes)} of other {cat} blocks (not this finding's)")
    elif at_peak:
        parts.append(f"at the peak {cat} blocks total {human(at_peak)}")
    if f.saving_bytes and f.predicted_peak_bytes is not None:
        if f.saving_bytes < f.bytes:
            parts.append(f"the fix saves {human(f.saving_bytes)}, less than {human(f.bytes)}: "
                         f"without these blocks the run still peaks at "
                         f"{human(f.predicted_peak_bytes)}, with memory this fix does not "
                         "touch")
        else:
            parts.append(f"the fix saves {human(f.saving_bytes)} of the peak")
    return "; ".join(parts) + "." if len(parts) > 1 else None


def dump_line(d: Diagnosis, dev) -> str:
    """What the allocator held when the snapshot was dumped, in the same words everywhere: a
    CPU recording has no caching allocator, so it reserves nothing beyond what is alive."""
    seg = dev.segments or {}
    if d.format.get("backend") == "cpu" or d.provenance.get("cpu_recorded"):
        return (f"{human(int(seg.get('allocated_bytes', 0)))} alive at dump (no caching "
                "allocator on CPU: nothing reserved beyond it)")
    return (f"segments reserved {human(int(seg.get('reserved_bytes', 0)))} at dump "
            f"({human(int(seg.get('allocated_bytes', 0)))} allocated in "
            f"{int(seg.get('count', 0))} segments)")


def peak_stacks(dev) -> list[dict]:
    """The top stacks alive at the peak in the order to show them: the largest stack of each
    category, categories by their bytes at the peak (so a category spread over many stacks,
    like one FSDP unit's unsharded parameters per stack, is not crowded out by a category
    made by one big stack), then the other stacks by bytes."""
    stacks = sorted(dev.top_stacks_at_peak, key=lambda s: -int(s.get("bytes", 0)))
    rank = {c: i for i, (c, _) in enumerate(sorted(dev.categories_at_peak.items(),
                                                   key=lambda x: -x[1]))}
    first: dict[str, dict] = {}
    for s in stacks:
        first.setdefault(str(s.get("category")), s)
    lead = sorted(first.values(), key=lambda s: rank.get(str(s.get("category")), len(rank)))
    return lead + [s for s in stacks if not any(s is x for x in lead)]


def _int(v: object) -> int:
    return v if type(v) is int else 0


def tensor_names(dev) -> dict | None:
    """The device's tensor names (`DeviceSummary.tensors`) when the recorder wrote them."""
    t = dev.tensors if isinstance(getattr(dev, "tensors", None), dict) else {}
    return t if t.get("recorded") is True else None


def names_line(t: dict) -> str:
    """One sentence: how much of the peak the names cover, by kind."""
    kinds = t.get("by_kind_at_peak") if isinstance(t.get("by_kind_at_peak"), dict) else {}
    parts = ", ".join(f"{str(k).replace('_', ' ')} {human(_int(b))}" for k, b in
                      sorted(kinds.items(), key=lambda x: -_int(x[1])))
    return (f"tensor names: {human(_int(t.get('named_bytes_at_peak')))} of "
            f"{human(_int(t.get('bytes_at_peak')))} alive at the peak named"
            f"{f' ({parts})' if parts else ''}")


def saved_by_layer(t: dict) -> list[tuple[str, int, int, str]]:
    """Rows (layer, bytes, blocks, 'module bytes, ...') of the table "saved for backward, by
    layer" at the peak. Strings are the file's: each renderer neutralizes them."""
    rows = []
    for r in t.get("saved_by_layer") or []:
        if not isinstance(r, dict):
            continue
        mods = [m for m in r.get("modules") or [] if isinstance(m, list) and len(m) == 2]
        inside = ", ".join(f"{m[0]} {human(_int(m[1]))}" for m in mods)
        rows.append((str(r.get("layer")), _int(r.get("bytes")), _int(r.get("blocks")), inside))
    return rows


def largest_named(t: dict | list) -> list[tuple[str, str, str, int]]:
    """Rows (tensor, kind, 'shape dtype', bytes) of the largest named blocks at the peak (a
    device's names), or of a finding's (`Finding.tensors`: the same records)."""
    rows = []
    for r in (t if isinstance(t, list) else t.get("largest_at_peak") or []):
        if not isinstance(r, dict):
            continue
        name = r.get("tensor") or f"(saved by {r.get('module') or '?'})"
        # wrapper segments (`_checkpoint_wrapped_module`, `_orig_mod`, ...) dropped: the name
        # the user's model gives it; a buffer holding several tensors by its first
        names = [WRAPPERS.sub("", n).strip(".") or n for n in str(name).split(", ")]
        name = names[0] + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
        shape = r.get("shape") if isinstance(r.get("shape"), list) else []
        rows.append((str(name), str(r.get("kind")).replace("_", " "),
                     f"{tuple(shape)} {r.get('dtype')}", _int(r.get("bytes"))))
    return rows


def compiled_regions(dev) -> tuple[str, list[tuple[str, str, int, int, int]]] | None:
    """The torch.compile regions of a device (`DeviceSummary.compiled`): a title line and rows
    (region, source, forward bytes at the peak, backward bytes at the peak, blocks); None when
    nothing ran compiled. Strings are the file's: each renderer neutralizes them."""
    c = getattr(dev, "compiled", None)
    if not isinstance(c, dict):
        return None
    rows = []
    for r in c.get("regions") or []:
        if isinstance(r, dict):
            rows.append((str(r.get("region")), str(r.get("source") or "(unknown)"),
                         _int(r.get("forward_bytes_at_peak")),
                         _int(r.get("backward_bytes_at_peak")),
                         _int(r.get("forward_blocks")) + _int(r.get("backward_blocks"))))
    calls, tied = _int(c.get("backward_calls")), _int(c.get("backward_calls_attributed"))
    title = (f"torch.compile regions: {human(_int(c.get('compiled_bytes_at_peak')))} of the "
             f"peak made by compiled graphs, {human(_int(c.get('eager_bytes_at_peak')))} eager; "
             f"{tied} of {calls} compiled backward calls tied to their forward's region")
    return title, rows


def compiled_lines(dev) -> tuple[str, list[tuple[str, str, str, int, int]]] | None:
    """What Inductor's buffers hold, by the model source line their graph node came from
    (`DeviceSummary.compiled["lines"]`): a title and rows (line, buffers, passes, bytes at the
    peak, bytes allocated); None without the recorder's map of compiled code. Strings are the
    file's: each renderer neutralizes them."""
    c = getattr(dev, "compiled", None)
    lines = c.get("lines") if isinstance(c, dict) else None
    notes = c.get("map_notes") if isinstance(c, dict) else None
    if not isinstance(lines, list):
        lines = []
    if not lines and not notes:
        return None
    rows = []
    for r in lines:
        if isinstance(r, dict):
            bufs = [str(b) for b in (r.get("buffers") or [])]
            rows.append((str(r.get("line")), ", ".join(bufs),
                         " + ".join(str(p) for p in (r.get("passes") or [])),
                         _int(r.get("bytes_at_peak")), _int(r.get("bytes_allocated"))))
    title = "Inductor's buffers by model source line"
    if isinstance(notes, list) and notes:
        title += " (" + "; ".join(str(n) for n in notes[:2]) + ")"
    return title, rows


def no_names(d: Diagnosis) -> dict | None:
    """What the report says once for a dump without the recorder's names: `said` lines and
    the `recipe` (the first device's; every device shares them)."""
    for dev in d.devices:
        t = dev.tensors if isinstance(getattr(dev, "tensors", None), dict) else {}
        if t.get("recorded") is False:
            return t
    return None
