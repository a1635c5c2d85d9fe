"""``bench --compare A.json B.json``: did anything get slower from A to B?

For every case and tilegemm party present in both reports the time per call
(the best of the repeats) is compared, B against A.  A change counts only when
it exceeds both

* the **threshold** (``--threshold``, default :data:`DEFAULT_THRESHOLD`), and
* the **noise band** of that row, from the repeats themselves: the relative
  spread (median - min) / median of the party's repeats in A plus the same in B
  (at least :data:`NOISE_FLOOR`).  A row whose repeats scattered widely needs a
  larger change before it is called slower.

Beyond both, a row is ``faster`` or ``SLOWER``, otherwise ``~``; any ``SLOWER``
row makes ``bench --compare`` exit with status 1, so it can fail a CI job.

The ratio to the interleaved peer (numpy for GEMM, torch or else numpy's
explicit im2col for convolution) is
shown beside it, B / A: when tilegemm and its peer slowed down alike, the
machine changed, not the code.  Compare reports from the same machine; the
machine descriptions are compared and a difference is stated.
"""
from tilegemm.tools.report import format_table

#: Slow-down (fraction) that counts as a regression when the noise band is smaller.
DEFAULT_THRESHOLD = 0.10

#: Smallest noise band, so that reports whose repeats agree exactly do not flag everything.
NOISE_FLOOR = 0.01


def _key(rec):
    if rec["op"] == "gemm":
        return ("gemm", rec["kind"], rec["shape"], rec["dtype"], rec["threads"])
    return ("conv", rec["layer"], f"N={rec['batch']}", rec.get("layout", "NCHW"), rec["dtype"],
            rec["threads"])


def _case_text(key):
    op, *case, dtype, threads = key
    return f"{op} {' '.join(str(c) for c in case)} {dtype} {threads}t"


def _records(report):
    return {_key(r): r for r in report["gemm"] + report["conv"]["records"]}


def repeat_noise(party):
    """Relative spread of one party's repeats: (median - min) / median.

    Reads ``min_s`` (``best_s`` in reports that predate it) and ``median_s``.
    """
    low = party.get("min_s", party["best_s"])
    median = party.get("median_s", low)
    return (median - low) / median if median > 0 else 0.0


def _verdict(time_a, time_b, limit):
    if time_b / time_a - 1 > limit:
        return "SLOWER"
    if time_a / time_b - 1 > limit:
        return "faster"
    return "~"


def _row(key, party, pa, pb, threshold):
    """One compared row: tilegemm ``party`` of case ``key`` in results ``pa`` and ``pb``."""
    a, b = pa[party], pb[party]
    noise = max(NOISE_FLOOR, repeat_noise(a) + repeat_noise(b))
    row = {"case": key, "party": party, "ms_a": 1e3 * a["best_s"], "ms_b": 1e3 * b["best_s"],
           "change": a["best_s"] / b["best_s"], "noise": noise,
           "verdict": _verdict(a["best_s"], b["best_s"], max(threshold, noise))}
    # torch for convolutions when both runs had it, else numpy (GEMM, or conv's im2col peer).
    peer = "torch" if key[0] == "conv" and "torch" in pa and "torch" in pb else "numpy"
    if peer in pa and peer in pb:
        row["peer"] = peer
        row["peer_ratio_change"] = ((b["gflops"] / pb[peer]["gflops"])
                                    / (a["gflops"] / pa[peer]["gflops"]))
    return row


