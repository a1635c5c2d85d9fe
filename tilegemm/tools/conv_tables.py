"""The convolution tables of a report and the notes under them."""
from tilegemm.tools import timing
from tilegemm.tools.tables import MS_HEADERS, _fmt, _groups, _ms_cells


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
