"""Where a one-off benchmark script writes its Markdown report: OUT/DATE-NAME.md."""

import datetime
import json
import os


def write_dated_report(out_dir: str, name: str, text: str) -> str:
    """Write `text` to out_dir/DATE-name.md (the folder made if needed); its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{name}.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def write_dated_result(out_dir: str, name: str, text: str, result: dict) -> str:
    """Write `text` to out_dir/DATE-name.md and `result` to DATE-name.json; their common path, no suffix."""
    base = write_dated_report(out_dir, name, text)[: -len(".md")]
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return base
