"""A progress bar for long measurements: on stderr, so stdout keeps only the tables."""
import sys
import time


class Progress:
    """A progress bar on a terminal, one plain line per step otherwise.

    Parameters
    ----------
    total : int
        Number of steps.
    stream : file, optional
        Defaults to ``sys.stderr`` so that the tables on stdout stay clean.
    """

    def __init__(self, total, stream=None):
        self.total, self.count = total, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label):
        """Announce that step ``label`` is starting."""
        self.count += 1
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            width = 24
            filled = width * (self.count - 1) // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            line = f"\r[{bar}] {self.count}/{self.total} {elapsed:5.0f}s  {label}"
            self.stream.write(line[:120].ljust(120))
        else:
            self.stream.write(f"[{self.count}/{self.total}] {elapsed:.0f}s {label}\n")
        self.stream.flush()

    def close(self):
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(f"done: {self.total} step(s) in {elapsed:.0f}s\n")
        self.stream.flush()
