"""The run configuration file (``run.toml``) that ``peer start`` publishes to the swarm.

Every field is declared once, here, with its default and a one-line explanation; the configuration reference
(docs/configuration.md, and ``peer config-reference``) is generated from these declarations, so it cannot drift.
Unknown keys and bad values are refused with the file, section and key named.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasklet.peer.runtime.choices import (
    COMPRESSIONS,
    DEFAULT_KEEP,
    GRAD_OUTLIER_FACTOR,
    PRECISIONS,
    PSEUDO_GRAD_COMPRESSIONS,
)
from tasklet.peer.timing import ADVERT_TTL_HEARTBEATS, CHECKPOINT_COPIES, HEARTBEAT_S, MAX_HEARTBEAT_S, QUORUM_WAIT_S

if TYPE_CHECKING:
    from tasklet.peer.runtime.spec import RunSpec


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the file, section and key."""


SECRET_ENV = "TASKLET_SECRET"  # the join secret from the environment (not visible in /proc/PID/cmdline)
MAX_SECRET_BYTES = 4096


def resolve_secret(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The join secret of a command: ``--secret``, else ``--secret-file`` (its first line), else the
    :data:`SECRET_ENV` variable; None when none is given. Why a file or the environment: every user of the
    machine can read a process's arguments in /proc, not its environment or a file of mode 0600."""
    if flag is not None and path is not None:
        raise ConfigError("give the join secret once: --secret or --secret-file, not both")
    if flag is not None:
        secret = flag
    elif path is not None:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"--secret-file {path}: {exc.strerror or exc}") from None
        if len(raw) > MAX_SECRET_BYTES:
            raise ConfigError(f"--secret-file {path}: longer than {MAX_SECRET_BYTES} bytes (not a secret file?)")
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise ConfigError(f"--secret-file {path}: not UTF-8 text") from None
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ConfigError(f"--secret-file {path}: the first line is empty")
    else:
        secret = environ.get(SECRET_ENV, "")
    return secret or None



def _f(default: Any, help: str) -> Any:  # noqa: A002 - "help" reads best in the declarations below
    return field(default=default, metadata={"help": help})


@dataclass
class RunSection:
    """[run] — what is trained and on which data."""

    run_id: str = _f("tasklet", "name of the run; peers join it with `peer join --run` (DHT key namespace)")
    steps: int = _f(20, "optimizer steps to train, then the swarm stops")
    seed: int = _f(0, "seed of the initial weights and of the data order")
    corpus: str = _f("stdlib", "training text: `stdlib` (this Python's standard library sources), or a text file, "
                     "JSONL or Parquet file, or a folder of them (`--data`)")
    tokenizer: str = _f("", "a local tokenizer folder read with transformers' AutoTokenizer; empty = byte-level")
    text_field: str = _f("text", "the field of JSONL records / Parquet rows that holds the text")
    micro_batch: int = _f(4, "sequences per micro-batch")
    n_microbatches: int = _f(8, "micro-batches per step (global batch = micro_batch x n_microbatches)")
    precision: str = _f("fp32", f"compute precision, one of {', '.join(PRECISIONS)} (fp32 master weights)")
    compression: str = _f("none", f"activations on the wire, one of {', '.join(COMPRESSIONS)}")
    grad_outlier_factor: float = _f(GRAD_OUTLIER_FACTOR, "a replica's gradient shard above this many times its "
                                    "group's median norm per micro-batch (or, when larger, the owner's whole "
                                    "gradient's) is refused and its sender excluded; 0 turns the check off")
    grad_direction_z: float = _f(5.0, "a replica's gradient shard whose direction is unrelated to its group's (within "
                                 "this many standard errors of noise) is refused and its sender excluded; 0: off")
    sync_period: int = _f(1, "data-parallel sync: 1 = exact gradient averaging every step; H > 1 = DiLoCo, each "
                          "pipeline takes H local AdamW steps, then the replicas average pseudo-gradients")
    outer_lr: float = _f(0.7, "DiLoCo outer learning rate (Nesterov SGD on the averaged pseudo-gradient)")
    outer_momentum: float = _f(0.9, "DiLoCo outer Nesterov momentum, in [0, 1)")
    pseudo_grad_compression: str = _f("none", "DiLoCo pseudo-gradients on the wire, one of "
                                      f"{', '.join(PSEUDO_GRAD_COMPRESSIONS)} "
                                      "(the topk ones: sparse, with error feedback)")
    outer_overlap: bool = _f(False, "DiLoCo: the outer round travels while the next round's first inner step "
                             "computes and lands one step late (hides the round behind compute)")


