"""Device choice (``[train] device``, ``--device``) and the ranks' device check: the plan for every
machine kind, refusals before launch, and real ranks that record their device, refuse a device
that computes wrong (the ``wrong_result`` fault) and hand an executable its device."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.controller.devices import Accelerators, BackendRefused, DeviceRefused, plan_backend, plan_device
from harness.rank import device_check as dc
from harness.scenario import ScenarioError, parse_scenario, with_device
from tests.conftest import SMALL, WORKER_DIR, cli

H100 = Accelerators("cuda", 2, "NVIDIA H100 80GB HBM3")
M3 = Accelerators("metal", 1, "Apple M3 Max")
HOSTED = Accelerators("metal", 1, "Apple Paravirtual device")
NONE = Accelerators("cpu", 0, "AMD EPYC")


def test_plan_device_on_every_kind_of_machine() -> None:
    assert plan_device("cpu", H100) == ("cpu", None)
    assert plan_device("gpu", H100) == ("gpu", None)
    assert plan_device("auto", H100) == ("gpu", "auto: 2 x NVIDIA H100 80GB HBM3 (cuda)")
    assert plan_device("auto", M3) == ("gpu", "auto: 1 x Apple M3 Max (metal)")
    assert plan_device("auto", NONE) == ("cpu", "auto: no GPU here")
    device, why = plan_device("auto", HOSTED)
    assert device == "cpu" and "paravirtual" in why and "Apple Paravirtual device" in why
    assert plan_device("gpu", HOSTED) == ("gpu", None)  # allowed: the ranks' device check guards it
    with pytest.raises(DeviceRefused, match="MLX sees no GPU here"):
        plan_device("gpu", NONE)


def test_a_paravirtual_metal_device_is_named_so() -> None:
    assert HOSTED.paravirtual and not M3.paravirtual and not H100.paravirtual and not NONE.paravirtual
    assert Accelerators("metal", 1, "apple PARAVIRTUAL device").paravirtual
    assert HOSTED.kind_line() == "Metal (paravirtual: a hosted VM; auto uses the CPU)"
    assert (H100.kind_line(), M3.kind_line(), NONE.kind_line()) == ("CUDA", "Metal", "none: the CPU")


def test_ranks_on_the_cpu_of_a_cuda_machine_use_ring() -> None:
    backend, why = plan_backend(2, None, H100, device="cpu")
    assert backend == "ring" and "nccl" in why
    assert plan_backend(2, "ring", H100, device="cpu") == ("ring", None)
    with pytest.raises(BackendRefused, match="GPU arrays only"):
        plan_backend(2, "nccl", H100, device="cpu")
    assert plan_backend(2, None, H100, device="gpu") == ("nccl", None)
    assert plan_backend(2, None, NONE, device="cpu") == ("ring", None)


def test_compare_finds_each_kind_of_wrong_answer() -> None:
    want = dc.expected(2)
    right = dc.Answers(want.matmul.copy(), want.reduction.copy(), want.all_sum.copy())
    assert dc.compare(right, want) == []
    zeros = dc.Answers(np.zeros_like(want.matmul), want.reduction, want.all_sum)
    (line,) = dc.compare(zeros, want)
    nonzero = int((want.matmul != 0).sum())
    assert line.startswith(f"matmul: {nonzero} of 4096 elements differ (expected ")
    one = dc.Answers(want.matmul.copy(), want.reduction, want.all_sum)
    one.matmul[3, 5] += 1
    assert dc.compare(one, want) == [f"matmul: 1 of 4096 elements differ (expected {want.matmul[3, 5]:.6g}, "
                                     f"got {one.matmul[3, 5]:.6g} at [3, 5])"]
    collective = dc.Answers(want.matmul, want.reduction, want.all_sum * 0.5)  # a rank's part lost
    assert [m.split(":")[0] for m in dc.compare(collective, want)] == ["all_sum"]
    rounded = dc.Answers(want.matmul, want.reduction * (1 + 2e-7), want.all_sum)  # float32 rounding passes
    assert dc.compare(rounded, want) == []
    nan = dc.Answers(want.matmul, want.reduction.copy(), want.all_sum)
    nan.reduction[0] = np.nan
    assert dc.compare(nan, want)[0].startswith("reduction: 1 of 64 elements differ")


def test_the_check_passes_on_mlx_and_leaves_the_global_rngs_alone() -> None:
    import mlx.core as mx

    np.random.seed(3)
    mx.random.seed(3)
    before = (np.random.get_state()[1].copy(), np.array(mx.random.state[0]))
    assert dc.compare(dc.compute(0, None, False), dc.expected(None)) == []
    assert dc.compare(dc.compute(0, None, False, wrong=True), dc.expected(None))[0].startswith("matmul: ")
    assert (np.random.get_state()[1] == before[0]).all() and (np.array(mx.random.state[0]) == before[1]).all()


def test_every_rank_names_the_first_rank_that_computes_wrong() -> None:
    failed = {1: "matmul: 4096 of 4096 elements differ (expected 37, got 0 at [0, 0])"}
    assert dc.failure_line("gpu (Apple Paravirtual device)", failed, 1) == (
        "device gpu (Apple Paravirtual device) computes wrong on rank 1: matmul: 4096 of 4096 elements differ "
        "(expected 37, got 0 at [0, 0])")
    assert dc.failure_line("cpu", failed, 0).startswith("a peer rank failed: device cpu computes wrong on rank 1: ")
    assert dc.failure_line("cpu", {0: "x", 2: "y"}, 0) == "device cpu computes wrong on rank 0: x (and on rank 2)"


def _scenario(tmp_path: Path, extra: str = "", train: str = "") -> str:
    body = textwrap.dedent(SMALL).format(name="dev", steps=2, checks="", reference='reference = "single"')
    body = body.replace("digest_every = 2\n", f"digest_every = 2\n{train}")
    return body + '\n[[runs]]\nname = "single"\nworld_size = 1\n\n[[runs]]\nname = "ddp2"\nworld_size = 2\n' + extra


def _parse(tmp_path: Path, text: str):  # noqa: ANN202 - a Scenario
    import tomllib

    return parse_scenario(tomllib.loads(text), "dev.toml", tmp_path)


def test_the_device_key_and_the_fault_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"\[train\]\.device: must be one of"):
        _parse(tmp_path, _scenario(tmp_path, train='device = "tpu"\n'))
    s = _parse(tmp_path, _scenario(tmp_path, train='device = "cpu"\n').replace(
        'name = "ddp2"\nworld_size = 2\n', 'name = "ddp2"\nworld_size = 2\ntrain = { device = "auto" }\n'))
    assert [s.for_run(r).train.device for r in s.runs] == ["cpu", "auto"]
    forced = with_device(s, "gpu")
    assert [forced.for_run(r).train.device for r in forced.runs] == ["gpu", "gpu"] and with_device(s, None) is s
    fault = '\n[[faults]]\nrank = 1\nstep = 1\nphase = "{phase}"\naction = "{action}"\n'
    with pytest.raises(ScenarioError, match="wrong_result is the device_check phase's one action"):
        _parse(tmp_path, _scenario(tmp_path, fault.format(phase="step", action="wrong_result")))
    with pytest.raises(ScenarioError, match="wrong_result is the device_check phase's one action"):
        _parse(tmp_path, _scenario(tmp_path, fault.format(phase="device_check", action="raise")))
    _parse(tmp_path, _scenario(tmp_path, fault.format(phase="device_check", action="wrong_result")))


def test_device_gpu_where_mlx_sees_none_is_refused_in_one_line(tmp_path: Path) -> None:
    if dc.current() == "gpu":
        pytest.skip("this machine has a GPU")
    (tmp_path / "dev.toml").write_text(_scenario(tmp_path))
    p = cli("run", str(tmp_path / "dev.toml"), "--device", "gpu", "--out", str(tmp_path / "o"))
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: ") and "run single" in line and "MLX sees no GPU here" in line
    assert not (tmp_path / "o").exists() and p.stdout == ""


@pytest.mark.ranks
def test_each_rank_records_its_device_and_a_passed_check(tmp_path: Path) -> None:
    """[train] auto for the reference, a per-run override to the CPU for the 2-rank run."""
    text = _scenario(tmp_path).replace('name = "ddp2"\nworld_size = 2\n',
                                       'name = "ddp2"\nworld_size = 2\ntrain = { device = "cpu" }\n')
    (tmp_path / "dev.toml").write_text(text)
    p = cli("run", str(tmp_path / "dev.toml"), "--out", str(tmp_path / "o"), "--progress", "off")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    runs = {r["name"]: r for r in json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]["runs"]}
    assert runs["ddp2"]["device"] == "cpu" and runs["ddp2"]["device_reason"] is None
    if dc.current() == "cpu":
        assert runs["single"]["device"] == "cpu" and runs["single"]["device_reason"] == "auto: no GPU here"
        assert "on cpu: auto: no GPU here" in p.stdout and "on cpu: as asked" in p.stdout
    for run in runs.values():
        for rk in run["ranks"]:
            assert rk["device_check"] == {"device": run["device"], "status": "passed", "detail": None,
                                          "checks": ["matmul", "reduction"] + (["all_sum"] if run["world_size"] > 1
                                                                               else [])}
    for r in (0, 1):
        result = json.loads((tmp_path / "o" / "runs" / "dev" / "ddp2" / f"rank{r}.result.json").read_text())
        assert result["device_asked"] == "cpu" and result["accelerator"] == "cpu" and "cpu" in result["device"]


@pytest.mark.ranks
def test_device_cpu_on_the_command_line_runs_on_the_cpu(tmp_path: Path) -> None:
    text = _scenario(tmp_path).replace('\n[[runs]]\nname = "ddp2"\nworld_size = 2\n', "")
    (tmp_path / "dev.toml").write_text(text.replace('reference = "single"', ""))
    p = cli("run", str(tmp_path / "dev.toml"), "--device", "cpu", "--out", str(tmp_path / "o"), "--progress", "off")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (run,) = json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]["runs"]
    assert run["device"] == "cpu" and run["device_reason"] is None and "fine-tune: full; device: cpu\n" in p.stdout
    rank = json.loads((tmp_path / "o" / "runs" / "dev" / "single" / "rank0.result.json").read_text())
    assert rank["device_asked"] == "cpu" and rank["device_check"]["status"] == "passed"


@pytest.mark.ranks
def test_a_device_that_computes_wrong_fails_every_rank_in_one_line(tmp_path: Path) -> None:
    fault = '\n[[faults]]\nrank = 1\nstep = 1\nphase = "device_check"\naction = "wrong_result"\nruns = ["ddp2"]\n'
    text = _scenario(tmp_path, fault).replace('name = "single"\nworld_size = 1\n\n[[runs]]\n', "")
    (tmp_path / "dev.toml").write_text(text.replace('reference = "single"', ""))
    p = cli("run", str(tmp_path / "dev.toml"), "--device", "cpu", "--out", str(tmp_path / "o"), "--progress", "off")
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    (run,) = json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]["runs"]
    first = run["failure"].splitlines()[0]
    assert first.startswith("rank 1 failed: device cpu computes wrong on rank 1: matmul: ") and \
        "elements differ (expected " in first and ", got 0 at [" in first, run["failure"]
    assert "rank 0: a peer rank failed: device cpu computes wrong on rank 1: matmul: " in run["failure"]
    assert first in p.stdout + p.stderr
    checks = [rk["device_check"] for rk in run["ranks"]]
    assert [c["status"] for c in checks] == ["failed", "failed"] and checks[1]["detail"].startswith("matmul: ")


@pytest.mark.ranks
def test_the_cpp_worker_is_given_the_cpu_and_runs_there(worker: Path, tmp_path: Path) -> None:
    body = (WORKER_DIR / "cpp_worker.toml").read_text().replace('path = "build/worker"', f'path = "{worker}"')
    body = body.replace('[[runs]]\nname = "ddp4"\nworld_size = 4\n', "")
    body = body.replace('optimizer = "sgd"', 'optimizer = "sgd"\ndevice = "cpu"')
    (tmp_path / "cpu.toml").write_text(body)
    p = cli("run", str(tmp_path / "cpu.toml"), "--out", str(tmp_path / "o"), "--progress", "off")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    protocols = sorted((tmp_path / "o" / "runs").glob("*/*/rank*.protocol"))
    assert protocols, "no rank kept its protocol directory"
    for d in protocols:
        assert json.loads((d / "job.json").read_text())["device"] == "cpu"
    runs = json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]["runs"]
    for rk in (rk for r in runs for rk in r["ranks"]):
        assert rk["device_check"]["status"] == "skipped" and "command trainer" in rk["device_check"]["detail"]


def test_the_pytest_plugin_takes_the_device_of_every_run(tmp_path: Path) -> None:
    if dc.current() == "gpu":
        pytest.skip("this machine has a GPU")
    from tests.test_pytest_plugin import _pytest

    (tmp_path / "dev.toml").write_text(_scenario(tmp_path))
    p = _pytest(tmp_path, "--mlx-ddp", "--mlx-ddp-device", "gpu", "dev.toml", "-q", "-x", "-p", "no:randomly")
    assert p.returncode == 1 and "MLX sees no GPU here" in p.stdout, p.stdout[-3000:]


def test_a_gpu_that_computes_wrong_is_left_for_the_cpu_under_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision of one rank whose GPU computes wrong (the GPU stood in for by this machine's
    device: MLX computes here as it would there)."""
    import mlx.core as mx

    monkeypatch.setattr(dc, "current", lambda: "gpu")
    monkeypatch.setattr(dc, "device_label", lambda device: "gpu (Apple Paravirtual device)")
    default = mx.default_device()
    try:
        record, why = dc.check("auto", 0, 1, None, "none", wrong=True)
        assert record["status"] == "fell_back" and record["device"] == "cpu" and mx.default_device() == mx.cpu
        assert why.startswith("auto: the GPU (Apple Paravirtual device) computed wrong (matmul: ") and \
            why.endswith("): the CPU")
        refused = r'gpu \(Apple Paravirtual device\) computes wrong on rank 0: matmul: .*; run with device = "cpu"$'
        with pytest.raises(dc.DeviceCheckFailed, match=refused):
            dc.check("gpu", 0, 1, None, "none", wrong=True)
        with pytest.raises(dc.DeviceCheckFailed, match="the nccl backend serves GPU arrays only"):
            dc.check("auto", 0, 1, None, "nccl", wrong=True)
        assert dc.check("gpu", 0, 1, None, "none")[0]["status"] == "passed"
    finally:
        mx.set_default_device(default)
