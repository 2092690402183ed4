"""A rank's memory while it runs: sampled on a thread, reported in its events and its result.

Two figures mean the same on every device. MLX's own memory (``mx.get_active_memory`` and
``mx.get_peak_memory``: its buffers, wherever they live) is the device figure. The process RSS
is the host figure, counted from the rank's baseline on its device: on a CPU and on Metal MLX's
buffers are host memory, and the baseline is what the rank held before its job (``job start``);
on CUDA device memory is not in RSS, but the runtime loads the kernels of the first training step
into host memory during that step (0.25 to 0.55 GB per rank on an H100), so the baseline is the
RSS at the end of the first step this process trained (``end of step N``).

``MemorySampler`` samples both figures every ``SAMPLE_S`` on a daemon thread and writes a
``memory`` event only when one rose by more than ``max(RISE_BYTES, RISE_FRACTION)`` of the last
one written: the watchdog sees a runaway during a step, and the events stay few. Trainers call
``step_ended`` once per optimizer step (its fields go into their ``step`` event); the rank's
result carries ``figures()`` and ``peaks()``.

A rank whose trainer is another process (an executable under the rank protocol) has the sampler
``follow`` it: the RSS is that process's, counted from the end of its first step (its start-up
is not the job's), and the MLX figure is what it reports in its step events (``reported``).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from harness import schema

SAMPLE_S = 0.02
RISE_BYTES = 8 * 1024 * 1024
RISE_FRACTION = 0.05
JOB_START = "job start"
FIRST_STEP = "end of the first step"  # until that step ends; then "end of step N"


def peak_rss_bytes() -> int:
    """The process's peak RSS so far (``ru_maxrss``)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_baseline_kind(gpu: bool, cuda: bool) -> str:
    """``JOB_START`` where MLX memory is host memory (a CPU, Metal's unified memory);
    ``FIRST_STEP`` on a CUDA GPU, whose runtime grows the RSS during the first step."""
    return FIRST_STEP if gpu and cuda else JOB_START


def accelerator() -> str:
    """What MLX's default device in this process is: ``cuda``, ``metal`` or ``cpu``."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "metal"


def device_baseline_kind() -> str:
    """``rss_baseline_kind`` of MLX's default device in this process."""
    kind = accelerator()
    return rss_baseline_kind(kind != "cpu", kind == "cuda")


def rose(value: int, last: int) -> bool:
    """``value`` is meaningfully above ``last``: by more than 8 MB and more than 5 %."""
    return value > last + max(RISE_BYTES, RISE_FRACTION * last)