def compare_rows(a, b, threshold=DEFAULT_THRESHOLD):
    """Rows comparing reports ``a`` and ``b`` (dicts from report.json).

    Parameters
    ----------
    a, b : dict
        The reports, A the baseline.
    threshold : float
        Relative slow-down that counts when the noise band is narrower.

    Returns
    -------
    rows : list of dict
        One per (case, tilegemm party) present in both: ``ms_a``, ``ms_b``,
        ``change`` (A's time / B's: above 1 B is faster), ``noise``, ``verdict``
        (``"faster"``, ``"SLOWER"`` or ``"~"``) and, when the peer ran in both,
        ``peer`` and ``peer_ratio_change`` (B's ours/peer over A's).
    only_a, only_b : list of str
        Cases (or parties of a case) present in one report only.
    """
    ra, rb = _records(a), _records(b)
    rows, only_a, only_b = [], [], []
    for key in ra:
        if key not in rb:
            only_a.append(_case_text(key))
            continue
        pa, pb = ra[key]["results"], rb[key]["results"]
        for party in [p for p in pa if p.startswith("tilegemm")]:
            if party in pb:
                rows.append(_row(key, party, pa, pb, threshold))
            else:
                only_a.append(f"{_case_text(key)} {party}")
        only_b += [f"{_case_text(key)} {p}" for p in pb if p.startswith("tilegemm")
                   and p not in pa]
    only_b += [_case_text(key) for key in rb if key not in ra]
    return rows, only_a, only_b


def regressions(a, b, threshold=DEFAULT_THRESHOLD):
    """The rows of :func:`compare_rows` marked ``SLOWER``."""
    return [r for r in compare_rows(a, b, threshold)[0] if r["verdict"] == "SLOWER"]


def _machine_note(a, b):
    fields = ("brand", "isa", "cores", "l1d_bytes", "l2_bytes")
    diff = [f for f in fields if a["machine"].get(f) != b["machine"].get(f)]
    if not diff:
        return "Same machine description in both reports."
    return "DIFFERENT MACHINES, the times do not compare: " + ", ".join(
        f"{f} {a['machine'].get(f)} -> {b['machine'].get(f)}" for f in diff)


def _missing_note(label, cases, most=8):
    shown = "; ".join(cases[:most]) + (f"; and {len(cases) - most} more" if len(cases) > most
                                        else "")
    return f"Only in {label} (not compared): {shown}."


def compare_text(a, b, name_a="A", name_b="B", threshold=DEFAULT_THRESHOLD):
    """The comparison as printable text (a table plus notes); names label the two reports."""
    rows, only_a, only_b = compare_rows(a, b, threshold)
    headers = ["op", "case", "dtype", "thr", "party", "A ms", "B ms", "A/B time", "noise",
               "verdict", "peer", "ours/peer B/A"]
    table = []
    for r in rows:
        op, *case, dtype, threads = r["case"]
        table.append([op, " ".join(str(c) for c in case), dtype, threads,
                      r["party"].replace("tilegemm", "ours"), f"{r['ms_a']:.4g}",
                      f"{r['ms_b']:.4g}", f"{r['change']:.3f}", f"±{100 * r['noise']:.0f}%",
                      r["verdict"], r.get("peer", "-"),
                      f"{r['peer_ratio_change']:.3f}" if "peer" in r else "-"])
    slower = sum(r["verdict"] == "SLOWER" for r in rows)
    notes = [
        f"A = {name_a} (created {a['created']}), B = {name_b} (created {b['created']}).",
        _machine_note(a, b),
        f"A/B time above 1: B is faster. A row is 'faster' or 'SLOWER' when it changed by "
        f"more than the threshold ({100 * threshold:g}%) and its noise band (the repeats' "
        f"(median - min) / median in A plus in B, at least {100 * NOISE_FLOOR:g}%), else '~'.",
        "ours/peer B/A: the change of the ratio to the peer timed in the same rounds; near "
        "1 while the time changed means the machine changed, not tilegemm.",
        f"{slower} row(s) SLOWER." if slower else "No row is slower beyond its threshold.",
    ]
    if only_a:
        notes.append(_missing_note("A", only_a))
    if only_b:
        notes.append(_missing_note("B", only_b))
    if not rows:
        notes.insert(0, "No case appears in both reports.")
        return "\n".join(notes)
    return format_table(headers, table) + "\n\n" + "\n".join(notes)
