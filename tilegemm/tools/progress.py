"""Progress of a long measurement: a bar on stderr, records on stdout as they finish."""
import shutil
import sys
import time


def _duration(seconds):
    """``"42s"``, ``"3m05s"``."""
    seconds = int(round(seconds))
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """A one-line bar with an ETA on a terminal, one plain line per step otherwise.

    The bar is as wide as the terminal (``shutil.get_terminal_size``, which also
    reads ``COLUMNS``), so it never wraps.

    Parameters
    ----------
    total : int
        Number of steps.
    stream : file, optional
        Where the bar goes; defaults to ``sys.stderr`` so that stdout keeps only results.
    out : file, optional
        Where :meth:`write` prints results; defaults to ``sys.stdout``.
    """

    def __init__(self, total, stream=None, out=None):
        self.total, self.count = total, 0
        self.stream = stream or sys.stderr
        self.out = out or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.label, self.shown = "", False

    def _bar_line(self):
        columns = shutil.get_terminal_size().columns
        elapsed = time.perf_counter() - self.t0
        finished = self.count - 1
        eta = (f"ETA {_duration(elapsed / finished * (self.total - finished))}"
               if finished else "ETA ?")
        width = max(5, min(24, columns // 5))
        filled = width * finished // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total} "
                f"{_duration(elapsed)} {eta}  {self.label}")
        # One column short of the width: a full line would wrap on some terminals.
        return line[:max(columns - 1, 1)]

    def _clear(self):
        if self.shown:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self.shown = False

    def _draw(self):
        self._last = self._bar_line()
        self.stream.write("\r" + self._last)
        self.stream.flush()
        self.shown = True

    def step(self, label):
        """Announce that step ``label`` is starting."""
        self.count += 1
        self.label = label
        if self.tty:
            self._clear()
            self._draw()
        else:
            elapsed = time.perf_counter() - self.t0
            self.stream.write(f"[{self.count}/{self.total}] {elapsed:.0f}s {label}\n")
            self.stream.flush()

    def write(self, text):
        """Print ``text`` (a finished result) on ``out`` without garbling the bar."""
        if not text:
            return
        if self.tty:
            self._clear()
            self.stream.flush()
        print(text, file=self.out, flush=True)
        if self.tty:
            self._draw()

    def close(self, interrupted=False):
        """Remove the bar and say how long the steps took."""
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            self._clear()
        what = (f"interrupted in step {self.count} of {self.total}" if interrupted
                else f"done: {self.total} step(s)")
        self.stream.write(f"{what} in {_duration(elapsed)}\n")
        self.stream.flush()
