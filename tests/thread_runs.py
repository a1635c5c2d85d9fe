"""Running a test's work on several Python threads at once."""
import threading


def in_threads(work, n):
    """``work(i)`` on ``n`` Python threads at once; fails with their exceptions."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
