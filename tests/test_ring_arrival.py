"""The last ring rank joins once every rank of its machine has left its mark (pure logic)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from harness.rank import ring_arrival


def test_the_last_rank_waits_for_every_mark_and_the_others_do_not_wait(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(ring_arrival.REMOTE_VAR, raising=False)
    assert ring_arrival.meet(tmp_path, 1, 3, "ring") == 0.0  # a middle rank leaves its mark, no wait
    late = threading.Timer(0.3, lambda: ring_arrival.mark_path(tmp_path, 0).touch())
    t0 = time.monotonic()
    late.start()
    waited = ring_arrival.meet(tmp_path, 2, 3, "ring")
    took = time.monotonic() - t0
    late.join()
    # it returned only once the late mark was there; on a loaded machine its own clock may start
    # a little after the timer's, so its reported wait is held to most of the 0.3 s
    assert took >= 0.3 and 0.2 <= waited < 5, (took, waited)
    assert ring_arrival.mark_path(tmp_path, 2).exists()


def test_no_wait_off_ring_on_one_rank_or_across_hosts(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(ring_arrival.REMOTE_VAR, raising=False)
    t0 = time.monotonic()
    assert ring_arrival.meet(tmp_path, 1, 2, "nccl") == 0.0
    assert ring_arrival.meet(tmp_path, 0, 1, "ring") == 0.0
    monkeypatch.setenv(ring_arrival.REMOTE_VAR, "/tmp/x")
    assert ring_arrival.meet(tmp_path, 1, 2, "ring") == 0.0
    assert time.monotonic() - t0 < 1 and not list(tmp_path.iterdir())


def test_a_missing_rank_costs_at_most_the_wait(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(ring_arrival.REMOTE_VAR, raising=False)
    monkeypatch.setattr(ring_arrival, "WAIT_S", 0.2)
    waited = ring_arrival.meet(tmp_path, 1, 2, "ring")
    assert 0.2 <= waited < 2, waited
