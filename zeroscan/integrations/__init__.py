"""zeroscan inside the training frameworks people already use.

Each integration is its own module, imported only when first used, so
`import zeroscan` never imports a framework:

    zeroscan.integrations.transformers   ZeroscanCallback for transformers' Trainer
                                         (and TRL's trainers built on it)
    zeroscan.integrations.lightning      ZeroscanCallback for lightning.Trainer
    zeroscan.integrations.accelerate     monitor() and log() for Accelerate loops

Each needs its framework, installed with the extra of the same name of
zeroscan's distribution, torch-zeroscan (pip install "torch-zeroscan[transformers]",
or pip install --no-build-isolation -e ".[transformers]" in a checkout); without it, importing the module
raises an ImportError that names the extra. common.py holds what they share;
every report's scalars go to sinks (zeroscan.loggers.Sink).
"""

from __future__ import annotations

import importlib
from types import ModuleType

FRAMEWORKS = ("transformers", "lightning", "accelerate")

__all__ = list(FRAMEWORKS)


def __getattr__(name: str) -> ModuleType:
    # PEP 562: `zeroscan.integrations.transformers` imports that module (and
    # so the framework) the first time it is named, and never before.
    if name in FRAMEWORKS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
