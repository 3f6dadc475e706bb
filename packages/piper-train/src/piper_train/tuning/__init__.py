"""``piper tune``: search schedules x pipeline/data/tensor/expert degrees x ZeRO x
microbatches x stage boundaries with the simulator and the memory estimate, then prove the
winners on the runtime.

``space`` (the candidates and their directive programs), ``costs`` (the profile and the
simulator's cost model) and ``search`` (compile, prune by memory, simulate, rank) import no
torch: a saved profile and a captured graph are all they need. ``profiler`` (measuring on the
runtime) and ``api`` (``tune``, ``validate``) use torch and Ray; they are imported on first
use. (piper-scheduler cannot host the search: it depends only on piper-ir, and the search
builds programs with the schedule library and the memory planner.)

Planning for hardware that is not here (``piper tune --hardware``, docs/planning.md):
``census`` counts a Hugging Face config's operators on fake tensors (torch, no weights) and
``planner`` prices every strategy from that count and a hardware file in closed form
(no torch); ``calibrate`` measures this machine into such a file (``piper tune --calibrate``).
"""

import importlib

_LAZY = {
    "tune": "piper_train.tuning.api",
    "validate": "piper_train.tuning.api",
    "TuneReport": "piper_train.tuning.api",
    "Measured": "piper_train.tuning.api",
    "Profile": "piper_train.tuning.costs",
    "Candidate": "piper_train.tuning.space",
    "enumerate_space": "piper_train.tuning.space",
    "search": "piper_train.tuning.search",
    "SearchResult": "piper_train.tuning.search",
    "Evaluation": "piper_train.tuning.search",
    "Census": "piper_train.tuning.census",
    "hf_census": "piper_train.tuning.census",
    "Planner": "piper_train.tuning.planner",
    "Plan": "piper_train.tuning.planner",
    "Setting": "piper_train.tuning.planner",
    "Calibration": "piper_train.tuning.calibrate",
    "measure": "piper_train.tuning.calibrate",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)