class MemorySampler:
    """One rank's memory figures (see the module docstring). ``runtime_bytes``: what the rank
    held before its job, the baseline at ``JOB_START``."""

    def __init__(self, events: schema.EventWriter, rank: int, runtime_bytes: int, kind: str,
                 every_s: float = SAMPLE_S):
        import psutil

        self.events, self.rank, self.every_s = events, rank, every_s
        self.proc = psutil.Process()
        self.baseline = kind
        self.baseline_bytes: int | None = runtime_bytes if kind == JOB_START else None
        self.rss_peak = runtime_bytes if kind == JOB_START else 0  # after the baseline
        self.last_mlx = self.last_rss = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why sampling stopped before the job ended
        self.followed: int | None = None  # the pid of the trainer process followed
        self.reported_mlx = 0  # the followed process's MLX peak, as it reported it
        self.block: int | None = None  # sampling only in alternate blocks of this many steps (``alternate``)
        self._running = threading.Event()
        self._running.set()

    def follow(self, pid: int) -> None:
        """Sample process ``pid`` (the rank's trainer) from now on, from a first-step baseline."""
        import psutil

        with self._lock:
            self.proc, self.followed = psutil.Process(pid), pid
            self.baseline, self.baseline_bytes, self.rss_peak = FIRST_STEP, None, 0
            self.last_rss = 0

    def followed_ended(self, peak_bytes: int) -> None:
        """The followed process ended, its peak RSS ``peak_bytes`` as the kernel counted it: part of
        the peak after the baseline once one was taken (as this process's own kernel peak is)."""
        with self._lock:
            self.last_rss = max(self.last_rss, peak_bytes)
            if self.baseline_bytes is not None:
                self.rss_peak = max(self.rss_peak, peak_bytes)

    def reported(self, mlx_peak_bytes: int) -> None:
        """The followed process's MLX peak memory, from its step event."""
        self.reported_mlx = max(self.reported_mlx, int(mlx_peak_bytes))

    def _rss(self) -> int:
        import psutil

        try:
            return self.proc.memory_info().rss
        except psutil.Error:  # the followed process has ended: its last figures stand
            return self.last_rss if self.followed is not None else 0

    def peaks(self) -> dict[str, Any]:
        """The result's peak MLX memory and peak RSS (the followed process's, where one is)."""
        if self.followed is None:
            import mlx.core as mx

            return {"mlx_peak_bytes": int(mx.get_peak_memory()), "rss_peak_bytes": peak_rss_bytes()}
        with self._lock:
            return {"mlx_peak_bytes": self.reported_mlx, "rss_peak_bytes": max(self.rss_peak, self.last_rss)}

    def start_fields(self) -> dict[str, Any]:
        """What the ``start`` event says of the baseline."""
        return {"rss_baseline": self.baseline, "rss_baseline_bytes": self.baseline_bytes}

    def start(self) -> None:
        self.last_mlx, self.last_rss = self._mlx(), self._rss()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def alternate(self, block: int) -> None:
        """Sample in steps 1 to ``block``, not in the next ``block``, and so on (a benchmark's
        measure of what sampling costs a step, ``harness.ablation.alternating``): the thread sleeps
        through the blocks without, and no figure is taken there but at each step's end."""
        self.block = block

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # the stack-dump signal is for the main thread (rank.entry)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            while not self._stop.wait(self.every_s):
                if not self._running.is_set():
                    self._running.wait()  # a block without sampling (``alternate``): no wake-ups
                    continue
                self.sample()
        except Exception as e:  # noqa: BLE001 - the result says the sampled figures stopped there
            self.error = f"{type(e).__name__}: {e}"

    def _mlx(self) -> int:
        return max(self._mlx_now())

    def _mlx_now(self) -> tuple[int, int]:
        """MLX's active and peak memory (the followed process's reported peak, for both)."""
        if self.followed is not None:
            return self.reported_mlx, self.reported_mlx
        import mlx.core as mx

        return int(mx.get_active_memory()), int(mx.get_peak_memory())

    def sample(self) -> None:
        """Sample both figures; write a ``memory`` event when one rose."""
        active, peak = self._mlx_now()
        rss = self._rss()
        with self._lock:
            if self.baseline_bytes is not None:
                self.rss_peak = max(self.rss_peak, rss)
            if not (rose(max(active, peak), self.last_mlx) or rose(rss, self.last_rss)):
                return
            self.last_mlx, self.last_rss = max(active, peak), rss
        self.events.emit("memory", rank=self.rank, mlx_active_bytes=active, mlx_peak_bytes=peak, rss_bytes=rss)

    def step_ended(self, step: int) -> dict[str, Any]:
        """Optimizer step ``step`` ended: the memory fields of its ``step`` event (the baseline's,
        at the step that set it)."""
        if self.block is not None:  # the next step's block: with sampling or without
            (self._running.set if (step // self.block) % 2 == 0 else self._running.clear)()
        rss = self._rss()
        fields: dict[str, Any] = {"mlx_peak_bytes": self._mlx_now()[1], "rss_bytes": rss}
        with self._lock:
            if self.baseline_bytes is None:
                self.baseline, self.baseline_bytes, self.rss_peak = f"end of step {step}", rss, rss
                fields.update(rss_baseline=self.baseline, rss_baseline_bytes=rss)
            self.rss_peak = max(self.rss_peak, rss)
        return fields

    def figures(self) -> dict[str, Any]:
        """The result's fields: the baseline (``None`` bytes while none was taken) and the peak RSS
        after it (at ``JOB_START`` also the kernel's peak, which sees what fell between samples)."""
        rss = self._rss()
        with self._lock:
            known = self.baseline_bytes is not None
            peak = max(self.rss_peak, rss, peak_rss_bytes() if self.baseline == JOB_START else 0)
            return {"rss_baseline": self.baseline, "rss_baseline_bytes": self.baseline_bytes,
                    "rss_peak_after_baseline_bytes": peak if known else None, "memory_sampler_error": self.error}
