"""The package's logger: ``logging.getLogger("fa3_inductor")``.

Turn it on with ``TORCH_LOGS=+fa3_inductor`` style handlers or plainly::

    >>> import logging; logging.getLogger("fa3_inductor").setLevel(logging.INFO)
"""

from __future__ import annotations

import logging

log = logging.getLogger("fa3_inductor")
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
