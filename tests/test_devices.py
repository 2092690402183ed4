"""Which backend runs how many ranks on which GPUs (pure logic), the doctor's GPU rows, what a rank
loads before its memory baseline, and the gradient norm a GPU compiles."""

from __future__ import annotations

import math

import pytest

from harness.controller.devices import Accelerators, BackendRefused, plan_backend

CUDA2 = Accelerators("cuda", 2, "NVIDIA H200", 140 * 2**30)
CPU = Accelerators("cpu", 0, "AMD EPYC")
METAL = Accelerators("metal", 1, "Apple M2")


def test_nccl_gets_one_gpu_per_rank_and_more_ranks_go_to_ring_with_a_reason() -> None:
    assert plan_backend(2, None, CUDA2) == ("nccl", None)
    backend, reason = plan_backend(4, None, CUDA2)
    assert backend == "ring" and "4 ranks on 2 GPUs" in reason and "GPU r mod 2" in reason
    assert plan_backend(4, "ring", CUDA2) == ("ring", None)  # asked for: no reason needed
    assert plan_backend(1, "nccl", CUDA2) == (None, None)  # one process joins no group


def test_nccl_with_more_ranks_than_gpus_is_refused_naming_both_counts() -> None:
    with pytest.raises(BackendRefused, match="world size 4 needs 4 GPUs with the nccl backend .* has 2"):
        plan_backend(4, "nccl", CUDA2)


def test_without_cuda_the_default_is_ring_and_a_named_backend_is_kept() -> None:
    assert plan_backend(4, None, CPU) == ("ring", None)
    assert plan_backend(2, None, METAL) == ("ring", None)
    assert plan_backend(2, "jaccl", METAL) == ("jaccl", None)


def test_doctor_words_for_gpus_and_backends() -> None:
    assert CUDA2.describe() == "2 x NVIDIA H200 (cuda, 140 GiB each)"
    assert CPU.describe() == "none: MLX computes on the CPU (AMD EPYC)"
    words = CUDA2.ranks_per_backend(["ring", "nccl"])
    assert words == "ring: any number (ranks share the 2 GPUs over loopback); nccl: up to 2 ranks (one per GPU)"
    assert CPU.ranks_per_backend(["ring"]) == "ring: any number"


def test_a_trainer_that_all_reduces_on_the_cpu_stream_runs_on_ring_on_cuda_and_nccl_is_refused() -> None:
    from harness.scenario.trainers import cpu_collectives

    why = cpu_collectives("mlx_vlm")
    assert why and "CPU stream" in why
    assert all("CPU stream" in (cpu_collectives(k) or "") for k in ("mlx_lm", "unsloth_zoo"))
    assert cpu_collectives("reference") is None and cpu_collectives("script") is None
    backend, reason = plan_backend(2, None, CUDA2, cpu_collectives=why)
    assert backend == "ring" and reason.startswith(why) and "nccl cannot serve" in reason
    with pytest.raises(BackendRefused, match="CPU stream, which the nccl backend cannot serve"):
        plan_backend(2, "nccl", CUDA2, cpu_collectives=why)
    assert plan_backend(2, None, CPU, cpu_collectives=why) == ("ring", None)  # ring anyway: nothing to say
    assert plan_backend(2, "ring", CUDA2, cpu_collectives=why) == ("ring", None)


def test_a_rank_loads_its_trainers_libraries_before_its_memory_baseline() -> None:
    """mlx-lm's trainer (and transformers through it) is imported before the job runs, in a fresh
    process; a probe job imports nothing."""
    import subprocess
    import sys

    code = ("import sys; from harness.rank.entry import load_libraries; "
            "from harness.scenario import Scenario, TrainerSpec; "
            "from harness.scenario.job import AllSumJob, TrainerRef, TrainJob; "
            "load_libraries(AllSumJob()); before = 'mlx_lm.tuner.trainer' in sys.modules; "
            "load_libraries(TrainJob('r', TrainerRef('harness.trainers.mlx_lm.rank'), "
            "Scenario('s', trainer=TrainerSpec(kind='mlx_lm')))); "
            "print(before, 'mlx_lm.tuner.trainer' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"]


def test_unsloth_zoos_mid_run_import_of_transformers_callbacks_is_in_the_memory_baseline() -> None:
    """unsloth-zoo's loop imports ``transformers.trainer_callback`` at its first step (with torch
    installed, torch comes with it): its ``load_libraries`` imports it before the baseline."""
    import subprocess
    import sys

    from harness.trainers.unsloth_zoo.rank import available

    if available() is not None:
        pytest.skip(available())
    code = ("import sys; from harness.rank.entry import load_libraries; "
            "from harness.scenario import Scenario, TrainerSpec; "
            "from harness.scenario.job import TrainerRef, TrainJob; "
            "load_libraries(TrainJob('r', TrainerRef('harness.trainers.unsloth_zoo.rank'), "
            "Scenario('s', trainer=TrainerSpec(kind='unsloth_zoo')))); "
            "print('unsloth_zoo.mlx.trainer' in sys.modules, 'transformers.trainer_callback' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


def test_the_gradient_norm_is_the_float32_norm_of_every_array_compiled_or_not() -> None:
    """The diagnostic norm (``grad_norm``, compiled on a GPU) is the L2 norm over every gradient
    array in float32, also for bfloat16 gradients; compiled, it matches the eager one."""
    import mlx.core as mx
    import numpy as np

    from harness.trainers.reference.step import grad_norm

    rng = np.random.default_rng(3)
    leaves = [mx.array(rng.standard_normal(s).astype(np.float32)).astype(dt)
              for s, dt in (((4, 5), mx.bfloat16), ((7,), mx.float32), ((3, 2, 2), mx.bfloat16))]
    expect = math.sqrt(sum(float((np.array(g.astype(mx.float32)).astype(np.float64) ** 2).sum()) for g in leaves))
    eager, compiled = grad_norm(leaves).item(), mx.compile(grad_norm)(leaves).item()
    assert eager == pytest.approx(expect, rel=1e-6) and compiled == pytest.approx(eager, rel=1e-6)
    assert grad_norm(leaves[:1]).item() < eager  # every array counts
