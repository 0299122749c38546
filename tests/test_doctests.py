"""The docstrings' examples run: every module of the package through doctest, with ``torch`` and ``mods``
(``from fa3_inductor import mods``) in scope as the examples assume. Examples that need a GPU, a model or a
process group say ``# doctest: +SKIP``; the rest must print what they show.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import fa3_inductor
from fa3_inductor import mods

MODULES = sorted(m.name for m in pkgutil.walk_packages(fa3_inductor.__path__, "fa3_inductor."))


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "mods": mods}, report=False,
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (run doctest on it)"
