"""Small JSON files of measured figures in the cache directory, read and written safely."""
import json
import os


def load_json(path):
    """The dict stored at ``path``; {} when there is none or it is damaged (measure again)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_json(path, data):
    """Write ``data`` to ``path`` atomically (two processes never leave half a file); a
    read-only cache costs a measurement next time, nothing else."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
