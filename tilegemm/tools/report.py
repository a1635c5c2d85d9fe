"""Machine description and report rendering: ``info``, the tables, report.md / report.json.

The machine description (:func:`machine_info`) is what ``python -m tilegemm info
--json`` prints and what every report.json embeds, so two reports say which
machine and which block sizes produced them.
"""
import datetime
import json
import os
import platform

import numba
import numpy as np

import tilegemm
from tilegemm.tools import timing

DTYPES = ("float32", "float64")


# --------------------------------------------------------------------------- machine

#: How tilegemm runs threads: not a Numba threading layer (nothing uses prange).
THREADING = "Python thread pool over nogil kernels (count from tilegemm.get_num_threads())"


def _blocking_entry(dtype):
    from tilegemm.kernels.registry import kernel_name
    from tilegemm.tuning.blocking import blocking
    blk = blocking(dtype)
    return {"mr": blk.mr, "nr": blk.nr, "kc": blk.kc, "mc": blk.mc, "nc": blk.nc,
            "lanes": blk.lanes, "kernel": kernel_name(dtype, blk.mr, blk.nr, blk.isa),
            "source": dict(blk.source)}


def _peak_entries(machine, thread_counts, measure_peak, remeasure, measure):
    """``peak_gflops`` of :func:`machine_info` and the warnings about the measurement."""
    from tilegemm.tuning.peak import nominal_peak_gflops
    from tilegemm.tools.peak_cache import measured_peaks
    measured, warnings = ({}, [])
    if measure_peak:
        measured, warnings = measured_peaks(machine, DTYPES, thread_counts,
                                            measure or timing.peak_gflops, remeasure)
    entries = {}
    for dtype in DTYPES:
        per = {}
        for t in thread_counts:
            m = measured.get(dtype, {}).get(t)
            per[str(t)] = {"nominal": nominal_peak_gflops(dtype, t, clock="max"),
                           "measured": m["gflops"] if m else None,
                           "measured_at": m["measured_at"] if m else None,
                           "cached": m["cached"] if m else None}
        top = per[str(max(thread_counts))]
        entries[dtype] = {"threads": max(thread_counts), "nominal": top["nominal"],
                          "measured": top["measured"], "per_threads": per}
    return entries, warnings


def peer_versions():
    """Versions of numpy, its BLAS and torch (None when torch is not installed)."""
    blas = None
    threadpoolctl = timing.optional_import("threadpoolctl")
    if threadpoolctl is not None:
        for lib in threadpoolctl.threadpool_info():
            if lib.get("user_api") == "blas" and "numpy" in lib.get("filepath", ""):
                blas = f"{lib.get('internal_api')} {lib.get('version')}"
    torch = timing.torch_module()
    return {"numpy": np.__version__, "numpy_blas": blas,
            "torch": torch.__version__ if torch else None,
            "threadpoolctl": threadpoolctl.__version__ if threadpoolctl else None}


