"""Renderers of a Forecast (registry kind "forecast"): terminal, markdown, html; JSON is
`report.json:render` (Forecast.to_dict). One table, the same facts in every format; the source
path and notes (which quote rule ids) pass through the sink's function of report/sanitize.py."""

from __future__ import annotations

from snapforensics.analysis.evidence import human
from snapforensics.analysis.forecast import band as forecast_band
from snapforensics.analysis.forecast.documents import Forecast, Prediction
from snapforensics.analysis.forecast.scaling import SCALING_TEXT
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, ROWS, TEXT
from snapforensics.report.sanitize import html as h
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import t

_MODEL = ("Each block scales by what made it: 1/W (sharded state, with FSDP's padding), unit "
          "size (unsharded parameters, collective buffers), x micro-batch (activations), "
          "constant (the rest); the trace is replayed with the new sizes. Model, validation and "
          "limits: `snapforensics forecast --help`.")

COLUMNS = ("W", "TP", "strategy", "ckpt", "micro-batch", "fix applied", "predicted peak",
           "vs recorded", "error band", "phase (row)", "dominant", "fits")


def _table(f: Forecast) -> tuple[list[str], list[list[str]]]:
    """Columns and rows; the TP column only when a scenario has a TP degree, the fix column
    only when some scenario applies a fix."""
    rows = [_row(p, f.baseline["peak_bytes"]) for p in f.scenarios]
    drop = set() if any(p.scenario.tp for p in f.scenarios) else {COLUMNS.index("TP")}
    if not any(p.scenario.fix for p in f.scenarios):
        drop.add(COLUMNS.index("fix applied"))
    return ([c for i, c in enumerate(COLUMNS) if i not in drop],
            [[x for i, x in enumerate(r) if i not in drop] for r in rows])


def _row(p: Prediction, recorded: int) -> list[str]:
    sc = p.scenario
    head = [str(sc.world_size), str(sc.tp or "-"), sc.strategy, sc.checkpointing,
            f"x{sc.micro_batch_scale:g}", sc.fix or "-"]
    if p.refused:
        return head + ["refused", "", "", "", p.refused, ""]
    pk = p.predicted_peak_bytes or 0
    delta = f"{(pk - recorded) / recorded:+.0%}" if recorded else "n/a"
    fits = "" if p.fits is None else ("yes" if p.fits else "NO")
    dom = f"{p.dominant} ({SCALING_TEXT[p.scales[p.dominant]]})" if p.dominant else "-"
    return head + [human(pk), delta, _band(p), f"{p.phase} ({p.peak_row})", dom, fits]


def _band(p: Prediction) -> str:
    return _band_of(p.error_band)


def _band_of(b: dict | None) -> str:
    """`-0.0%..+1.4%` (measured on recorded pairs), `exact` for the recording replayed, and
    `NOT VALIDATED` when the scenario lies outside what the pairs covered."""
    if not b:
        return ""
    if not b["changes"]:
        return "exact (replay)"
    text = f"{b['low']:+.2%}..{b['high']:+.2%}"
    return text if b["validated"] else f"{text} NOT VALIDATED"


def _validation_lines(f: Forecast) -> list[str]:
    """Where the band comes from, and each scenario never validated, with why."""
    out = [f"error band: the forecast error measured on {len(forecast_band.PAIRS)} recorded "
           f"pairs ({forecast_band.SOURCE}), for the kinds of change the scenario makes"]
    seen: set[str] = set()
    for p in f.scenarios:
        b = p.error_band
        if not b or b["validated"]:
            continue
        sc = p.scenario
        line = (f"not validated: W={sc.world_size}{f' TP={sc.tp}' if sc.tp else ''} "
                f"{sc.strategy} ckpt {sc.checkpointing} "
                f"x{sc.micro_batch_scale:g}{' fix ' + sc.fix if sc.fix else ''}: "
                + "; ".join(b["not_validated"]))
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out[:ROWS]


def _baseline_line(f: Forecast) -> str:
    b = f.baseline
    # no_shard (replicate(), NO_SHARD): its shard degree is 1, whatever the ranks
    w = "any (nothing sharded)" if b["strategy"] == "no_shard" else \
        b["world_size"] or "unknown"
    tp = f", TP {b['tp']}" if b.get("tp") else ""
    return (f"recorded: world size {w}{tp}, {b['strategy']}, checkpointing {b['checkpointing']}; "
            f"peak {human(b['peak_bytes'])} in {b['phase']} (row {b['row']}), replayed "
            f"{human(b['replayed_peak_bytes'] or 0)}")


