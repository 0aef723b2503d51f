"""`peer doctor`: the device it finds (a real CPU; CUDA, ROCm and MPS devices faked in-process, with the runtime
each names and the features each refuses), and a verdict that names the stage that does not fit, its need and
the device's memory, or the precision the device cannot run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tasklet.peer.compute import device_probe
from tasklet.peer.config import RunConfig
from tasklet.peer.node import doctor
from tasklet.peer.node.doctor import DoctorOptions, run_doctor, verdict
from tasklet.peer.node.planning import workload_for
from tests.support.fake_devices import fake_mps, fake_rocm

KEYS = ["device", "memory", "disk", "ports", "reachability", "clock", "links", "verdict"]
GiB = 1 << 30


def test_cpu_report_has_every_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no run.toml here: the defaults are judged
    report = run_doctor(DoctorOptions(measure_seconds=0.05, device="cpu"))
    assert list(report) == KEYS
    assert report["device"]["kind"] == "cpu" and report["device"]["tflops"] > 0
    assert report["device"]["runtime"] == f"torch {torch.__version__}"
    assert report["memory"]["usable_bytes"] == report["device"]["memory_bytes"] > 0
    assert report["disk"]["free_gb"] > 0 and report["disk"]["ok"]
    assert report["ports"]["grpc"]["ok"] and report["ports"]["grpc"]["port"] > 0
    assert report["reachability"]["checked"] is False and "--dht" in report["reachability"]["why"]
    v = report["verdict"]
    assert v["ok"] and v["fits"] == [0] and v["config"].startswith("the defaults")


def test_a_port_in_use_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.chdir(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        report = run_doctor(DoctorOptions(port=port, measure_seconds=0.05, device="cpu"))
    assert report["ports"]["grpc"]["ok"] is False and report["ports"]["grpc"]["error"]
    assert report["ports"]["dht"]["ok"] is True


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, memory: int, driver: int, built: str) -> None:
    """A CUDA device as torch would describe it, without one: the probe's timing is replaced, nothing else."""
    props = SimpleNamespace(name="NVIDIA GeForce RTX 3070", total_memory=memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: driver, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    timing = device_probe.MatmulTiming(size=4096, repeats=10, seconds=0.01)
    monkeypatch.setattr(device_probe, "_measure_cuda", lambda dev, seconds: (props.name, memory, timing))


def test_fake_cuda_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_cuda(monkeypatch, 8 * GiB, driver=12020, built="12.1")
    report = run_doctor(DoctorOptions(max_vram_gb=6.0))
    d = report["device"]
    assert d["kind"] == "cuda" and d["name"] == "NVIDIA GeForce RTX 3070" and d["memory_bytes"] == 8 * GiB
    assert d["tflops"] == pytest.approx(2 * 4096**3 * 10 / 0.01 / 1e12, rel=1e-3)
    assert d["cuda"] == {"torch_cuda": "12.1", "driver_cuda": "12.2", "match": True}
    assert d["runtime"] == "CUDA 12.1" and d["precisions"]["bf16"] == "ok"
    assert report["memory"]["usable_bytes"] == 6 * 10**9  # --max-vram caps what the verdict may use
    assert report["verdict"]["device_gb"] == 6.0


def test_an_old_driver_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 8 * GiB, driver=11080, built="12.1")
    assert doctor.cuda_versions() == {"torch_cuda": "12.1", "driver_cuda": "11.8", "match": False}


def _big_spec(tmp_path: Path, micro_batch: int = 4, precision: str = "fp32"):  # noqa: ANN202
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nrun_id = "x"\nsteps = 1\nmicro_batch = {micro_batch}\nprecision = "{precision}"\n'
                   '[model]\nconfig = "tiny-llama"\nseq_len = 256\n')
    return RunConfig.load(cfg).spec()