def machine_info(measure_peak=True, remeasure=False, measure=None):
    """Everything ``info`` shows, as one JSON-ready dict.

    Parameters
    ----------
    measure_peak : bool
        Give the measured FMA peak; when false ``peak_gflops[dtype]["measured"]``
        is None.
    remeasure : bool
        Run the FMA-throughput loop (about two seconds per dtype and thread
        count) even when this machine's peaks are cached
        (:mod:`tilegemm.tools.peak_cache`).
    measure : callable(dtype, threads) -> float, optional
        What measures one peak in GFLOPS; default :func:`timing.peak_gflops`.

    Returns
    -------
    dict
        Keys include ``brand``, ``isa``, ``vector_bits``, ``vector_registers``,
        ``cores``, ``l1d_bytes``/``l2_bytes``/``l3_bytes`` (per core),
        ``blocking`` (dtype -> mr, nr, kc, mc, nc, kernel, source) and
        ``peak_gflops`` (dtype -> nominal, measured for all threads, and
        ``per_threads`` -> {"1": ..., "N": ...}, each with ``measured_at`` and
        ``cached``), ``commit`` and ``dirty`` (the source's git state, None outside
        a checkout) and ``warnings`` (e.g. a peak measured on a busy machine).
    """
    from tilegemm.tools.provenance import source_commit
    from tilegemm.tuning.machine import detect, host_max_clock
    m = detect()
    max_hz, max_source = host_max_clock()
    all_threads = timing.max_threads()
    thread_counts = sorted({1, all_threads})
    peaks, warnings = _peak_entries((m.brand, m.isa), thread_counts, measure_peak, remeasure,
                                    measure)
    source = source_commit() or {"commit": None, "dirty": None}
    info = {
        "tilegemm_version": tilegemm.__version__,
        "commit": source["commit"], "dirty": source["dirty"],
        "brand": m.brand, "isa": m.isa, "isa_source": m.isa_source,
        "vector_bits": m.vector_bits, "vector_registers": m.vector_registers,
        "cores": m.cores, "threads": all_threads,
        "l1d_bytes": m.l1d_bytes, "l2_bytes": m.l2_bytes, "l3_bytes": m.l3_bytes,
        "cache_source": m.cache_source, "clock_ghz": m.clock_hz / 1e9, "fma_units": m.fma_units,
        "nominal_clock_ghz": max_hz / 1e9, "nominal_clock_source": max_source,
        "blocking": {d: _blocking_entry(d) for d in DTYPES},
        "peak_gflops": peaks, "warnings": warnings,
        "numba_version": numba.__version__,
        "python": platform.python_version(),
        "peers": peer_versions(),
    }
    info["threading_layer"] = THREADING
    return info


def _kib(n):
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n / 1024:g} KiB"


def _source_text(source):
    kinds = set(source.values())
    if len(kinds) == 1:
        return kinds.pop()
    return ", ".join(f"{k}={v}" for k, v in source.items())


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def info_text(info):
    """Human-readable form of :func:`machine_info`."""
    from tilegemm.tools.provenance import commit_text
    source = {"commit": info["commit"], "dirty": info["dirty"]} if info.get("commit") else None
    lines = [
        f"tilegemm {info['tilegemm_version']} (commit {commit_text(source)})",
        f"  CPU          {info['brand']}",
        f"  ISA          {info['isa']} ({info['isa_source']}): {info['vector_bits']}-bit vectors, "
        f"{info['vector_registers']} registers, {info['fma_units']} FMA unit(s)",
        f"  cores        {info['cores']} (Numba threads: {info['threads']})",
        f"  caches/core  L1d {_kib(info['l1d_bytes'])}, L2 {_kib(info['l2_bytes'])}, "
        f"L3 {_kib(info['l3_bytes'])} (from {info['cache_source']})",
        f"  Numba        {info['numba_version']}; threads: {info['threading_layer']}",
        f"  peers        numpy {info['peers']['numpy']} ({info['peers']['numpy_blas']}), "
        f"torch {info['peers']['torch'] or 'not installed'}",
        "",
        "blocking",
    ]
    rows = [[d, b["kernel"], b["mr"], b["nr"], b["kc"], b["mc"], b["nc"], _source_text(b["source"])]
            for d, b in info["blocking"].items()]
    lines += ["  " + r for r in format_table(
        ["dtype", "kernel", "MR", "NR", "KC", "MC", "NC", "from"], rows).splitlines()]
    lines += ["", "peak GFLOPS (nominal / measured); " + _clock_text(info)]
    counts = list(next(iter(info["peak_gflops"].values()))["per_threads"])
    rows = [[d] + [f"{_fmt(p['per_threads'][t]['nominal'])} / {_fmt(p['per_threads'][t]['measured'])}"
                   for t in counts] for d, p in info["peak_gflops"].items()]
    lines += ["  " + r for r in format_table(
        ["dtype"] + [timing.threads_text(t) for t in counts], rows).splitlines()]
    return "\n".join(lines + _peak_notes(info))


