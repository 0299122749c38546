"""Writing a benchmark's result files: the run's metadata and the {json, md} pair named by device and time."""
from __future__ import annotations

import datetime
import json
import os
import sys


def run_meta(script: str) -> tuple[dict, datetime.datetime]:
    """(device, versions, date and command of this run, its UTC time) for a result file.

    Example::

        >>> meta, now = run_meta("benchmarks/bwd_kernels.py")   # doctest: +SKIP
        >>> sorted(meta)                                          # doctest: +SKIP
        ['command', 'date', 'device', 'torch', 'triton']
    """
    import torch
    import triton

    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=f"{now:%Y-%m-%d %H:%MZ}", command=f"python {script} " + " ".join(sys.argv[1:])), now


def write_result(out_dir: str, prefix: str, meta: dict, now: datetime.datetime, rows: list, lines: list[str]) -> str:
    """Write ``<prefix>-<device>-<date>.json`` (meta and rows) and ``.md`` (lines) under ``out_dir``, print the
    markdown and return the name.

    Example::

        >>> write_result("/tmp/out", "bwd-kernels", meta, now, rows, lines)   # doctest: +SKIP
        'bwd-kernels-nvidia-h200-2026-11-30-0555'
    """
    name = f"{prefix}-{meta['device'].lower().replace(' ', '-')}-{now:%Y-%m-%d-%H%M}"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return name
