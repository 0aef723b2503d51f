"""The leader side of a run: the coordinator, laggard resync, the task pool and the run driver."""