def _clock_text(info):
    """Which clock the nominal peak uses (reports from before it say nothing)."""
    source = info.get("nominal_clock_source")
    if source is None:
        return f"nominal at the base clock {info['clock_ghz']:.2f} GHz"
    if source == "cpufreq max":
        return f"nominal at the max boost clock {info['nominal_clock_ghz']:.2f} GHz (cpufreq)"
    return (f"nominal at {info['nominal_clock_ghz']:.2f} GHz ({source}: no max boost clock "
            "exposed, so the measured peak may exceed it)")


def _peak_notes(info):
    """Where the measured peaks came from, and any warning about them."""
    runs = [p for d in info["peak_gflops"].values() for p in d["per_threads"].values()
            if p.get("measured") is not None]
    notes = []
    cached = sorted({p["measured_at"] for p in runs if p.get("cached")})
    if cached:
        notes.append(f"  measured peaks cached from {', '.join(cached)} "
                     "(tilegemm info --remeasure measures them again)")
    return notes + info.get("warnings", [])


# --------------------------------------------------------------------------- tables

def format_table(headers, rows, markdown=False):
    """Align ``rows`` under ``headers``: plain text, or a GitHub Markdown table.

    Numbers are right-aligned, text left-aligned.
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) and len(cells) > 1
               for i in range(len(headers))]

    def line(r):
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)]
        return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts).rstrip()

    out = [line(cells[0])]
    if markdown:
        out.append("|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                                  for w, num in zip(widths, numeric)) + "|")
    else:
        out.append("  ".join("-" * w for w in widths))
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _is_number(text):
    text = text.rstrip("×%x")
    if text in ("-", "n/a"):
        return True
    try:
        float(text)
        return True
    except ValueError:
        return False


def _groups(records):
    """Records grouped by (dtype, threads), in first-seen order."""
    groups = {}
    for r in records:
        groups.setdefault((r["dtype"], r["threads"]), []).append(r)
    return groups


def _party_cells(results, name):
    row = results.get(name)
    if row is None:
        return ["-", "-"]
    return [_fmt(row["gflops"]), f"{row['ratio']:.2f}×"]


#: Header of the time columns: the best repeat, then the three that show the spread.
MS_HEADERS = ["ms", "min / median / max ms"]


def _ms_cells(row):
    """[best ms, "min / median / max" ms] of one party (dashes when it did not run)."""
    if not row:
        return ["-", "-"]
    low = row.get("min_s", row["best_s"])
    spread = [low, row.get("median_s"), row.get("max_s")]
    text = " / ".join("-" if t is None else f"{t * 1e3:.3g}" for t in spread)
    return [_fmt(row["best_s"] * 1e3, 3), text]


def gemm_tables(records, has_torch):
    """[(title, headers, rows)] for the GEMM records, one table per dtype and thread count."""
    tables = []
    for (dtype, threads), recs in _groups(records).items():
        headers = ["shape (m×n×k)", "kind", "GFLOPS", *MS_HEADERS, "% peak", "numpy GFLOPS",
                   "× numpy"]
        if has_torch:
            headers += ["torch GFLOPS", "× torch"]
        rows = []
        for r in recs:
            ours = r["results"]["tilegemm"]
            row = [r["shape"], r["kind"], _fmt(ours["gflops"]), *_ms_cells(ours),
                   _fmt(ours["pct_peak"])]
            row += _party_cells(r["results"], "numpy")
            if has_torch:
                row += _party_cells(r["results"], "torch")
            if not r["check"]["ok"]:
                row[1] += " (WRONG RESULT)"
            rows.append(row)
        title = (f"GEMM {dtype}, {timing.threads_text(threads)}, measured peak "
                 f"{recs[0]['peak_gflops']:.0f} GFLOPS")
        tables.append((title, headers, rows))
    return tables


#: Convolution peers, in column order, and the key of tilegemm's ratio to each.
CONV_PEERS = {"numpy": "ratio_numpy", "torch": "ratio"}


def _conv_row(record, name, res, peers, ms):
    """The table row of tilegemm party ``name`` of one convolution record."""
    algo = name.split(":", 1)[1] + (f" → {res['chose']}" if res.get("chose") else "")
    if not record["check"].get(name, {}).get("ok", True):
        algo += " (WRONG RESULT)"
    row = [record["layer"], record["shape"], record["batch"], algo, _fmt(res["gflops"]),
           *_ms_cells(res), _fmt(res["pct_peak"])]
    for peer in peers:
        peer_row = record["results"].get(peer)
        ratio = res.get(CONV_PEERS[peer])
        row += [_fmt(peer_row["gflops"]) if peer_row else "-",
                "-" if ratio is None else f"{ratio:.2f}×"]
        row += _ms_cells(peer_row) if ms else []
    return row


def conv_tables(records, ms=False):
    """[(title, headers, rows)] for the convolution records (one row per layer and algorithm).

    Every algorithm's milliseconds per call (best, and min / median / max of
    the repeats) are shown, then each peer that ran (numpy's explicit im2col,
    torch) with tilegemm's speed relative to it; ``ms`` adds the peers' times.
    """
    tables = []
    for (dtype, threads), recs in _groups(records).items():
        peers = [p for p in CONV_PEERS if any(p in r["results"] for r in recs)]
        headers = ["layer", "shape", "N", "algorithm", "GFLOPS (eff.)", *MS_HEADERS, "% peak"]
        for peer in peers:
            headers += [f"{peer} GFLOPS", f"× {peer}"]
            headers += [f"{peer} {h}" for h in MS_HEADERS] if ms else []
        rows = []
        for r in recs:
            rows += [_conv_row(r, name, res, peers, ms) for name, res in r["results"].items()
                     if name.startswith("tilegemm")]
            for algo in r["not_applicable"]:
                row = [r["layer"], r["shape"], r["batch"], algo, "n/a", "n/a"]
                rows.append(row + ["-"] * (len(headers) - len(row)))
        title = (f"Convolution {dtype}{_layout_text(recs[0])}, {timing.threads_text(threads)}, "
                 f"measured peak {recs[0]['peak_gflops']:.0f} GFLOPS")
        tables.append((title, headers, rows))
    return tables


def conv_notes(records):
    """Footnotes of the convolution tables: the algorithms left out as too slow.

    One line per record and skipped algorithm (``run_conv_case``'s ``skipped``),
    e.g. ``"resnet18_conv2_x (float32, 1 thread): direct: skipped, estimated 32x
    slower than winograd"``; an empty list when nothing was skipped.
    """
    return [f"{r['layer']} ({r['dtype']}{_layout_text(r)}, {timing.threads_text(r['threads'])}): "
            f"{algo}: {note}"
            for r in records for algo, note in r.get("skipped", {}).items()]


def auto_summary(records):
    """How ``auto`` fared against the fastest algorithm timed, per layer: a summary line
    and one line per layer where it ran below ``AUTO_WITHIN`` of it (records without
    ``vs_best``, from before it was measured, are left out); [] without such records."""
    from tilegemm.tools.conv_suite import AUTO_WITHIN
    rows = [(r, r["results"]["tilegemm:auto"]) for r in records
            if "vs_best" in r["results"].get("tilegemm:auto", {})]
    if not rows:
        return []
    short = [(r, a) for r, a in rows if a["vs_best"] < AUTO_WITHIN]
    lines = [f"`auto` within {100 * (1 - AUTO_WITHIN):.0f}% of the fastest algorithm timed "
             f"on {len(rows) - len(short)} of {len(rows)} layers"
             + ("" if not short else "; not on:")]
    lines += [f"{r['layer']} ({r['dtype']}{_layout_text(r)}, "
              f"{timing.threads_text(r['threads'])}): auto → {a['chose']} at "
              f"{a['vs_best']:.2f}x of {a['best']}" for r, a in short]
    return lines


#: What the ``auto → X`` rows are, said under the convolution tables.
AUTO_NOTE = ("`auto → X`: `algorithm=\"auto\"` picks X (`tilegemm.conv_plan`) and runs "
             "X's path, so its row repeats X's measurement rather than timing it again.")


def _layout_text(record):
    """", NHWC" for channels-last records; nothing for NCHW (and reports from before layouts)."""
    layout = record.get("layout", "NCHW")
    return f", {layout}" if layout != "NCHW" else ""


def scaling_tables(records):
    """[(title, headers, rows)] for ``--scaling`` records: one table per dtype."""
    tables = []
    for (dtype, threads), recs in _groups(records).items():
        many = timing.threads_text(threads)
        headers = ["layer", "party", "1 thread ms", f"{many} ms", "speed-up"]
        rows = []
        for r in recs:
            for row in r["rows"]:
                rows.append([r["layer"], row["party"].replace("tilegemm:", ""),
                             _fmt(row["one_s"] * 1e3, 2), _fmt(row["many_s"] * 1e3, 2),
                             f"{row['speedup']:.2f}×"])
            apart = r["apart"]
            rows.append([r["layer"], f"apart ({threads} × 1-thread auto)",
                         _fmt(apart["alone_s"] * 1e3, 2), _fmt(apart["together_s"] * 1e3, 2),
                         f"{apart['speedup']:.2f}×"])
        title = (f"Convolution thread scaling {dtype}{_layout_text(recs[0])}, batch "
                 f"{recs[0]['batch']}: 1 thread against {many}, timed in the same rounds")
        tables.append((title, headers, rows))
    return tables


def memory_text(memory):
    """One line on im2col's extra memory (``--memory``)."""
    extra, explicit = memory["extra_bytes"], memory["explicit_bytes"]
    return (f"im2col extra memory on {memory['layer']} (batch 1, {memory['dtype']}, "
            f"{memory['layout']}): {extra / 2**20:.1f} MiB implicit vs "
            f"{explicit / 2**20:.1f} MiB explicit patch matrix ({100 * extra / explicit:.1f}%)")


def all_conv_tables(report):
    """Every convolution table of ``report`` (timings, then ``--scaling``), as (title, headers, rows)."""
    conv, settings = report["conv"], report["settings"]
    tables = conv_tables(conv["records"], settings.get("ms", False))
    return tables + scaling_tables(conv.get("scaling", []))


def first_call_table(records):
    """(headers, rows) for the fresh-process first-call measurements."""
    headers = ["dtype", "n", "threads", "Numba cache", "import s", "first call s", "second call s"]
    rows = []
    for r in records:
        for state in ("cold", "warm"):
            run = r[state]
            rows.append([r["dtype"], r["n"], r["threads"], "empty" if state == "cold" else "warm",
                         _fmt(run["import_s"], 2), _fmt(run["first_call_s"], 2),
                         _fmt(run["second_call_s"], 4)])
    return headers, rows


# --------------------------------------------------------------------------- one line per record

def _party_text(name, row):
    name = name.replace("tilegemm:", "").replace("tilegemm", "ours")
    chose = f" → {row['chose']}" if row.get("chose") else ""
    return f"{name}{chose} {row['gflops']:.1f} GFLOPS {row['best_s'] * 1e3:.3g} ms"


def row_text(record):
    """One line saying what a finished benchmark step measured (printed as it finishes)."""
    op = record.get("op")
    if op in ("gemm", "conv"):
        case = (f"gemm {record['shape']} ({record['kind']})" if op == "gemm" else
                f"conv {record['layer']} N={record['batch']}{_layout_text(record)}")
        parties = "; ".join(_party_text(n, r) for n, r in record["results"].items())
        wrong = [n for n, c in (record["check"].items() if op == "conv" else
                                [("tilegemm", record["check"])]) if not c["ok"]]
        return (f"{case} {record['dtype']} {timing.threads_text(record['threads'])}: {parties}"
                + (f" WRONG RESULT: {', '.join(wrong)}" if wrong else ""))
    if op == "conv-scaling":
        ups = ", ".join(f"{r['party'].replace('tilegemm:', '')} {r['speedup']:.2f}×"
                        for r in record["rows"])
        return (f"conv scaling {record['layer']} {record['dtype']}, 1 → {record['threads']} "
                f"threads: {ups}; apart {record['apart']['speedup']:.2f}×")
    if op == "bandwidth":
        return f"memory bandwidth {record['gbps']:.1f} GB/s ({record['method']})"
    if "cold" in record:
        return (f"first call of matmul ({record['dtype']}, n={record['n']}): "
                f"{record['cold']['first_call_s']:.2f} s with an empty cache, "
                f"{record['warm']['first_call_s']:.2f} s with a warm one")
    if "extra_bytes" in record:
        return memory_text(record)
    if "peak_gflops" in record:
        peaks = ", ".join(f"{d} {p['measured']:.0f}" for d, p in record["peak_gflops"].items()
                          if p["measured"] is not None)
        return "\n".join([f"machine: {record['brand']}, {record['isa']}; measured peak "
                          f"({timing.threads_text(record['threads'])}) {peaks} GFLOPS"]
                         + record.get("warnings", []))
    return ""


# --------------------------------------------------------------------------- report files

def new_report(settings, machine):
    """An empty report dict: settings, machine description, source commit, timestamps.

    ``commit`` and ``dirty`` give the git state of the measured source (None
    outside a checkout); ``partial`` is None unless the run was interrupted.
    """
    from tilegemm.tools.provenance import source_commit
    source = source_commit() or {"commit": None, "dirty": None}
    return {
        "format": "tilegemm-bench-report/1",
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "tilegemm_version": tilegemm.__version__,
        "commit": source["commit"], "dirty": source["dirty"], "partial": None,
        "settings": settings,
        "machine": machine,
        "gemm": [], "first_call": [],
        "conv": {"available": None, "reason": "", "records": []},
        "memory_bandwidth": None, "plots": [], "plots_skipped": "",
        "load_average": {"start": None, "end": None},
    }


def has_torch_results(report):
    recs = report["gemm"] + report["conv"]["records"]
    return any("torch" in r["results"] for r in recs)


_METHOD = (
    "Best of {reps} repetitions after a warm-up call (its time, which includes JIT "
    "compilation, is reported apart); tilegemm and its peers are interleaved in every "
    "repetition and pinned to the same thread count. GFLOPS = 2·m·n·k / time "
    "(convolution: direct-convolution flops / time, \"effective\"). % peak is against the "
    "FMA peak measured on this machine for the same thread count (convolution: on the "
    "algorithm's own flop count). `× peer` = tilegemm GFLOPS / peer GFLOPS: above 1 "
    "tilegemm is faster."
)


_ABOVE_PEAK = (
    "Some figures exceed 100% of the measured peak: the FMA loop that measures the peak "
    "ran (once, at the start) while something else used a core, so that peak is too low. "
    "The ratios to the peers are unaffected.")


def _above_peak(report):
    rows = [p for r in report["gemm"] + report["conv"]["records"] for p in r["results"].values()]
    return any((p.get("pct_peak") or 0) > 100 for p in rows)


def busy_note(load, cores):
    """A warning when the load average says other work shared the cores, else ""."""
    worst = max((v for v in load.values() if v is not None), default=None)
    if worst is None or worst < 0.5 * cores + 1:
        return ""
    return (f"note: load average reached {worst:.1f} on {cores} core(s) during the run; "
            "other processes shared the CPU, so absolute figures are pessimistic "
            "(ratios to the interleaved peers hold better).")


def _load_text(load, cores):
    start, end = load.get("start"), load.get("end")
    if start is None:
        return "Load average: not reported by this OS."
    text = f"Load average (1 min) at start {start:.2f}, at end {_fmt(end, 2)} on {cores} core(s)."
    note = busy_note(load, cores)
    return text + (" " + note[len("note: "):].capitalize() if note else "")


def markdown_report(report):
    """report.md: machine summary, method, the tables, first-call times, plots."""
    m = report["machine"]
    has_torch = has_torch_results(report)
    out = ["# tilegemm benchmark report", "",
           f"Created {report['created']} with `{report['settings']['command']}`"
           f"{_commit_text(report)}.", ""]
    if report.get("partial"):
        p = report["partial"]
        out += [f"**Partial report**: {p['reason']} after {p['steps_done']} of "
                f"{p['steps_total']} steps; only the cases measured by then are below.", ""]
    out += ["## Machine", "", "```", info_text(m) if m else "(not measured)", "```", "",
           "## Method", "", _METHOD.format(reps=report["settings"]["reps"]), "",
           _load_text(report["load_average"], m.get("cores", 1)), ""]
    if report.get("memory_bandwidth"):
        bw = report["memory_bandwidth"]
        out += [f"Memory bandwidth {bw['gbps']:.1f} GB/s: {bw['method']} (the roofline's "
                "sloped roof).", ""]
    if _above_peak(report):
        out += [_ABOVE_PEAK, ""]
    if report["gemm"]:
        out += ["## GEMM", ""]
        for title, headers, rows in gemm_tables(report["gemm"], has_torch):
            out += [f"### {title}", "", format_table(headers, rows, markdown=True), ""]
    if report["first_call"]:
        headers, rows = first_call_table(report["first_call"])
        out += ["### First call in a fresh process", "",
                "`tilegemm.matmul` on an n×n product in a new Python process whose "
                "Numba cache directory is empty (everything compiles), then again with "
                "the cache the first run left.", "",
                format_table(headers, rows, markdown=True), ""]
    conv = report["conv"]
    if conv["available"]:
        out += ["## Convolution", ""]
        for title, headers, rows in all_conv_tables(report):
            out += [f"### {title}", "", format_table(headers, rows, markdown=True), ""]
        notes = conv_notes(conv["records"])
        if conv["records"]:
            out += [AUTO_NOTE + (" Not timed, as too slow for the layer:" if notes else ""), ""]
            out += [f"* {n}" for n in notes] + ([""] if notes else [])
            summary = auto_summary(conv["records"])
            if summary:
                out += [summary[0], ""] + [f"* {n}" for n in summary[1:]]
                out += [""] if summary[1:] else []
        if conv.get("memory"):
            out += [memory_text(conv["memory"]) + ".", ""]
    out += ["## Plots", ""]
    for path in report["plots"]:
        out += [f"![{os.path.splitext(path)[0]}]({path})", ""]
    if report["plots_skipped"]:
        out += [report["plots_skipped"], ""]
    return "\n".join(out)


def _commit_text(report):
    from tilegemm.tools.provenance import commit_text
    if report.get("commit") is None:
        return ""
    return f" at commit {commit_text(report)}"


def write_report(report, out_dir):
    """Write report.json and report.md into ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "report.json")
    md_path = os.path.join(out_dir, "report.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    with open(md_path, "w") as f:
        f.write(markdown_report(report))
    return json_path, md_path


def load_report(path):
    """Read a report.json, with a clear error when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != "tilegemm-bench-report/1":
        raise ValueError(f"{path} is not a tilegemm bench report.json")
    return data
