"""The training runtime: stage workers, the coordinator that drives steps, and the task pool."""
