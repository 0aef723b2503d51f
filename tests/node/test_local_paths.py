"""The run record carries no local paths, and a joiner opens nothing a record names (unit).

A record is written by whoever started the run; if a joiner followed its corpus, tokenizer, model, checkpoint
or save paths, the publisher could make every volunteer read (and, as a new leader, write) files of its
choosing. A joiner's paths are its own; the record fixes only fingerprints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tasklet.peer.cli import join_paths
from tasklet.peer.compute.textdata import load_corpus
from tasklet.peer.config import RunConfig, local_paths_from_toml, strip_local_paths
from tasklet.peer.node.joining import JoinError, check_files, joiner_config
from tasklet.peer.swarm.membership import RunRecord

HOSTILE = {
    ("run", "corpus"): "~/secret.txt",
    ("run", "tokenizer"): "/etc/tasklet-tokenizer",
    ("model", "config"): "/etc/tasklet-model/config.json",
    ("swarm", "checkpoint_dir"): "~/.ssh",
    ("swarm", "save_dir"): "/etc/cron.d",
    ("log", "tensorboard_dir"): "~/.config/autostart",
    ("emulation", "scenario"): "/etc/passwd:x",
}
_OPENED: list[str] = []  # paths the audit hook saw opened or listed while ``_WATCH`` holds
_WATCH: list[bool] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCH and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | Path):
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)  # an audit hook cannot be removed; it records only while a test sets _WATCH


def _hostile_record(fingerprint: str) -> RunRecord:
    data = RunConfig().public_dict()
    for (section, key), value in HOSTILE.items():
        data[section][key] = value
    return RunRecord({**data, "fingerprint": fingerprint, "model_fingerprint": ""}, 0.0, "publisher")


def _text_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "own.txt"
    corpus.write_text("the joiner's own training text, long enough to make a few sequences. " * 200)
    return corpus


def test_the_published_record_names_no_local_path() -> None:
    config = RunConfig()
    for (section, key), value in HOSTILE.items():
        setattr(getattr(config, section), key, value)
    record = config.record_dict()
    for section, key in HOSTILE:
        assert key not in record[section], f"[{section}] {key} was published"
    assert record["run"]["steps"] == config.run.steps and record["model"]["n_layers"] == config.model.n_layers
    kept = RunConfig()
    kept.model.config, kept.emulation.scenario = "tiny-llama", "worldwide_geo_distributed"
    shared = kept.record_dict()  # names of no file: every peer resolves them alike
    assert shared["model"]["config"] == "tiny-llama" and shared["run"]["corpus"] == "stdlib"
    assert shared["emulation"]["scenario"] == "worldwide_geo_distributed"
    assert strip_local_paths({"run": {"corpus": "../../etc/passwd"}})[1] == ["[run] corpus"]


def test_a_joiner_opens_nothing_a_hostile_record_names(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    own_corpus = _text_corpus(tmp_path)
    fingerprint = load_corpus(str(own_corpus)).fingerprint
    own = {("run", "corpus"): str(own_corpus), ("swarm", "checkpoint_dir"): str(tmp_path / "ck"),
           ("swarm", "save_dir"): str(tmp_path / "save")}
    record = _hostile_record(fingerprint)
    _OPENED.clear()
    _WATCH.append(True)
    try:
        with caplog.at_level(logging.WARNING, logger="tasklet.peer.node.joining"):
            config = joiner_config(record.config, own, "tasklet")
            files = check_files(config, record)
    finally:
        _WATCH.clear()
    hostile = [os.path.expanduser(v.split(":")[0]) for v in HOSTILE.values()]
    touched = [p for p in _OPENED if any(os.path.expanduser(p).startswith(h) for h in hostile)]
    assert touched == [], f"the joiner opened paths the record names: {touched}"
    assert str(own_corpus) in _OPENED  # the watch saw the joiner read its own data
    assert files.fingerprint == fingerprint
    assert config.run.corpus == str(own_corpus) and config.run.tokenizer == "" and config.model.config == ""
    # a taken-over leader writes where this peer says, not where the record says
    assert config.swarm.save_dir == str(tmp_path / "save")
    assert config.swarm.checkpoint_dir == str(tmp_path / "ck")
    assert config.log.tensorboard_dir == "" and config.emulation.scenario == ""
    assert "not followed" in caplog.text and "[swarm] save_dir" in caplog.text


def test_a_joiner_without_its_own_data_is_refused_by_the_fingerprint(tmp_path: Path) -> None:
    fingerprint = load_corpus(str(_text_corpus(tmp_path))).fingerprint
    record = _hostile_record(fingerprint)
    config = joiner_config(record.config, {}, "tasklet")  # no --data: the standard library, not the record's
    assert config.run.corpus == "stdlib"
    with pytest.raises(JoinError, match="--data"):
        check_files(config, record)
    no_fingerprint = RunRecord({k: v for k, v in record.config.items() if k != "fingerprint"}, 0.0, "p")
    with pytest.raises(JoinError, match="no data or model fingerprint"):
        check_files(joiner_config(no_fingerprint.config, {("run", "corpus"): str(tmp_path / "own.txt")}, "t"),
                    no_fingerprint)


def test_join_paths_come_from_flags_then_the_own_run_toml_then_the_state_folder(tmp_path: Path) -> None:
    toml = tmp_path / "own.toml"
    toml.write_text('[run]\ncorpus = "mine.txt"\nsteps = 999\n[swarm]\nsave_dir = "out"\nmin_peers = 7\n')
    assert local_paths_from_toml(toml) == {("run", "corpus"): "mine.txt", ("swarm", "save_dir"): "out"}
    flags = {"config": str(toml), "data": None, "tokenizer": None, "model": "tiny-llama", "checkpoint_dir": None,
             "save_dir": "flag-out", "state_dir": None, "identity": str(tmp_path / "keys" / "id.key")}
    paths = join_paths(argparse.Namespace(**flags))
    assert paths == {("run", "corpus"): "mine.txt", ("swarm", "save_dir"): "flag-out",
                     ("model", "config"): "tiny-llama",
                     ("swarm", "checkpoint_dir"): str(tmp_path / "keys" / "checkpoints")}
    bare = join_paths(argparse.Namespace(**{**flags, "config": None, "identity": None, "model": None,
                                            "save_dir": None}))
    assert bare == {}


def test_an_assignment_is_built_from_this_peers_own_files_not_the_leaders() -> None:
    from dataclasses import replace

    from tasklet.peer.runtime.stage.assignment import with_local_files
    from tasklet.protocol.errors import Rejected

    config = RunConfig()
    config.model.config = "tiny-llama"
    local = config.spec(corpus_fingerprint="f" * 64)
    local = replace(local, corpus="/home/me/data.txt", tokenizer="/home/me/tok",
                    model=replace(local.model, checkpoint="/home/me/model", source="/home/me/model/config.json"))
    sent = replace(local, corpus="~/secret.txt", tokenizer="/etc/tok",
                   model=replace(local.model, checkpoint="/etc/leader-model", source="/etc/x.json"))
    built = with_local_files(sent, local)
    assert (built.corpus, built.tokenizer) == ("/home/me/data.txt", "/home/me/tok")
    assert built.model.checkpoint == "/home/me/model" and built.model.source == "/home/me/model/config.json"
    assert built.model.config == sent.model.config and built.seed == sent.seed
    assert with_local_files(sent, None) is sent  # a worker without a daemon (in-process tests) takes it as sent
    with pytest.raises(Rejected, match="model"):
        with_local_files(replace(sent, model=replace(sent.model, fingerprint="0" * 64)), local)
    with pytest.raises(Rejected, match="data"):
        with_local_files(replace(sent, corpus_fingerprint="0" * 64), local)