def test_machine_too_small_for_any_stage_names_stage_need_and_device(tmp_path: Path) -> None:
    spec = _big_spec(tmp_path)
    w = workload_for(spec)
    n = w.n_layers  # nothing fits, so every split down to a layer per stage is tried; stage s: n - s in flight
    smallest = min(w.stage_memory_bytes(a, a + 1, in_flight=n - a) for a in range(n))
    device = int(smallest * 0.5)
    v = verdict(spec, device, None, "tiny-llama")
    assert not v["ok"] and v["fits"] == []
    assert len(v["stages"]) == w.n_layers  # every split down to a layer per stage was tried
    worst = min(v["stages"], key=lambda r: r["need_gb"])
    assert worst["need_gb"] == pytest.approx(smallest / 1e9, abs=1e-3)
    assert f"stage {worst['stage']} " in v["why_not"]
    assert f"needs {worst['need_gb']:.3g} GB" in v["why_not"]
    assert f"has {device / 1e9:.3g} GB" in v["why_not"]
    tips = " | ".join(v["would_help"])
    assert "micro_batch 1" in tips and "bf16" in tips and "a device with at least" in tips
    # the tips' figures are the scheduler's estimate with that one change
    from dataclasses import replace
    mb1 = workload_for(replace(spec, micro_batch=1)).stage_memory_bytes(*worst["layers"],
                                                                        in_flight=n - worst["stage"])
    assert f"micro_batch 1: this stage would need {mb1 / 1e9:.3g} GB" in tips


def test_verdict_on_the_runs_split(tmp_path: Path) -> None:
    spec = _big_spec(tmp_path, micro_batch=1)
    w = workload_for(spec)
    split = [(0, 1), (1, w.n_layers)]
    needs = [w.stage_memory_bytes(a, b, in_flight=2 - s) for s, (a, b) in enumerate(split)]
    v = verdict(spec, int(sum(needs) / 2), split, "tiny-llama")  # between the two stages' needs
    assert v["split"] == "the run's plan"
    assert [r["fits"] for r in v["stages"]] == [n <= sum(needs) / 2 for n in needs]
    assert v["ok"] == any(r["fits"] for r in v["stages"])


def test_asking_for_cuda_on_a_machine_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA"):
        doctor.check_device(DoctorOptions(device="cuda"))


def test_rocm_device_is_named_with_its_hip_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_rocm(monkeypatch, memory=24 * GiB)
    report = run_doctor(DoctorOptions(device="rocm"))
    d = report["device"]
    assert (d["kind"], d["name"], d["memory_bytes"]) == ("rocm", "AMD Radeon RX 7900 XTX", 24 * GiB)
    assert d["runtime"] == "HIP 6.2.41133" and d["rocm"] == {"hip": "6.2.41133"} and "cuda" not in d
    assert d["precisions"] == {"fp32": "ok", "bf16": "ok", "fp16": "ok"} and d["notes"] == []
    text = doctor.format_report(report)
    assert "device        rocm: AMD Radeon RX 7900 XTX, 25.8 GB" in text
    assert "runtime       HIP 6.2.41133" in text and "refused" not in text


def test_mps_on_an_old_torch_refuses_bf16_and_says_which_memory_it_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('[run]\nrun_id = "x"\nsteps = 1\nprecision = "bf16"\n')
    fake_mps(monkeypatch, recommended=None, macos14=None)
    report = run_doctor(DoctorOptions(device="auto", measure_seconds=0.05))
    d, v = report["device"], report["verdict"]
    assert d["kind"] == "mps" and d["name"] == "Apple M2 Pro" and d["runtime"].startswith("macOS ")
    assert d["memory_bytes"] == device_probe.cpu_memory_bytes() and report["memory"]["shared_with_host"]
    assert d["precisions"]["fp16"] == "ok" and "too old for bf16 on MPS" in d["precisions"]["bf16"]
    # the memory would hold the tiny default model, but the run's precision cannot be computed here
    assert not v["ok"] and v["fits"] == [] and v["summary"].startswith("this device cannot run precision bf16")
    text = doctor.format_report(report)
    assert "refused       precision bf16: torch" in text
    assert "note          memory: torch" in text and "recommended_max_memory" in text


def test_mps_with_metals_budget_and_bf16_has_nothing_to_refuse(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_mps(monkeypatch, recommended=12 * GiB, macos14=True)
    report = run_doctor(DoctorOptions(device="mps", measure_seconds=0.05))
    assert report["device"]["memory_bytes"] == 12 * GiB and report["device"]["notes"] == []
    assert report["verdict"]["ok"]


def test_cuda_asked_of_a_rocm_build_names_the_right_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch)
    with pytest.raises(ValueError, match="use --device rocm"):
        doctor.check_device(DoctorOptions(device="cuda"))
