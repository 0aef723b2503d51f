"""Verified averaging: what the all-gather digest and the direction test cost a replica, per step.

``python -m bench.verify [--json] [--numel N ...] [--replicas D ...] [--repeats R]``

In one process, on this machine's CPU (one torch thread), for a stage of ``numel`` fp32 parameters averaged by
``D`` replicas: ``sum_s`` is what the owner's sum of its shard costs today (the baseline the checks add to),
``digest_s`` what one replica spends on the digest (projections of its own contribution to every shard, then of
every summed shard it checks: ``2 x numel x K`` multiply-adds with seeded Gaussian weights), ``direction_s``
what an owner spends on the direction test of its shard's ``D`` contributions, ``digest_bytes`` the size of one
digest message (one is sent to each other replica, one extra message round after the all-gather) and
``gradient_bytes`` the reduce-scatter + all-gather traffic of the same replica, for comparison. ``detected``:
whether a summed shard scaled by 1000, or a single value moved by one unit, fails the check (a steering owner is
caught in the step it steers: the check is deterministic, steps to exclusion = 1).

A leader's orders (``orders``): what a worker's checks of one assignment cost (the spec against the signed one,
the stage's memory bound, every endpoint the order names against the live adverts), per assignment.

Spot checks (``[trust] spot_check``, peer.runtime.lead.spot), in the same run: ``spot.overhead`` is the mean step
time of real steps (8 worker processes on loopback, links shaped to the world-wide scenario scaled as in
``bench.bandwidth --validate``, compute emulated, 4 stages x 2 pipelines) with the run file's default spot checks
against the same run with them off, four runs in the order off, on, on, off (step 0, the processes' warm-up and
the newcomers' probation, is left out and reported apart). ``spot.detection``: for a cheater corrupting a
fraction ``q`` of its micro-batches, the probability that a step catches it and the steps until it is excluded,
simulated with the leader's own sampler and probation record (``--trials`` runs of ``--sim-steps`` steps; its
pipeline leases ``n_microbatches / pipelines`` micro-batches a step), for a cheater from its first task and for
a patient one that passes its probation clean first, and the steps the roll-back that follows its exclusion redoes
(with a checkpoint every step: from its first step with unverified applied work).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from tasklet.peer.compute.stage import shard_bounds
from tasklet.peer.runtime.stage import checks
from tasklet.peer.runtime.stage.exchange import digest_text


def _time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(numel: int, replicas: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    grads = [torch.randn(numel) for _ in range(replicas)]
    bounds = shard_bounds(numel, replicas)
    lo, hi = bounds[0]
    contributions = [g[lo:hi] for g in grads]

    def owner_sum() -> torch.Tensor:
        total = contributions[0].clone()
        for c in contributions[1:]:
            total.add_(c)
        return total

    summed = [sum(g[a:b] for g in grads) for a, b in bounds]
    seeds = [checks.digest_seed((0, 0), j, s) for j, s in enumerate(summed)]

    def digest() -> list[tuple[list[float], list[float]]]:
        mine = [checks.shard_digest(grads[0][a:b], seed) for (a, b), seed in zip(bounds, seeds, strict=True)]
        for s, seed in zip(summed, seeds, strict=True):
            checks.shard_digest(s, seed)
        return mine

    def direction() -> None:
        total = owner_sum()
        for c in contributions:
            checks.unrelatedness(c, total - c)

    digests = [[checks.shard_digest(g[a:b], seed) for (a, b), seed in zip(bounds, seeds, strict=True)]
               for g in grads]

    def caught(change: str) -> bool:
        s = summed[1].clone()
        s = s * 1000.0 if change == "scale" else s.index_add_(0, torch.tensor([3]), torch.tensor([1.0]))
        seed = checks.digest_seed((0, 0), 1, s)
        parts = [checks.shard_digest(g[bounds[1][0]:bounds[1][1]], seed) for g in grads]
        return checks.sum_mismatch(s, seed, parts, 1) > 1.0

    return {
        "numel": numel, "replicas": replicas,
        "sum_s": _time(owner_sum, repeats),
        "digest_s": _time(digest, repeats),
        "direction_s": _time(direction, repeats),
        "digest_bytes": len(digest_text((seeds, digests[0])).encode()),
        "gradient_bytes": 2 * 4 * (numel - (hi - lo)),
        "detected": {"scale_1000": caught("scale"), "one_value": caught("one")},
    }


DEFAULT_TRUST = {"spot_check": 0.05, "probation_check": 1.0, "probation_microbatches": 1}  # peer.config's [trust]


def overhead(steps: int) -> dict[str, Any]:
    """Mean step time with the default spot checks and without, on the emulated world-wide swarm (module doc)."""
    import dataclasses

    from bench.bandwidth import VALIDATE_BANDWIDTH_SCALE, VALIDATE_FWD_S, VALIDATE_WORKLOAD, world
    from tasklet.peer.compute.model import ModelConfig
    from tasklet.peer.compute.stage import OptimConfig
    from tasklet.peer.emulation.local import LocalSwarm
    from tasklet.peer.emulation.network import link_model, scaled_cluster
    from tasklet.peer.runtime.spec import RunSpec
    from tasklet.scheduler.plan import even_stages

    w = VALIDATE_WORKLOAD
    cluster = scaled_cluster(world(), VALIDATE_BANDWIDTH_SCALE, w.stage_forward_flops(1, 2) / VALIDATE_FWD_S / 5e13)
    model = ModelConfig(n_layers=w.n_layers, d_model=w.d_model, n_heads=w.n_heads, seq_len=w.seq_len, seed=1)
    base = RunSpec(run_id="bench-verify", model=model, optim=OptimConfig(lr=3e-3, eps=1e-3), seed=3,
                   micro_batch=w.micro_batch, n_microbatches=w.n_microbatches)
    out: dict[str, Any] = {"steps": steps, "layout": "4 stages x 2 pipelines", "order": "off, on, on, off",
                           **DEFAULT_TRUST}
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for name in ("off", "on", "on", "off"):  # ABBA: a drift of the machine's load weighs on both alike
        spec = base if name == "off" else dataclasses.replace(base, **DEFAULT_TRUST)
        with LocalSwarm(spec, 8, links=link_model(cluster), forward_flops=w.stage_forward_flops,
                        heartbeat_s=2.0) as swarm:
            result = swarm.train((even_stages(w.n_layers, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]), steps,
                                 collect_states=False)
        secs = result.step_seconds
        runs[name].append({"step0_s": round(secs[0], 3), "mean_step_s": round(sum(secs[1:]) / len(secs[1:]), 3),
                           "checked": sum(r.spot_checked for r in result.reports),
                           "verified": sum(r.spot_verified for r in result.reports)})
    for name, rs in runs.items():
        out[name] = {"runs": rs, "mean_step_s": round(sum(r["mean_step_s"] for r in rs) / len(rs), 3)}
    out["overhead"] = round(out["on"]["mean_step_s"] / out["off"]["mean_step_s"] - 1.0, 3)
    return out


def detection(q: float, patient: bool, trials: int, steps: int, per_step: int = 4) -> dict[str, Any]:
    """How soon the leader's sampler catches a cheater corrupting a fraction ``q`` of its micro-batches (module
    doc); ``patient``: it works honestly until its probation is over."""
    import random

    from tasklet.peer.runtime.lead.spot import Probation, SpotChecks

    rng = random.Random(11)
    caught_at: list[int] = []
    applied: list[int] = []  # corrupted micro-batches of the steps before the one that caught it (they were applied)
    redone: list[int] = []  # steps the roll-back redoes (a checkpoint every step): since its first unverified work
    for _ in range(trials):
        probation = Probation(DEFAULT_TRUST["probation_check"], DEFAULT_TRUST["probation_microbatches"])

        def rate(pipeline: int, record: Probation = probation) -> float:
            return DEFAULT_TRUST["probation_check"] if record.on_probation("c") else DEFAULT_TRUST["spot_check"]

        reached, first_unverified = 0, None
        for step in range(steps):
            spot = SpotChecks(step, 2, rate, rng=rng)
            caught, corrupted, unverified = False, 0, False
            for mb in range(per_step):
                cheats = rng.random() < q and not (patient and probation.on_probation("c"))
                corrupted += cheats
                if spot.sample(mb, 0):
                    if cheats:
                        caught = True  # its pipeline's whole step is dropped: nothing of this step is applied
                        break
                    probation.credit(["c"])
                else:
                    unverified = True
            if caught:
                caught_at.append(step + 1)
                applied.append(reached)
                # the catching step ends without it (step + 1 applied); back to the checkpoint of its first
                # unverified step, or nothing to redo when all its applied work was verified
                redone.append(0 if first_unverified is None else step + 1 - first_unverified)
                break
            reached += corrupted
            if unverified and first_unverified is None:
                first_unverified = step
    per_step_p = 1 - (1 - DEFAULT_TRUST["spot_check"] * q) ** per_step
    return {"q": q, "patient": patient, "caught": round(len(caught_at) / trials, 4),
            "mean_steps_to_exclusion": round(sum(caught_at) / len(caught_at), 2) if caught_at else None,
            "mean_corrupted_microbatches_applied": round(sum(applied) / len(applied), 2) if applied else None,
            "mean_steps_redone": round(sum(redone) / len(redone), 2) if redone else None,
            "detection_per_step_after_probation": round(per_step_p, 4)}


def order_checks(repeats: int, peers: int = 256) -> list[dict[str, Any]]:
    """What a worker's checks of one leader's order cost (``peer.runtime.stage.assignment``,
    ``peer.node.leadership``), per assignment: the spec compared field by field with the signed one, the stage's
    memory bound from its shapes, and every endpoint the order names looked up among ``peers`` live adverts."""
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.compute.model import ModelConfig
    from tasklet.peer.node.leadership import Leadership
    from tasklet.peer.runtime import control as ctl
    from tasklet.peer.runtime.assign import build_assignments
    from tasklet.peer.runtime.bounds import stage_memory_bytes
    from tasklet.peer.runtime.spec import RunSpec
    from tasklet.peer.runtime.stage.assignment import order_endpoints, require_signed_spec
    from tasklet.peer.swarm.adverts import Advert

    device = DeviceInfo("bench", "cpu", 2**34, 1.0, False, True)
    adverts = [Advert(f"p{i:04d}", f"127.0.{i // 250}.{i % 250 + 1}:5000", device, 0.0) for i in range(peers)]
    gate = Leadership("me", 1, 1.0, "any", None, None, lambda: adverts)  # type: ignore[arg-type]
    rows = []
    for name, model in (("byte GPT 4 x 64", ModelConfig()),
                        ("byte GPT 12 x 1024 (152M)", ModelConfig(n_layers=12, d_model=1024, n_heads=16, seq_len=512))):
        spec = RunSpec(model=model)
        eps = [a.endpoint for a in adverts[:8]]
        assignments = build_assignments(spec, [(0, model.n_layers // 2), (model.n_layers // 2, model.n_layers)],
                                        [[0, 1], [2, 3], [4, 5], [6, 7]], eps, eps[0] + "/coordinator", leader="p0000")
        a = assignments[eps[3]]
        source = ctl.StateSource(kind=ctl.SourceKind.FETCH, step=3, endpoint=eps[1], grant="g")
        ids = {ep: f"p{i:04d}" for i, ep in enumerate(eps)}
        best = float("inf")
        for _ in range(max(1, repeats) * 20):
            t0 = time.perf_counter()
            require_signed_spec(spec, spec)
            stage_memory_bytes(spec, a.layers, in_flight=a.n_stages - a.stage)
            assert all(gate.may_dial(ep, ids[ep.split("/")[0]]) for ep, _ in order_endpoints(spec, a, source))
            best = min(best, time.perf_counter() - t0)
        rows.append({"model": name, "adverts": peers, "check_ms": round(best * 1e3, 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 4_000_000],
                        help="stage sizes in parameters (default: %(default)s)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="group sizes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6, help="steps of each spot-check swarm run (default: "
                        "%(default)s)")
    parser.add_argument("--trials", type=int, default=2000, help="simulated cheaters per q (default: %(default)s)")
    parser.add_argument("--sim-steps", type=int, default=500, help="steps a simulated cheater runs (default: "
                        "%(default)s)")
    parser.add_argument("--no-swarm", action="store_true", help="skip the spot checks' step-time overhead run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(n, d, args.repeats) for n in args.numel for d in args.replicas]
    spot = {"detection": [detection(q, patient, args.trials, args.sim_steps)
                          for q in (0.05, 0.2, 1.0) for patient in (False, True)]}
    if not args.no_swarm:
        spot["overhead"] = overhead(args.steps)
    orders = order_checks(args.repeats)
    if args.json:
        print(json.dumps({"rows": rows, "spot": spot, "orders": orders}))
        return
    print(json.dumps(spot, indent=1))
    for o in orders:
        print(f"a leader's order checked by a worker: {o['check_ms']:.3f} ms per assignment ({o['model']}, "
              f"{o['adverts']} live adverts)")
    for r in rows:
        print(f"numel {r['numel']:>10,}  D {r['replicas']}  sum {r['sum_s'] * 1e3:8.2f} ms  digest "
              f"{r['digest_s'] * 1e3:8.2f} ms  direction {r['direction_s'] * 1e3:8.2f} ms  digest "
              f"{r['digest_bytes']} B (gradients {r['gradient_bytes']:,} B)  detected {r['detected']}")


if __name__ == "__main__":
    main()
