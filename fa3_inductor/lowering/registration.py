"""Registration of our lowerings in Inductor's lowering table: the one place that installs them.

Both wrap Inductor's own lowering and act only while the fa3 backend compiles (see
``common.active_pass``), so installing them once per process is harmless for other backends.

Example::

    >>> from fa3_inductor.lowering import registration; registration.install()
"""

from __future__ import annotations

from . import flex_backward_lowering, flex_lowering


def install() -> None:
    """Wrap Inductor's flex_attention and flex_attention_backward lowerings (idempotent)."""
    flex_backward_lowering.install()
    flex_lowering.install()
