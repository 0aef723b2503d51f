"""Finding the run a peer joins and checking that this peer's files are the run's.

The first peer (`peer start`) brings the run's configuration and must find no run of that name; a joiner
waits for the published run and takes its configuration from it, except the local paths (data, tokenizer,
model folder, checkpoint and save folders), which are each peer's own: a record is written by whoever
started the run, and a path in it would make every joiner read or write there. Either way the peer's model
files and training data must have the fingerprints the run published, or it would train on something else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import hivemind

from tasklet.peer.compute.data import Corpus, CorpusError
from tasklet.peer.compute.family import family_of
from tasklet.peer.compute.textdata import load_corpus
from tasklet.peer.config import ConfigError, RunConfig, strip_local_paths, with_local_paths
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.swarm.membership import RunReadTimeoutError, RunRecord, SwarmSecretError, verify_swarm_secret
from tasklet.peer.timing import JOINER_RUN_WAIT_S

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """A one-line reason why this peer cannot take part in the run."""


@dataclass(frozen=True)
class FoundRun:
    """The run this peer takes part in: its configuration, the published record (None: this peer publishes
    it) and the join secret to use."""

    config: RunConfig
    existing: RunRecord | None
    secret: str | None


@dataclass(frozen=True)
class CheckedFiles:
    """This peer's corpus and spec, with the fingerprints the run publishes (or adopted from it)."""

    spec: RunSpec
    corpus: Corpus
    fingerprint: str
    model_fingerprint: str

    def record(self, config: RunConfig) -> dict[str, Any]:
        """The run record a first peer publishes."""
        return {**config.record_dict(), "fingerprint": self.fingerprint, "model_fingerprint": self.model_fingerprint}


def find_run(dht: hivemind.DHT, run_id: str, secret: str | None, config: RunConfig | None,
             own_paths: Mapping[tuple[str, str], str] | None = None, organiser: str | None = None) -> FoundRun:
    """The run to take part in: a new one from ``config`` (none of that name may exist) or, for a joiner
    (``config`` None), the one ``organiser`` signed (the join line's ``--organiser``; None: the only organiser
    any record names), waited for up to JOINER_RUN_WAIT_S, with the joiner's ``own_paths`` (``(section, key)``
    -> path) in place of any the record names."""
    deadline = time.monotonic() + JOINER_RUN_WAIT_S
    existing = _read_run(dht, run_id, secret, deadline, wait_for_record=False,
                         organiser=None if config is not None else organiser)
    if config is not None:
        if existing is not None:
            raise JoinError(f"a run named {run_id!r} already exists in this DHT; use `peer join` or another "
                            "[run] run_id")
        return FoundRun(config, None, config.swarm.secret or secret or None)
    existing = existing or _read_run(dht, run_id, secret, deadline, wait_for_record=True, organiser=organiser)
    if existing is None and organiser is not None:
        raise JoinError(f"no run named {run_id!r} signed by the organiser {organiser} can be read in this DHT "
                        "(check --organiser against the join line `peer start` printed, and --run/--secret)")
    if existing is None:
        # this peer's DHT node refuses records sealed with another secret (or sealed when it has none) before
        # anything reads them, so a wrong secret and a missing run look alike from here
        raise JoinError(f"no run named {run_id!r} can be read in this DHT: none is published (is `peer start` "
                        "running? use --run NAME for another run), or its records are sealed with another join "
                        "secret than this peer's (--secret-file, TASKLET_SECRET)")
    try:
        config = joiner_config(existing.config, own_paths or {}, run_id)
    except ConfigError as exc:
        raise JoinError(str(exc)) from None
    if organiser is None:
        log.warning("joining run %r of organiser %s, the only one it names: pass --organiser %s (the join line's) "
                    "to accept no other", run_id, existing.organiser, existing.organiser)
    return FoundRun(config, existing, secret or None)


def joiner_config(record: Mapping[str, Any], own_paths: Mapping[tuple[str, str], str], run_id: str) -> RunConfig:
    """A joiner's configuration: the run record's, its local paths dropped (logged: a record written by
    another version, or one meant to steer joiners to files of the attacker's choosing) and this peer's
    ``own_paths`` set. Nothing the record names is opened here or later."""
    published = {k: v for k, v in record.items() if k not in ("fingerprint", "model_fingerprint")}
    published, dropped = strip_local_paths(published)
    if dropped:
        log.warning("the run record names local paths (%s): not followed; this peer uses its own (peer join "
                    "--data/--tokenizer/--model/--checkpoint-dir/--save-dir, or --config)", ", ".join(dropped))
    try:
        return RunConfig.from_dict(with_local_paths(published, own_paths), where=f"run {run_id!r} from the DHT")
    except ConfigError as exc:
        if not dropped:
            raise
        raise ConfigError(f"{exc} (with this peer's own paths in place of the record's {', '.join(dropped)}: "
                          "name them with --model/--tokenizer/--data or --config)") from None


def _read_run(dht: hivemind.DHT, run_id: str, secret: str | None, deadline: float,
              wait_for_record: bool, organiser: str | None = None) -> RunRecord | None:
    """The published run, read until one is there (``wait_for_record``) or one read answers, until
    ``deadline``; a read that times out (a busy DHT) is tried again, a wrong secret is final."""
    while True:
        if wait_for_record:
            time.sleep(0.5)
        try:
            existing = verify_swarm_secret(dht, run_id, secret or None, organiser=organiser)
        except RunReadTimeoutError as exc:
            if time.monotonic() >= deadline:
                if wait_for_record:
                    return None
                raise JoinError(str(exc)) from None
            log.warning("%s; trying again", exc)
            continue
        except SwarmSecretError as exc:
            raise JoinError(str(exc)) from None
        if existing is not None or not wait_for_record or time.monotonic() >= deadline:
            return existing


def check_files(config: RunConfig, existing: RunRecord | None) -> CheckedFiles:
    """Load this peer's corpus and compare its and the model's fingerprints with the published run's."""
    own = config.spec()
    try:
        corpus = load_corpus(own.corpus, own.tokenizer, own.text_field, own.model)
    except CorpusError as exc:
        raise JoinError(f"[run] corpus: {exc}") from None
    except ValueError as exc:  # a tokenizer that cannot be read or does not fit the model (names its file)
        raise JoinError(f"[run] tokenizer: {exc}") from None
    family = family_of(own.model)
    model_fingerprint = family.fingerprint(own.model)
    published_model, published = model_fingerprint, corpus.fingerprint
    if existing is not None:  # the run fixes both fingerprints; a record without them is refused, never adopted
        published_model = existing.config.get("model_fingerprint")
        published = existing.config.get("fingerprint")
        if not isinstance(published, str) or not published or not isinstance(published_model, str):
            raise JoinError("the published run record has no data or model fingerprint: refusing to train on "
                            "files nobody can check (a run started by another version, or a forged record)")
    if model_fingerprint != published_model:
        raise JoinError(
            f"this peer's model files differ from the run's (fingerprint {model_fingerprint[:12]} vs "
            f"{published_model[:12]}): a different config.json or checkpoint at "
            f"{family.describe(own.model)} (a joiner names its model with --model)"
        )
    if corpus.fingerprint != published:
        raise JoinError(
            f"this peer's training data differs from the run's (fingerprint {corpus.fingerprint[:12]}"
            f" vs {published[:12]}): a different Python version or data (a joiner names its own with --data)"
        )
    return CheckedFiles(config.spec(corpus_fingerprint=published), corpus, published, published_model)