@dataclass
class ModelSection:
    """[model] — a Hugging Face model (`config`), or the built-in byte-level GPT-style decoder."""

    config: str = _f("", "a Hugging Face model: a preset (tiny-llama, tiny-gpt2, llama-3.2-1b, llama-3-8b, "
                     "gpt3-xl), a config.json, or a model folder (config.json + safetensors); empty = the byte GPT "
                     "shaped by the keys below")
    n_layers: int = _f(4, "transformer blocks (byte GPT only)")
    d_model: int = _f(64, "hidden size (byte GPT only)")
    n_heads: int = _f(4, "attention heads, must divide d_model (byte GPT only)")
    seq_len: int = _f(64, "tokens per sequence")


@dataclass
class OptimSection:
    """[optim] — AdamW."""

    lr: float = _f(1e-3, "learning rate")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay (not applied to norms and biases)")


@dataclass
class SwarmSection:
    """[swarm] — how the swarm forms and plans."""

    min_peers: int = _f(2, "the leader waits for this many live peers before the first plan")
    stages: int = _f(0, "pipeline stages; 0 lets the scheduler choose")
    secret: str = _f("", "join secret; empty = open swarm (a peer with a wrong secret is refused)")
    heartbeat_s: float = _f(
        HEARTBEAT_S, f"advert renewal period; a peer silent for {ADVERT_TTL_HEARTBEATS} heartbeats is gone"
    )
    plan_time_limit_s: float = _f(5.0, "time limit of the scheduler's search at each plan")
    checkpoint_dir: str = _f("", "where the leader writes checkpoints; empty = none")
    checkpoint_every: int = _f(0, "checkpoint every N steps (0 = only on SIGTERM)")
    checkpoint_keep: int = _f(DEFAULT_KEEP, "the newest this many checkpoints stay on the leader's disk")
    checkpoint_copies: int = _f(
        CHECKPOINT_COPIES, "other peers that keep a copy of every checkpoint (a new leader resumes from one)"
    )
    save_dir: str = _f("", "when set, the leader writes the final parameters of every stage and run.json here")
    quorum_wait_s: float = _f(QUORUM_WAIT_S, "a leader without a majority of the last plan's members pauses this "
                              "long, then goes on with those present in a new epoch")
    leaders: Any = _f(None, "who may lead: a list of stewards' peer ids in order of preference (empty: the "
                      "organiser's own peer); \"any\" lets the credited members elect one (an opt-in: an elected "
                      "member's orders are checked, but it can still stall the run; docs/security.md)")


@dataclass
class EmulationSection:
    """[emulation] — for local swarms: emulate a scenario's links and devices on this machine."""

    scenario: str = _f("", "scenario file[:name] or a name from the bundled scenarios; empty = no emulation")
    devices: list[int] = _f(None, "scenario device of each emulated peer (peer i emulates devices[i])")
    bandwidth_scale: float = _f(1.0, "multiplies every emulated link's bandwidth")
    tflops: float = _f(0.002, "emulated TFLOP/s of a device the scenario gives no figure for")
    tflops_scale: float = _f(1.0, "multiplies every emulated device's TFLOP/s")


