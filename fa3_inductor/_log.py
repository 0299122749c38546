"""The package's log channel: ``logging.getLogger("fa3_inductor")``, also a torch log.

During compilation it says, for every attention site, what recognition did (rewritten into
flex_attention with which mods/mask/GQA, or left alone and why) and what the lowering chose
(hopper / generic template, or torch's kernel and why). Turn it on like torch's own logs::

    TORCH_LOGS="fa3_inductor" python train.py        # INFO: one line per decision
    TORCH_LOGS="+fa3_inductor,recompiles" python ...  # DEBUG, combined with torch's logs

or from Python::

    >>> import logging, torch
    >>> torch._logging.set_logs(modules={"fa3_inductor": logging.INFO})  # doctest: +SKIP

Plain ``logging`` works too (``logging.getLogger("fa3_inductor").setLevel(logging.INFO)`` plus
a handler). The name is the package's, not a short alias: TORCH_LOGS is read when torch is
imported, before this package can register anything, and torch accepts any importable module
name there.
"""

from __future__ import annotations

import logging

LOG_NAME = "fa3_inductor"
log = logging.getLogger(LOG_NAME)


def register_torch_log() -> None:
    """Make "fa3_inductor" a registered torch log (as TORCH_LOGS=fa3_inductor would), so
    ``torch._logging.set_logs`` and TORCH_LOGS treat it like torch's own. Idempotent."""
    try:
        from torch._logging._internal import log_registry
    except ImportError:  # a torch without the registry: plain logging still works
        return
    if not log_registry.is_log(LOG_NAME):
        log_registry.register_log(LOG_NAME, LOG_NAME)


_said: set[str] = set()


def info_once(message: str) -> None:
    """Log ``message`` at INFO the first time it is seen in this process."""
    if message not in _said:
        _said.add(message)
        log.info(message)


def warn_once(message: str) -> None:
    """Log ``message`` at WARNING the first time it is seen in this process."""
    if message not in _said:
        _said.add(message)
        log.warning(message)
