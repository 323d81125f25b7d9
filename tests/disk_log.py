"""Reading back what a recipe logged with torchtune's DiskLogger (``metric_logger.filename=log.txt``)."""

import re
from pathlib import Path


def read_log(out: Path) -> dict:
    """{step: {metric: value}} from ``out/logs/log.txt``."""
    steps = {}
    for line in (out / "logs" / "log.txt").read_text().splitlines():
        m = re.match(r"Step (\d+) \| (.*)", line)
        if m:
            steps[int(m.group(1))] = {k: float(v) for k, v in (kv.split(":") for kv in m.group(2).split())}
    return steps