@dataclass
class TrustSection:
    """[trust] — verified work: how much of the swarm's work is re-run on another pipeline and compared."""

    spot_check: float = _f(0.05, "fraction of micro-batches re-run on another pipeline as a shadow copy and compared "
                           "stage by stage (a cheater is excluded by the majority of three copies); 0: off")
    probation_check: float = _f(1.0, "fraction of a newcomer's micro-batches checked while it is on probation")
    probation_microbatches: int = _f(1, "verified micro-batches that end a peer's probation")


@dataclass
class LogSection:
    """[log] — where the leader writes training scalars (loss, tokens/s, s/step, plan epoch)."""

    tensorboard_dir: str = _f("", "the leader writes TensorBoard event files here (on its own machine); empty = off")
    wandb_project: str = _f("", "also log to this Weights & Biases project when `wandb` is installed; empty = off")


REQUIRED = (("run", "run_id"), ("run", "steps"))
SECTIONS: dict[str, type] = {
    "run": RunSection,
    "model": ModelSection,
    "optim": OptimSection,
    "swarm": SwarmSection,
    "emulation": EmulationSection,
    "trust": TrustSection,
    "log": LogSection,
}


@dataclass
class RunConfig:
    """The whole run.toml: what a person writes and ``peer start`` publishes, swarm and emulation settings
    included. The runtime never sees it; :meth:`spec` derives the :class:`~peer.runtime.spec.RunSpec`, the part
    every worker must agree on to compute the same step (model, optimizer, data, batch, numerics)."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    swarm: SwarmSection = field(default_factory=SwarmSection)
    emulation: EmulationSection = field(default_factory=EmulationSection)
    trust: TrustSection = field(default_factory=TrustSection)
    log: LogSection = field(default_factory=LogSection)

    # --------------------------------------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f.name: getattr(getattr(self, name), f.name) for f in fields(cls)} for name, cls in SECTIONS.items()
        }

    def public_dict(self) -> dict[str, dict[str, Any]]:
        """:meth:`to_dict` without the join secret: what may be published (DHT run record, run.json, scalars)."""
        data = self.to_dict()
        data["swarm"] = {key: value for key, value in data["swarm"].items() if key != "secret"}
        return data

    def record_dict(self) -> dict[str, dict[str, Any]]:
        """:meth:`public_dict` without this peer's local paths: what the run record carries."""
        return strip_local_paths(self.public_dict())[0]

    def to_toml(self) -> str:
        """This configuration as a run.toml (every key spelled out; JSON scalars and lists are valid TOML)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table of sections")
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"{where}: unknown section [{unknown[0]}] (known: {', '.join(SECTIONS)})")
        out = cls()
        for name, section_cls in SECTIONS.items():
            values = data.get(name, {})
            if not isinstance(values, dict):
                raise ConfigError(f"{where}: [{name}] must be a table")
            setattr(out, name, _section(section_cls, values, f"{where}: [{name}]"))
        out.validate(where)
        return out

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read a run.toml. ``[run] run_id`` and ``[run] steps`` must be given: a run is named and sized on
        purpose, every other key has a default."""
        p = Path(path)
        raw = _read_toml(p)
        for section, key in REQUIRED:
            if key not in raw.get(section, {}):
                raise ConfigError(f"{p}: [{section}] {key} is missing (required)")
        return cls.from_dict(raw, str(p))

    def spec(self, corpus_fingerprint: str = "") -> RunSpec:
        """The runtime's view of this configuration (imports the model code here: declaring and writing a run.toml
        must not load torch)."""
        from tasklet.peer.compute.family import model_from_config
        from tasklet.peer.compute.stage import OptimConfig
        from tasklet.peer.runtime.spec import RunSpec

        r, o = self.run, self.optim
        # which family's model the [model] section names; a tied model stays tied when the run averages exactly
        model = model_from_config(self.model, r.seed, tie=r.sync_period == 1)
        return RunSpec(
            run_id=r.run_id,
            model=model,
            optim=OptimConfig(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay),
            seed=r.seed,
            micro_batch=r.micro_batch,
            n_microbatches=r.n_microbatches,
            corpus=None if r.corpus == "stdlib" else r.corpus,
            corpus_fingerprint=corpus_fingerprint,
            tokenizer=r.tokenizer or None,
            text_field=r.text_field,
            precision=r.precision,
            compression=r.compression,
            grad_outlier_factor=float(r.grad_outlier_factor),
            grad_direction_z=float(r.grad_direction_z),
            sync_period=r.sync_period,
            outer_lr=float(r.outer_lr),
            outer_momentum=float(r.outer_momentum),
            pseudo_grad_compression=r.pseudo_grad_compression,
            outer_overlap=bool(r.outer_overlap),
            spot_check=float(self.trust.spot_check),
            probation_check=float(self.trust.probation_check),
            probation_microbatches=int(self.trust.probation_microbatches),
        )

    def validate(self, where: str = "config") -> None:
        from tasklet.peer.compute.hf import ModelSourceError
        from tasklet.peer.runtime.spec import SpecError

        try:
            spec = self.spec().validate()
        except ModelSourceError as exc:  # names its own file and field
            raise ConfigError(f"{where}: [model] config: {exc}") from None
        except (SpecError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if self.run.steps < 1:
            raise ConfigError(f"{where}: [run] steps must be >= 1")
        s = self.swarm
        if s.min_peers < 1:
            raise ConfigError(f"{where}: [swarm] min_peers must be >= 1")
        if s.stages < 0 or s.stages > spec.model.n_layers:
            raise ConfigError(f"{where}: [swarm] stages must be 0 (auto) or 1..n_layers")
        if not 0 < s.heartbeat_s <= MAX_HEARTBEAT_S:
            raise ConfigError(f"{where}: [swarm] heartbeat_s must be in (0, {MAX_HEARTBEAT_S:g}] (the DHT refuses "
                              "records that live longer than their kind's bound)")
        if not (s.quorum_wait_s >= 0 and math.isfinite(s.quorum_wait_s)):
            raise ConfigError(f"{where}: [swarm] quorum_wait_s must be a number >= 0")
        if s.checkpoint_keep < 1 or s.checkpoint_copies < 0:
            raise ConfigError(f"{where}: [swarm] checkpoint_keep must be >= 1 and checkpoint_copies >= 0")
        e = self.emulation
        for key in ("bandwidth_scale", "tflops", "tflops_scale"):
            v = getattr(e, key)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{where}: [emulation] {key} must be a positive number")


# The keys that name files or folders on a peer's own machine. They are each peer's own configuration: a
# joiner takes them from its command line or its own run.toml, never from the run record (a record naming
# ``~/.ssh`` would otherwise have every joiner read, or a new leader write, there). The run fixes the
# fingerprints of the data and model instead.
LOCAL_PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("run", "corpus"), ("run", "tokenizer"), ("model", "config"), ("swarm", "checkpoint_dir"),
    ("swarm", "save_dir"), ("log", "tensorboard_dir"), ("emulation", "scenario"),
)
_SCENARIO_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")


