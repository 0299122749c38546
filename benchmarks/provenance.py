"""What a result file may say about the code that produced it.

A checkout's ``HEAD`` alone can mislead: the device machines run a copy of the working tree whose ``.git`` may be
older than its files (a run of 2026-11-29 recorded the session's first commit for a tree 26 commits later). So the
label adds ``+dirty`` when tracked files differ from that commit, and the result files' "Tree:" lines name the tree
itself. A device command can say which tree it runs: ``FA3_TREE=<commit> python benchmarks/...`` (the commit taken on
the machine that holds the repository) is then the label as given.
"""
from __future__ import annotations

import os
import subprocess
from typing import Optional


def commit_label(root: Optional[str] = None) -> Optional[str]:
    """The short commit of the checkout at ``root`` (default: this file's), ``+dirty`` when tracked files differ from
    it; None outside a git checkout. ``FA3_TREE`` in the environment, when set, is the label instead (the tree a device
    command says it runs, where the copy's ``.git`` may be stale).

    Example::

        >>> label = commit_label()
        >>> label is None or len(label.split("+")[0]) >= 7
        True
    """
    given = os.environ.get("FA3_TREE", "").strip()
    if given:
        return given
    root = root or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> Optional[str]:
        try:
            run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout if run.returncode == 0 else None

    head = (git("rev-parse", "--short", "HEAD") or "").strip()
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if changed is None or changed.strip() else "")
