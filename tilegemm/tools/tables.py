"""Plain-text and Markdown tables: the cell formats every report table shares."""


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


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