def is_shared_name(section: str, key: str, value: Any) -> bool:
    """Whether a value of a local-path key names no file, so every peer may take it from the record: the
    standard-library corpus, a model preset, a bundled scenario's name, or empty."""
    if value == "":
        return True
    if not isinstance(value, str):
        return False
    if (section, key) == ("run", "corpus"):
        return value == "stdlib"
    if (section, key) == ("model", "config"):
        from tasklet.peer.compute.hf.presets import PRESETS

        return value in PRESETS
    if (section, key) == ("emulation", "scenario"):
        return _SCENARIO_NAME.fullmatch(value) is not None
    return False


def strip_local_paths(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A run record's configuration without the local paths it names (``[section] key``s of those dropped);
    a value that names no file (:func:`is_shared_name`) is kept."""
    out: dict[str, Any] = {name: dict(values) if isinstance(values, dict) else values
                           for name, values in data.items()}
    dropped = []
    for section, key in LOCAL_PATH_KEYS:
        values = out.get(section)
        if isinstance(values, dict) and key in values and not is_shared_name(section, key, values[key]):
            dropped.append(f"[{section}] {key}")
            del values[key]
    return out, dropped


def local_paths_from_toml(path: str | Path) -> dict[tuple[str, str], str]:
    """The local paths a joiner's own run.toml gives (every other key of it is the run's, read from the
    record, and is ignored here)."""
    p = Path(path)
    raw = _read_toml(p)
    out: dict[tuple[str, str], str] = {}
    for section, key in LOCAL_PATH_KEYS:
        values = raw.get(section, {})
        if isinstance(values, dict) and key in values:
            if not isinstance(values[key], str):
                raise ConfigError(f"{p}: [{section}] {key} must be str, got {values[key]!r}")
            out[(section, key)] = values[key]
    return out


def with_local_paths(data: Mapping[str, Any], paths: Mapping[tuple[str, str], str]) -> dict[str, Any]:
    """``data`` (a configuration as a dict of sections) with this peer's own ``paths`` set."""
    out: dict[str, Any] = {name: dict(values) if isinstance(values, dict) else values
                           for name, values in data.items()}
    for (section, key), value in paths.items():
        section_values = out.setdefault(section, {})
        if isinstance(section_values, dict):
            section_values[key] = value
    return out


