"""One rank's side of a run: ``RankWorker`` and the parts it wires (compute, communication,
data parallelism, optimizers, the executor that walks the plan)."""