def _fit_lines(f: Forecast) -> list[str]:
    if not f.fit:
        return []
    fit = f.fit
    out = []
    cap = human(fit["capacity_bytes"])
    if fit.get("recorded_fits"):
        out.append(f"the recorded configuration already fits {cap} (recorded peak "
                   f"{human(fit['recorded_peak_bytes'])}): no change needed")
    if fit.get("smallest_world_size"):
        out.append(f"smallest world size that fits {cap}: {fit['smallest_world_size']} "
                   f"(peak {human(fit['peak_bytes_there'])})")
    else:
        out.append(f"no world size fits {cap}: {fit.get('reason', '')}")
    ch = fit.get("cheapest_change")
    if ch:
        what = ", ".join(f"{k}={v}" for k, v in ch["change"].items())
        out.append(f"cheapest change that fits at the recorded world size: {what} "
                   f"(peak {human(ch['peak_bytes'])}, {_band_of(ch.get('error_band'))})")
    elif not fit.get("recorded_fits"):
        out.append("no single change fits at the recorded world size (tried: an anomaly's "
                   "fix, full_shard, checkpointing full, half the micro-batch)")
    return out


def _scaling_lines(f: Forecast) -> list[str]:
    """What is alive at the recorded peak, by category and by how it scales (the model)."""
    b = f.baseline
    rows = b.get("breakdown") or {}
    scales = b.get("scales") or {}
    out = ["alive at the recorded peak: " + ", ".join(
        f"{c} {human(v)} ({SCALING_TEXT[scales[c]]})" if c in scales else f"{c} {human(v)}"
        for c, v in sorted(rows.items(), key=lambda x: -x[1]))]
    if b.get("by_scaling"):
        out.append("by how it scales: " + "; ".join(
            f"{SCALING_TEXT[k]} {human(v)}" for k, v in b["by_scaling"].items()))
    return out


def terminal(f: Forecast, screen: Screen = PLAIN) -> str:
    from rich.table import Table

    console = screen.console(width=140)
    console.print(t(f"snapforensics forecast: {f.source}", FRAME, "bold"))
    console.print(t(_baseline_line(f), TEXT))
    for n in f.notes[:ROWS]:
        console.print(t(f"note: {n}", TEXT, "yellow"))
    tab = Table(show_edge=False)
    cols, rows = _table(f)
    for c in cols:
        tab.add_column(c, justify="right" if c in ("predicted peak", "vs recorded") else "left",
                       overflow="fold")
    for r in rows:
        tab.add_row(*[t(x, TEXT) for x in r])
    console.print(tab)
    for line in _scaling_lines(f) + _fit_lines(f) + _validation_lines(f) + [_MODEL]:
        console.print(t(line, TEXT))
    return console.file.getvalue()


def markdown(f: Forecast, screen: Screen = PLAIN) -> str:
    out = [f"# snapforensics forecast: {md(f.source, FRAME)}", "",
           f"- {md(_baseline_line(f), TEXT)}"]
    out += [f"- note: {md(n, TEXT)}" for n in f.notes[:ROWS]]
    cols, rows = _table(f)
    out += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(md(x, TEXT) for x in r) + " |" for r in rows]
    out += [""] + [f"- {md(x, TEXT)}"
                   for x in _scaling_lines(f) + _fit_lines(f) + _validation_lines(f)]
    out += ["", md(_MODEL, TEXT)]
    return "\n".join(out) + "\n"


def html(f: Forecast, screen: Screen = PLAIN) -> str:
    cols, table = _table(f)
    rows = "".join("<tr>" + "".join(f"<td>{h(x, TEXT)}</td>" for x in r) + "</tr>"
                   for r in table)
    items = "".join(f"<li>{h(x, TEXT)}</li>"
                    for x in f.notes[:ROWS] + _scaling_lines(f) + _fit_lines(f)
                    + _validation_lines(f))
    head = "".join(f"<th>{h(c)}</th>" for c in cols)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>snapforensics forecast: {h(f.source, FRAME)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>snapforensics forecast</h1><p><code>{h(f.source, FRAME)}</code></p>"
        f"<p>{h(_baseline_line(f), TEXT)}</p><table><tr>{head}</tr>{rows}</table>"
        f"<ul>{items}</ul><p>{h(_MODEL, TEXT)}</p></body></html>\n")


# The pipeline forecast (registry kind "pipeline_forecast"): one row per scenario and stage.
PIPE_COLUMNS = ("stages", "micro-batches", "schedule", "stage", "layers", "holds (micro-batches)",
                "predicted peak", "worst", "error band")
_PIPE_MODEL = ("The recorded GPipe step is cut into its micro-batches' forwards and backwards and "
               "rebuilt in the schedule's order for each stage; what the operations make scales "
               "with the micro-batch (same global batch) and, with the stages, what belongs to "
               "the layers with the layers per stage. Under an interleaved schedule a row is one "
               "rank, all V of its stages (its layers, the most micro-batches one of them holds). "
               "Model and limits: `snapforensics forecast --help`.")


def _schedule(sc: dict) -> str:
    """The scenario's schedule, with its stages per rank when it runs several (interleaved)."""
    v = sc.get("virtual_stages", 1)
    return f"interleaved:{v}" if v > 1 else sc["schedule"]  # as --schedule takes it


def _pipe_mesh(f) -> list[str]:
    """The mesh columns the scenarios change (FSDP world size, TP degree): shown only then."""
    r = f.recorded
    return [k for k in ("world_size", "tp")
            if any(sc.get(k) != r.get(k) for sc in f.scenarios)]