def _section(cls: type, values: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    kwargs = {}
    for name, value in values.items():
        default = known[name].default
        expected = type(default) if default is not None and default is not MISSING else None
        if name == "leaders":
            _check_leaders(value, where)
        elif name == "devices":
            if value is not None and not (isinstance(value, list) and all(isinstance(v, int) for v in value)):
                raise ConfigError(f"{where}: {name} must be a list of integers")
        elif expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif expected is not None and (
            not isinstance(value, expected) or isinstance(value, bool) != (expected is bool)
        ):
            raise ConfigError(f"{where}: {name} must be {expected.__name__}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _check_leaders(value: Any, where: str) -> None:
    """``[swarm] leaders``: None, "any", or a list of peer ids (peer.swarm.charter)."""
    if value is None or value == "any":
        return
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(value) > 64:
        raise ConfigError(f'{where}: leaders must be "any" or a list of at most 64 peer ids, got {value!r}')
    bad = [v for v in value if not all(c.isalnum() or c in "._-" for c in v) or len(v) > 64]
    if bad:
        raise ConfigError(f"{where}: leaders: {bad[0]!r} is not a peer id (`peer identity show` prints one)")


def reference_markdown() -> str:
    """The configuration reference: every section and key with its default and meaning."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            default = f.default
            shown = "(none)" if default is None else (f'"{default}"' if isinstance(default, str) else repr(default))
            required = " (required)" if (name, f.name) in REQUIRED else ""
            lines.append(f"| `[{name}] {f.name}` | `{shown}`{required} | {f.metadata['help']} |")
    return "\n".join(lines)


def example_toml() -> str:
    """A complete run.toml with every default spelled out (what `peer init` writes)."""
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"[{name}]")
        for f in fields(cls):
            if f.default is None:
                out.append(f"# {f.name} = []  # {f.metadata['help']}")
                continue
            value = (
                f'"{f.default}"'
                if isinstance(f.default, str)
                else repr(f.default).lower()
                if isinstance(f.default, bool)
                else repr(f.default)
            )
            out.append(f"{f.name} = {value}  # {f.metadata['help']}")
        out.append("")
    return "\n".join(out)


def _read_toml(p: Path) -> dict[str, Any]:
    """A TOML file's table, or a :class:`ConfigError` naming the file and what is wrong with it."""
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from None
