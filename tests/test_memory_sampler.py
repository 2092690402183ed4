"""A rank's memory sampler, with real MLX allocations in this process: which RSS baseline each
device gets, and few ``memory`` events, each for a figure that rose."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import mlx.core as mx
import pytest

from harness import ablation, schema
from harness.memory.sampler import (
    FIRST_STEP,
    JOB_START,
    MemorySampler,
    device_baseline_kind,
    peak_rss_bytes,
    rose,
    rss_baseline_kind,
)

MB = 1024 * 1024


def test_the_rss_baseline_is_job_start_where_mlx_memory_is_host_memory_and_the_first_step_on_cuda() -> None:
    assert rss_baseline_kind(gpu=False, cuda=False) == JOB_START  # a CPU
    assert rss_baseline_kind(gpu=True, cuda=False) == JOB_START  # Metal: unified memory
    assert rss_baseline_kind(gpu=False, cuda=True) == JOB_START  # a CUDA build running on its CPU
    assert rss_baseline_kind(gpu=True, cuda=True) == FIRST_STEP
    expected = FIRST_STEP if mx.default_device() == mx.gpu and mx.cuda.is_available() else JOB_START
    assert device_baseline_kind() == expected


def test_a_rise_is_8_mb_and_5_percent() -> None:
    assert not rose(8 * MB, 0) and rose(8 * MB + 1, 0)
    assert not rose(1050 * MB, 1000 * MB) and rose(1051 * MB, 1000 * MB)


def test_a_first_step_baseline_is_taken_when_the_first_step_ends(tmp_path: Path) -> None:
    events = schema.EventWriter(tmp_path / "events.jsonl")
    sampler = MemorySampler(events, 0, peak_rss_bytes(), FIRST_STEP)
    assert sampler.start_fields() == {"rss_baseline": FIRST_STEP, "rss_baseline_bytes": None}
    assert sampler.figures()["rss_peak_after_baseline_bytes"] is None  # no step ended: no baseline
    first = sampler.step_ended(3)  # a resumed run's first step
    assert first["rss_baseline"] == "end of step 3" and first["rss_baseline_bytes"] == first["rss_bytes"] > 0
    second = sampler.step_ended(4)
    assert "rss_baseline" not in second and second["mlx_peak_bytes"] >= 0
    figures = sampler.figures()
    assert figures["rss_baseline"] == "end of step 3" and figures["rss_baseline_bytes"] == first["rss_bytes"]
    assert figures["rss_peak_after_baseline_bytes"] >= max(first["rss_bytes"], second["rss_bytes"])
    events.close()


def test_the_sampler_writes_few_memory_events_each_for_a_figure_that_rose(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = schema.EventWriter(path)
    runtime = peak_rss_bytes()
    mx.reset_peak_memory()
    sampler = MemorySampler(events, 5, runtime, JOB_START, every_s=0.005)
    assert sampler.start_fields() == {"rss_baseline": JOB_START, "rss_baseline_bytes": runtime}
    sampler.start()
    held = []
    for _ in range(8):  # 128 MB, 16 MB at a time, while the sampler's thread samples
        chunk = mx.ones((16 * MB,), dtype=mx.uint8)
        mx.eval(chunk)
        held.append(chunk)
        time.sleep(0.05)
    sampler.stop()
    events.emit("after", rank=5)  # the writer is still open; nothing was torn
    events.close()
    recorded = list(schema.read_events(path))
    assert recorded[-1]["kind"] == "after"
    memory = [e for e in recorded if e["kind"] == "memory"]
    mlx = [max(e["mlx_active_bytes"], e["mlx_peak_bytes"]) for e in memory]
    assert all(e["rank"] == 5 for e in memory)
    seen = [(m // MB, e["rss_bytes"] // MB) for m, e in zip(mlx, memory, strict=True)]
    assert 128 * MB <= mlx[-1] and 4 <= len(memory) <= 20, seen
    for before, after, e, b in zip(mlx, mlx[1:], memory[1:], memory, strict=False):
        assert rose(after, before) or rose(e["rss_bytes"], b["rss_bytes"])  # against the last one written
    figures = sampler.figures()
    assert figures["rss_baseline"] == JOB_START and figures["rss_baseline_bytes"] == runtime
    assert figures["rss_peak_after_baseline_bytes"] >= max(e["rss_bytes"] for e in memory)
    del held


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a thread's signal mask from Linux's /proc")
def test_the_sampler_thread_leaves_the_stack_dump_signal_to_the_main_thread(tmp_path: Path) -> None:
    """The watchdog's SIGUSR1 dumps the main thread's stack; a sampler thread that took it could
    be dumped mid-run instead (harness.rank.entry), so it blocks it."""
    events = schema.EventWriter(tmp_path / "events.jsonl")
    sampler = MemorySampler(events, 0, peak_rss_bytes(), JOB_START, every_s=0.005)
    sampler.start()
    try:
        time.sleep(0.05)
        tid = sampler._thread.native_id
        blocked = next(int(ln.split()[1], 16) for ln in Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
                       if ln.startswith("SigBlk:"))
        main = next(int(ln.split()[1], 16) for ln in Path("/proc/thread-self/status").read_text().splitlines()
                    if ln.startswith("SigBlk:"))
    finally:
        sampler.stop()
        events.close()
    assert blocked & (1 << (signal.SIGUSR1 - 1)) and not main & (1 << (signal.SIGUSR1 - 1))


def test_an_alternating_sampler_samples_in_its_blocks_with_and_sleeps_in_those_without(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch
                                                                                      ) -> None:
    events = schema.EventWriter(tmp_path / "events.jsonl")
    sampler = MemorySampler(events, 0, peak_rss_bytes(), JOB_START, every_s=0.005)
    taken: list[float] = []
    monkeypatch.setattr(sampler, "sample", lambda: taken.append(time.monotonic()))
    sampler.alternate(2)  # steps 1-2 with it, 3-4 without, 5-6 with
    sampler.start()

    def samples_over(seconds: float) -> int:
        before = len(taken)
        time.sleep(seconds)
        return len(taken) - before

    try:
        assert samples_over(0.2) >= 3  # step 1 runs: sampling
        sampler.step_ended(1)
        assert samples_over(0.2) >= 3  # step 2: still its block with
        sampler.step_ended(2)
        time.sleep(0.02)  # a sample under way when the block ended
        assert samples_over(0.3) == 0  # steps 3 and 4: none
        assert sampler.step_ended(3)["rss_bytes"] > 0  # each step's own figures are still taken
        assert samples_over(0.1) == 0
        sampler.step_ended(4)
        assert samples_over(0.2) >= 3  # step 5: sampling again
    finally:
        sampler.stop()
        events.close()
    assert sampler.error is None


def test_the_sampler_and_the_ledger_alternate_and_a_part_alternating_is_not_off() -> None:
    env = {ablation.VAR: "sampler/5,ledger"}
    assert ablation.alternating(env) == {"sampler": 5} and ablation.ablated(env, strict=True) == {"ledger"}
    assert ablation.alternating({ablation.VAR: "ledger/3"}) == {"ledger": 3}
    assert ablation.ablated({ablation.VAR: "ledger/3"}, strict=True) == set()
    for bad in ("start/5", "sampler/0", "sampler/x"):
        with pytest.raises(ablation.AblationError, match=f"{bad!r}: the parts that alternate are sampler and ledger"):
            ablation.ablated({ablation.VAR: bad}, strict=True)
        assert ablation.alternating({ablation.VAR: bad}) == {}  # a rank ignores what it cannot do
