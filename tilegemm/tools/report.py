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
from tilegemm.tools.conv_tables import (AUTO_NOTE, _layout_text, all_conv_tables,  # noqa: F401
                                        auto_summary, conv_notes, conv_tables, memory_text,
                                        scaling_tables)
from tilegemm.tools.tables import (MS_HEADERS, _fmt, _groups, _ms_cells,  # noqa: F401
                                   format_table)

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

def _party_cells(results, name):
    row = results.get(name)
    if row is None:
        return ["-", "-"]
    return [_fmt(row["gflops"]), f"{row['ratio']:.2f}×"]


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
    if op == "int8":
        from tilegemm.tools.int8_suite import row_text as int8_row_text
        return int8_row_text(record)
    if op == "qconv":
        from tilegemm.tools.qconv_suite import row_text as qconv_row_text
        return qconv_row_text(record)
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
        "gemm": [], "first_call": [], "int8": [], "qconv": [],
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
    if report.get("int8"):
        from tilegemm.tools.int8_suite import int8_table
        title, headers, rows = int8_table(report["int8"])
        out += ["## int8 GEMM", "", title + "; % of the measured int8 dot-product peak.", "",
                format_table(headers, rows, markdown=True), ""]
    if report.get("qconv"):
        from tilegemm.tools.qconv_suite import qconv_table
        title, headers, rows = qconv_table(report["qconv"])
        out += ["## int8 convolution", "", title + "; % of the measured int8 dot-product peak.",
                "", format_table(headers, rows, markdown=True), ""]
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
