"""The leader side of a run: the step machine and the coordinator shell around it, liveness, pacing, laggard
resync, the task pool, and the run driver. It shares only the contract modules of ``peer.runtime`` (control
messages, spec, wire, roles, bounds, grants, checkpoints, stage state) with the workers, never their code."""