def _pipe_columns(f) -> list[str]:
    names = {"world_size": "W (FSDP)", "tp": "TP"}
    return [names[k] for k in _pipe_mesh(f)] + list(PIPE_COLUMNS)


def _pipe_rows(f) -> list[list[str]]:
    rows = []
    mesh = _pipe_mesh(f)
    for sc in f.scenarios:
        b = sc["error_band"]
        band = "exact (replay)" if b["exact"] else \
            f"{b['low']:+.1%}..{b['high']:+.1%}" + ("" if b["validated"] else " NOT VALIDATED")
        for p in sc["per_stage"]:
            head = [str(sc[k] or "-") for k in mesh] + [
                str(sc["stages"]), str(sc["microbatches"]), _schedule(sc), str(p["stage"]),
                "?" if p["layers"] is None else str(p["layers"]), str(p["held_microbatches"])]
            if p["refused"]:
                rows.append(head + ["refused", "", p["refused"]])
                continue
            worst = "worst" if p["stage"] == sc["worst_stage"] else ""
            rows.append(head + [human(p["predicted_peak_bytes"]), worst, band])
    return rows[:ROWS * 8]


def _pipe_lines(f) -> list[str]:
    r = f.recorded
    peaks = ", ".join(f"stage {k} {human(v)}" for k, v in sorted(r["peaks"].items()))
    mesh = "".join(f", {name} {r.get(k)}" for k, name in (("world_size", "FSDP world size"),
                                                          ("tp", "TP")) if r.get(k))
    v = r.get("virtual_stages") or 1
    where = f"{r['stages'] or 'unknown'} ranks x {v} stages" if v > 1 else \
        f"{r['stages'] or 'unknown'} stages"
    out = [f"recorded: {where}, {r['microbatches']} micro-batches, {r['schedule']}, "
           f"{r['layers'] or 'unknown'} layers per stage{mesh}; peaks {peaks}"]
    shown = _pipe_mesh(f)
    for sc in f.scenarios:
        if sc["worst_stage"] is not None:
            at = "".join(f", {'W' if k == 'world_size' else 'TP'} {sc[k]}" for k in shown)
            out.append(f"{sc['stages']} stages, {sc['microbatches']} micro-batches, "
                       f"{_schedule(sc)}{at}: worst stage {sc['worst_stage']} at "
                       f"{human(sc['worst_peak_bytes'])}")
    out += [f"note: {n}" for n in f.notes]
    seen = []
    for sc in f.scenarios:
        for why in sc["error_band"]["not_validated"]:
            if why not in seen:
                seen.append(why)
    from snapforensics.analysis.forecast.pipeline import DEEPSPEED_SOURCE, SOURCE
    source = DEEPSPEED_SOURCE if r.get("runtime") == "deepspeed" else SOURCE
    out.append(f"error band: measured on recorded pairs ({source})")
    out += [f"not validated: {w}" for w in seen]
    return out[:ROWS]


def pipeline_terminal(f, screen: Screen = PLAIN) -> str:
    from rich.table import Table

    console = screen.console(width=140)
    console.print(t(f"snapforensics forecast (pipeline): {f.source}", FRAME, "bold"))
    tab = Table(show_edge=False)
    for c in _pipe_columns(f):
        tab.add_column(c, justify="right" if c == "predicted peak" else "left", overflow="fold")
    for r in _pipe_rows(f):
        tab.add_row(*[t(x, TEXT) for x in r])
    recorded, *lines = _pipe_lines(f)
    console.print(t(recorded, TEXT))
    console.print(tab)
    for line in lines + [_PIPE_MODEL]:
        console.print(t(line, TEXT))
    return console.file.getvalue()


def pipeline_markdown(f, screen: Screen = PLAIN) -> str:
    cols = _pipe_columns(f)
    out = [f"# snapforensics forecast (pipeline): {md(f.source, FRAME)}", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(md(x, TEXT) for x in r) + " |" for r in _pipe_rows(f)]
    out += [""] + [f"- {md(x, TEXT)}" for x in _pipe_lines(f)] + ["", md(_PIPE_MODEL, TEXT)]
    return "\n".join(out) + "\n"


def pipeline_html(f, screen: Screen = PLAIN) -> str:
    rows = "".join("<tr>" + "".join(f"<td>{h(x, TEXT)}</td>" for x in r) + "</tr>"
                   for r in _pipe_rows(f))
    head = "".join(f"<th>{h(c)}</th>" for c in _pipe_columns(f))
    items = "".join(f"<li>{h(x, TEXT)}</li>" for x in _pipe_lines(f))
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>snapforensics forecast (pipeline): {h(f.source, FRAME)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>snapforensics forecast (pipeline)</h1><p><code>{h(f.source, FRAME)}</code></p>"
        f"<table><tr>{head}</tr>{rows}</table><ul>{items}</ul><p>{h(_PIPE_MODEL, TEXT)}</p>"
        "</body></html>\n")
