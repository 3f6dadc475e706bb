"""piper-train: the front door composing Piper's packages (Trainer, reference, the piper CLI)."""

from piper_train._version import __version__ as __version__

__all__ = ["Trainer", "ReferenceTrainer", "run_check", "build_model", "load_workload"]


def __getattr__(name: str):  # lazy, so `import piper_train.models` stays light
    if name == "Trainer":
        from piper_train.trainer import Trainer

        return Trainer
    if name == "ReferenceTrainer":
        from piper_train.reference import ReferenceTrainer

        return ReferenceTrainer
    if name == "run_check":
        from piper_train.check import run_check

        return run_check
    if name == "build_model":
        from piper_train.models import build_model

        return build_model
    if name == "load_workload":
        from piper_train.workload import load_workload

        return load_workload
    raise AttributeError(name)
