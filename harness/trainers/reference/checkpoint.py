"""Checkpoints on disk: written whole or not at all, verified before anything is read.

A checkpoint root holds one directory per checkpoint::

    step-00000008/   model.safetensors  optimizer.safetensors  trainer.json  manifest.json
    .partial-step-00000012-4711/   a write in progress, or one killed mid-way: never read

Rank 0 writes every file into a ``.partial-`` directory, fsyncs each, lists their sizes and
SHA-256 digests in ``manifest.json`` (written last), fsyncs the directory and renames it to its
final name. So a directory with a final name is complete, and a reader can prove it is intact:
``verify`` checks every listed file's size and digest and names the first file that differs.
Only after a new checkpoint is complete are older ones beyond ``keep_last`` removed.
Tensors are safetensors and state is JSON; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1
MODEL, OPTIMIZER, TRAINER, MANIFEST = "model.safetensors", "optimizer.safetensors", "trainer.json", "manifest.json"
FILES = (MODEL, OPTIMIZER, TRAINER)
PARTIAL = ".partial-"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged or does not fit this run; the message names the file."""


def dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))


def partials(root: Path) -> list[str]:
    """Names of unfinished checkpoint directories under ``root``."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(PARTIAL)) if root.is_dir() else []


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: Path, step: int, params: dict[str, Any], optimizer: dict[str, Any], state: dict[str, Any],
          keep_last: int, between_files: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write one checkpoint atomically, then prune; returns what was written and removed.

    ``between_files`` runs after each tensor file is written (fault injection: a kill there
    leaves a partial directory behind, as a crash mid-write would).
    """

    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{PARTIAL}{dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = _write_files(tmp, step, params, optimizer, state, between_files)
    except (OSError, RuntimeError) as e:  # a full or failing disk: free what was written, keep the rest
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        raise CheckpointError(f"checkpoint {root / dir_name(step)} could not be written ({e}); {free} bytes "
                              f"free there once the unfinished write was removed; the checkpoints before it "
                              f"are untouched") from e
    final = root / dir_name(step)
    if final.exists():  # the same step written again (a re-run): replace it whole
        old = root / f"{PARTIAL}old-{dir_name(step)}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _fsync(root)
    return {"step": step, "path": str(final), "bytes": sum(f["bytes"] for f in files.values()),
            "write_s": round(time.perf_counter() - t0, 4), "removed": prune(root, keep_last)}


def _write_files(tmp: Path, step: int, params: dict[str, Any], optimizer: dict[str, Any], state: dict[str, Any],
                 between_files: Callable[[str], None] | None) -> dict[str, Any]:
    """Every file of a checkpoint into ``tmp``, the manifest last, all fsynced; the manifest's
    file list. The arrays are read through device copies (``host_read``), as every host read of
    the harness's is, so that a checkpoint leaves the training's own buffers where they were."""
    from harness.rank.host_read import write_safetensors

    tmp.mkdir()
    for name, arrays in ((MODEL, params), (OPTIMIZER, optimizer)):
        write_safetensors(tmp / name, arrays)
        if between_files:
            between_files(name)
    (tmp / TRAINER).write_text(json.dumps(state, sort_keys=True))
    files = {}
    for name in FILES:
        _fsync(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
    manifest = {"format": FORMAT, "step": step, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    return files


def prune(root: Path, keep_last: int) -> list[str]:
    """Remove complete checkpoints beyond the newest ``keep_last`` (0 keeps all), and partial
    directories left by writers that are gone."""
    steps = complete_steps(root)
    removed = [dir_name(s) for s in (steps[:-keep_last] if keep_last > 0 else [])]
    mine = f"-{os.getpid()}"
    removed += [p for p in partials(root) if not p.endswith(mine)]
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    return removed


@dataclass
class Checkpoint:
    """One complete checkpoint directory, as resolved by one rank."""

    path: Path
    step: int
    manifest_sha256: str
    manifest: dict[str, Any]
    skipped_partials: list[str] = field(default_factory=list)

    @property
    def identity(self) -> str:
        return f"{self.path.name} manifest sha256 {self.manifest_sha256[:16]}"


def resolve(source: Path, step: int | None = None, hide_newest: bool = False) -> Checkpoint:
    """The checkpoint to resume from: ``source`` itself when it is a step directory, else the
    newest complete one under it (or the one of ``step``). Reads only its manifest.

    ``hide_newest`` makes this rank not see the newest checkpoint (a stale file-system view;
    fault injection for the agreement on which checkpoint every rank resumes from).
    """
    if (m := _STEP_DIR.match(source.name)) is not None:
        root, step = source.parent, int(m.group(1))
        if not source.is_dir():
            raise CheckpointError(f"{source}: checkpoint directory not found")
    else:
        root = source
        if not root.is_dir():
            raise CheckpointError(f"{root}: checkpoint directory not found")
        steps = complete_steps(root)
        if hide_newest:
            steps = steps[:-1]
        if not steps:
            extra = f" (unfinished: {', '.join(partials(root))})" if partials(root) else ""
            raise CheckpointError(f"{root}: no complete checkpoint{extra}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"{root}: no checkpoint for step {step} (complete: {', '.join(map(str, steps))})")
    path = root / dir_name(step)
    manifest_path = path / MANIFEST
    try:
        raw = manifest_path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{manifest_path}: unreadable ({e.strerror or e})") from e
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step:
        raise CheckpointError(f"{manifest_path}: not a format-{FORMAT} manifest for step {step}")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        raise CheckpointError(f"{manifest_path}: lists {sorted(files or {})}, expected {sorted(FILES)}")
    return Checkpoint(path, step, hashlib.sha256(raw).hexdigest(), manifest, partials(root))


def verify(ck: Checkpoint) -> None:
    """Every file the manifest lists is there, with its size and SHA-256 digest."""
    for name in FILES:
        meta, p = ck.manifest["files"][name], ck.path / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the manifest lists it)")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
        digest = sha256_file(p)
        if digest != meta["sha256"]:
            raise CheckpointError(f"{p}: SHA-256 {digest[:16]}... does not match the manifest's "
                                  f"{meta['sha256'][:16]}... (corrupted)")


def read(ck: Checkpoint) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(parameters, optimizer state, trainer state) of a verified checkpoint."""
    import mlx.core as mx

    def tensors(name: str) -> dict[str, Any]:
        try:
            return dict(mx.load(str(ck.path / name)))
        except Exception as e:  # noqa: BLE001 - a bad file is named, whatever the loader raised
            raise CheckpointError(f"{ck.path / name}: unreadable safetensors ({e})") from e

    try:
        state = json.loads((ck.path / TRAINER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ck.path / TRAINER}: unreadable ({e})") from e
    if state.get("format") != FORMAT or state.get("step") != ck.step:
        raise CheckpointError(f"{ck.path / TRAINER}: not a format-{FORMAT} trainer state for step {ck.step}")
    return tensors(MODEL), tensors(OPTIMIZER), state


def damage(path: Path, how: str) -> None:
    """Damage a committed file as failing storage would (fault injection): ``truncate`` to half,
    ``corrupt`` one byte in the middle, ``delete``."""
    if how == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
