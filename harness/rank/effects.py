"""Side effects of training (callbacks, the log, saves): rank 0 does them, every rank counts them.

The counts go into each rank's result, so a judge can check that only rank 0 acted. Callback
records go to ``rank{r}.callbacks.jsonl`` named after the rank that wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import schema


class MainRankEffects:
    def __init__(self, run_dir: Any, rank: int, keep_start: bool = False, keep_params: bool = True):
        self.run_dir, self.rank = run_dir, rank
        self.keep_start = keep_start  # rank 0 keeps the start parameters (the job's ``keep_start``)
        self.keep_params = keep_params  # rank 0 keeps a copy of the final ones (the job's ``keep_params``)
        self.counts = {"callbacks": 0, "log_lines": 0, "saves": 0, "checkpoints": 0, "probes": 0}
        self._files: dict[str, Any] = {}  # the callback file and the log, opened at their first line

    def _append(self, name: str, line: str) -> None:
        """Appends ``line`` to the run directory's ``name``, flushed at once (line-buffered): a step's
        lines cost a write each, not an open and a close."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(Path(self.run_dir) / name, "a", buffering=1)
        f.write(line)

    def close(self) -> None:
        """Closes the files the callbacks and the log appended to (training is over)."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    @property
    def active(self) -> bool:
        return self.rank == 0

    def callback(self, kind: str, record: dict[str, Any]) -> None:
        """A step or eval callback: appends the record to the rank's callback file."""
        if not self.active:
            return
        self._append(f"rank{self.rank}.callbacks.jsonl", json.dumps({"kind": kind, **record}) + "\n")
        self.counts["callbacks"] += 1
        self.log(kind, record)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        if not self.active:
            return
        fields = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        self._append("train.log", f"{kind} {fields}\n")
        self.counts["log_lines"] += 1

    def checkpoint(self, write: Any) -> Any:
        """Rank 0 writes a checkpoint with ``write()``; returns what it wrote (None elsewhere)."""
        if not self.active:
            return None
        info = write()
        self.counts["checkpoints"] += 1
        return info

    def probe(self, path: Any, model: Any, grads: Any, meta: dict[str, Any]) -> None:
        """Rank 0 writes a step-local probe (the parameters and global gradient at a step)."""
        if not self.active:
            return
        from harness.rank.step_probe import write_probe

        write_probe(path, model, grads, meta)
        self.counts["probes"] += 1

    @property
    def keeps_start(self) -> bool:
        from harness import ablation

        return self.active and self.keep_start and ablation.on("start")

    def save_start(self, params: Any) -> None:
        """Rank 0 writes the parameters training starts from (``schema.start_params_path``), where
        the job asks for them."""
        if self.keeps_start:
            self._write(schema.start_params_path(self.run_dir), params)

    def _write(self, final: Any, params: Any) -> None:
        from harness.rank.host_read import write_safetensors

        write_safetensors(final, params)

    def save_params(self, model: Any) -> None:
        """Rank 0 writes the final parameters (of a model, or a parameter tree) atomically, a save
        of the trainer's own (counted): a reader never sees a partial file."""
        if self.active:
            self._write(schema.params_path(self.run_dir), model)
            self.counts["saves"] += 1

    def keep_params_for_judge(self, params: Any) -> None:
        """Rank 0 writes the harness's own copy of an external trainer's final parameters (not
        counted as the trainer's save), where the job's checks compare them."""
        if self.active and self.keep_params:
            self._write(schema.params_path(self.run_dir), params)
