"""``bench --compare A.json B.json``: ratios between two saved reports, noise flagged.

Two figures are compared for every case present in both reports:

* tilegemm's GFLOPS, B / A.  Between two runs this swings with the machine (on a
  shared VM by tens of percent), so it mostly says whether the machine changed.
* tilegemm's ratio to its peer (numpy for GEMM, torch for convolution), B / A.
  Peers were interleaved with tilegemm in each run, so machine drift cancels:
  this is the figure that says whether tilegemm itself got faster or slower.

The noise band of a comparison comes from the reports themselves: each party's
``spread`` ((median - best) / best over its repetitions).  A change is flagged
when it exceeds twice the sum of the spreads involved (never less than
:data:`MIN_NOISE`).
"""
from tilegemm.tools.report import format_table

#: Smallest noise band, so that single-repetition reports (spread 0) do not flag everything.
MIN_NOISE = 0.01


def _key(rec):
    if rec["op"] == "gemm":
        return ("gemm", rec["kind"], rec["shape"], rec["dtype"], rec["threads"])
    return ("conv", rec["layer"], f"N={rec['batch']}", rec.get("layout", "NCHW"), rec["dtype"],
            rec["threads"])


def _records(report):
    return {_key(r): r for r in report["gemm"] + report["conv"]["records"]}


def _ours_and_peer(rec):
    """[(our party name, peer name or None)] in a record."""
    peer = "numpy" if rec["op"] == "gemm" else "torch"
    peer = peer if peer in rec["results"] else None
    return [(name, peer) for name in rec["results"] if name.startswith("tilegemm")]


def _band(*spreads):
    return max(MIN_NOISE, 2 * sum(spreads))


def _verdict(change, band):
    if change - 1 > band:
        return "faster"
    if 1 - change > band:
        return "SLOWER"
    return "~"


def compare_rows(a, b):
    """Rows comparing reports ``a`` and ``b`` (dicts from report.json).

    Returns
    -------
    rows : list of dict
        One per (case, tilegemm party) present in both, with ``gflops_a``,
        ``gflops_b``, ``change`` (B/A), ``noise``, ``verdict`` and, when the
        peer ran in both, ``peer``, ``ratio_a``, ``ratio_b``, ``ratio_change``,
        ``ratio_noise``, ``ratio_verdict``.
    only_a, only_b : int
        Cases present in one report only.
    """
    ra, rb = _records(a), _records(b)
    rows = []
    for key in [k for k in ra if k in rb]:
        for party, peer in _ours_and_peer(ra[key]):
            pa, pb = ra[key]["results"], rb[key]["results"]
            if party not in pb:
                continue
            change = pb[party]["gflops"] / pa[party]["gflops"]
            noise = _band(pa[party]["spread"], pb[party]["spread"])
            row = {"case": key, "party": party, "gflops_a": pa[party]["gflops"],
                   "gflops_b": pb[party]["gflops"], "change": change, "noise": noise,
                   "verdict": _verdict(change, noise)}
            if peer and peer in pb:
                ratio_a = pa[party]["gflops"] / pa[peer]["gflops"]
                ratio_b = pb[party]["gflops"] / pb[peer]["gflops"]
                rnoise = _band(pa[party]["spread"], pb[party]["spread"],
                               pa[peer]["spread"], pb[peer]["spread"])
                row.update(peer=peer, ratio_a=ratio_a, ratio_b=ratio_b,
                           ratio_change=ratio_b / ratio_a, ratio_noise=rnoise,
                           ratio_verdict=_verdict(ratio_b / ratio_a, rnoise))
            rows.append(row)
    return rows, len(set(ra) - set(rb)), len(set(rb) - set(ra))


def _machine_note(a, b):
    fields = ("brand", "isa", "cores", "l1d_bytes", "l2_bytes")
    diff = [f for f in fields if a["machine"].get(f) != b["machine"].get(f)]
    if not diff:
        return "Same machine description in both reports."
    return "Different machines: " + ", ".join(
        f"{f} {a['machine'].get(f)} -> {b['machine'].get(f)}" for f in diff)


def compare_text(a, b, name_a="A", name_b="B"):
    """The comparison as printable text (a table plus notes); names label the two reports."""
    rows, only_a, only_b = compare_rows(a, b)
    headers = ["op", "case", "dtype", "thr", "party", "A GFLOPS", "B GFLOPS",
               "B/A", "noise", "verdict", "peer", "A ours/peer", "B ours/peer", "B/A", "noise",
               "verdict"]
    table = []
    for r in rows:
        op, *case, dtype, threads = r["case"]
        line = [op, " ".join(str(c) for c in case), dtype, threads,
                r["party"].replace("tilegemm", "ours"),
                f"{r['gflops_a']:.1f}", f"{r['gflops_b']:.1f}", f"{r['change']:.3f}",
                f"±{100 * r['noise']:.0f}%", r["verdict"]]
        if "peer" in r:
            line += [r["peer"], f"{r['ratio_a']:.2f}", f"{r['ratio_b']:.2f}",
                     f"{r['ratio_change']:.3f}", f"±{100 * r['ratio_noise']:.0f}%",
                     r["ratio_verdict"]]
        else:
            line += ["-"] * 6
        table.append(line)
    notes = [
        f"A = {name_a} (created {a['created']}), B = {name_b} (created {b['created']}).",
        _machine_note(a, b),
        "B/A of GFLOPS moves with the machine; B/A of the ratio to the peer (interleaved in "
        "each run) is what tells whether tilegemm itself changed.",
        "noise = 2 x the repeat spreads recorded in both reports; beyond it a change is "
        "marked 'faster' or 'SLOWER', within it '~'.",
    ]
    if only_a or only_b:
        notes.append(f"Cases in one report only: {only_a} in A, {only_b} in B (not compared).")
    if not rows:
        notes.insert(0, "No case appears in both reports.")
        return "\n".join(notes)
    return format_table(headers, table) + "\n\n" + "\n".join(notes)
