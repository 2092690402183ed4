"""The controller's agent on a cluster host: ``python -m harness.controller.host_agent``.

The controller starts one agent per host over SSH for each run across hosts (as pytest-xdist
starts its workers) and talks to it in JSON lines over the SSH session's stdin/stdout. The agent
never imports MLX: it starts in a fraction of a second. It

- answers ``hello`` with the host's harness, MLX and Python versions (preflight);
- ``setup``: makes the run's private directory on the host; ``lease``: leases the run's ring
  ports there (the same machine-wide lease as local runs, held by the agent's own process);
  ``ring_yield``: links the library that makes ring ranks yield a waiting core into it, where the
  run's ranks on this host fill its cores;
- ``have`` / ``put``: says whether an input file is already present with the same content, and
  writes shipped files;
- ``watch``: from then on, every ``TICK_S`` it sends what the ranks wrote under the watched
  directories (events, results, logs, probes, checkpoints: the versioned protocol files) as
  ``file`` messages, and each rank's process state as a ``procs`` message (a rank reported
  ended has all it wrote before its end already sent);
- ``signal``: signals ranks (stack dumps); ``reach``: whether this host reaches the others'
  addresses (why a run stopped progressing);
- ``finish``, or the end of its input (the controller or the SSH link is gone): kills the ranks
  still running (those it knows the pids of, and any process working in the run's directory),
  sends the last files, removes the run's directory and mlx.launch's pidfiles, releases the
  ports (and the lease directory, when no other run holds a lease there) and exits. Nothing of
  the run stays on the host. Why it ended goes to its stderr, which the controller reads;
- ``adopt``: takes over a run whose agent gave no answer at its end (``remote``), so that it
  can be finished: its directory, its ranks' pids and, where given, the files the controller
  already has (``Mirror.resume``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import platform
import select
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from harness import main_thread_signal
from harness.controller import host_cleanup
from harness.controller.host_mirror import Mirror, sha256_of

AGENT_MODULE = "harness.controller.host_agent"
TICK_S = 0.05
KILL_WAIT_S = 5.0
REACH_PORT = 9  # discard: a host that answers at all (even refusing) is reachable


def source_digest() -> str:
    """A digest of the harness's own source files: hosts must run the same code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, Any]:
    """What the controller compares across hosts."""
    from importlib import metadata

    import harness

    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    mlx = dist("mlx") or dist("mlx-cuda") or dist("mlx-metal")
    return {"harness": harness.__version__, "source": source_digest(), "mlx": mlx,
            "python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
            "hostname": socket.gethostname(), "executable": sys.executable}


class Agent:
    def __init__(self) -> None:
        self.root: Path | None = None
        self.lease: Any = None
        self.mirror: Mirror | None = None
        self.pids: dict[int, int] = {}
        self.rank_procs: dict[int, Any] = {}  # rank -> its psutil.Process, made when its pid was read
        self.ended: set[int] = set()
        self.out: Any = sys.stdout
        self.why = "running"  # why it ended, as its last stderr line says
        self.adopted = False  # it took over a run another agent started (``op_adopt``)
        self.run_dir: str | None = None  # the run's directory (``root``) resolved, kept once removed

    def send(self, msg: dict[str, Any]) -> None:
        if self.out is None:
            return
        try:
            self.out.write(json.dumps(msg) + "\n")
            self.out.flush()
        except OSError as e:  # the controller is gone: clean up all the same
            self.out = None
            if self.why == "running":
                self.why = f"its output failed ({type(e).__name__}: {e})"

    # requests ------------------------------------------------------------------------------
    def op_hello(self, req: dict[str, Any]) -> dict[str, Any]:
        return {**versions(), "memory_bytes": psutil.virtual_memory().total, "cpus": os.cpu_count()}

    def op_backends(self, req: dict[str, Any]) -> dict[str, Any]:
        """The distributed backends MLX has here, and its default device (imports MLX)."""
        import mlx.core as mx

        names = ("ring", "nccl", "mpi", "jaccl")
        return {"backends": [b for b in names if mx.distributed.is_available(b)], "device": str(mx.default_device())}

    def op_reach(self, req: dict[str, Any]) -> dict[str, Any]:
        """Whether this host reaches each address over TCP: a connection made or refused is
        reached; a timeout or an unreachable network is not (the error, as one line)."""
        timeout = float(req.get("timeout", 1.0))
        out = {}
        for addr in req["addrs"]:
            try:
                socket.create_connection((addr, REACH_PORT), timeout=timeout).close()
                out[addr] = ""
            except ConnectionRefusedError:
                out[addr] = ""
            except TimeoutError:
                out[addr] = f"no answer in {timeout:g} s"
            except OSError as e:
                out[addr] = e.strerror or str(e) or type(e).__name__
        return {"reach": out}

    def op_setup(self, req: dict[str, Any]) -> dict[str, Any]:
        root = Path(req["root"])
        root.mkdir(mode=0o700, parents=True, exist_ok=False)
        self.root = root.resolve()  # as the mirror's paths are (macOS's /tmp is /private/tmp)
        self.run_dir = str(self.root)
        (root / "pids").mkdir()
        (root / "pids" / "agent").write_text(str(os.getpid()))  # for an agent that takes the run over
        (root / "tmp").mkdir()  # the launcher's and MLX's temporary files
        return {"ok": True}

    def op_lease(self, req: dict[str, Any]) -> dict[str, Any]:
        """Hold ports ``start .. start+count-1`` here (instead of any block held before)."""
        from harness.controller.ports import lease_block

        if self.lease is not None:
            self.lease.release()
            self.lease = None
        start, count = req["ports"]
        try:
            self.lease = lease_block(start, count, req.get("ips") or [])
        except OSError as e:
            return {"ok": False, "fatal": True, "error": str(e)}
        if self.lease is None:
            return {"ok": False, "error": f"ports {start}-{start + count - 1} are taken on this host"}
        return {"ok": True}

    def op_ring_yield(self, req: dict[str, Any]) -> dict[str, Any]:
        """Link the yielding library into the run's directory where the ranks placed on this host
        fill its cores, or under ``on`` (``ring_yield.plan``); the ranks' shell preloads it from there."""
        from harness.controller import ring_yield

        assert self.root is not None, "no setup yet"
        calm = ring_yield.plan(int(req["ranks"]), req.get("backend"), req.get("setting", "auto"),
                               int(req.get("world_size") or req["ranks"]))
        if calm is None:
            return {"why": None}
        (self.root / "ring_yield.so").symlink_to(calm.library)
        return {"why": calm.why}

    def op_have(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"sha256": [sha256_of(Path(p)) for p in req["paths"]]}

    def op_put(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self._inside(req["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab" if req.get("offset") else "wb") as f:
            f.write(base64.b64decode(req["data"]))
        return {"ok": True}

    def op_mkdir(self, req: dict[str, Any]) -> dict[str, Any]:
        for p in req["paths"]:
            self._inside(p).mkdir(parents=True, exist_ok=True)
        return {"ok": True}

    def op_watch(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.root is not None
        self.mirror = Mirror(self.root, [str(self._inside(d)) for d in req["dirs"]])
        return {"ok": True}

    def op_adopt(self, req: dict[str, Any]) -> dict[str, Any]:
        """Take over the run at ``root`` that another agent held (it gave no answer): what that
        one had not finished, this one finishes. It ends that agent first. ``found`` is false
        where the directory is gone; ``known``: the files the controller has (``Mirror.resume``)."""
        root = Path(req["root"]).resolve()
        self.adopted, self.run_dir = True, str(root)
        if not root.is_dir():
            return {"ok": True, "found": False}
        self.root = root
        host_cleanup.end_agent(root / "pids" / "agent", AGENT_MODULE, KILL_WAIT_S)
        with contextlib.suppress(OSError):
            (root / "pids" / "agent").write_text(str(os.getpid()))
        self._read_pids()
        self.mirror = Mirror(root, [str(self._inside(d)) for d in req.get("dirs", [])])
        return {"ok": True, "found": True, "resumed": self.mirror.resume(req.get("known") or {})}

    def op_signal(self, req: dict[str, Any]) -> dict[str, Any]:
        sent = []
        for r in req["ranks"]:
            pid = self.pids.get(int(r))
            if pid and int(r) not in self.ended:
                with contextlib.suppress(ProcessLookupError):
                    main_thread_signal.send(pid, getattr(signal, req["sig"]))
                    sent.append(int(r))
        return {"sent": sent}

    def _inside(self, path: str) -> Path:
        assert self.root is not None, "no setup yet"
        p = (self.root / path).resolve()
        if self.root.resolve() not in (p, *p.parents):
            raise ValueError(f"{path}: outside the run's directory")
        return p

    # the watch loop ------------------------------------------------------------------------
    def _read_pids(self) -> None:
        if self.root is None:
            return
        for f in (self.root / "pids").glob("rank*"):
            with contextlib.suppress(ValueError, OSError):
                rank, pid = int(f.name[4:]), int(f.read_text().strip())
                if rank in self.pids:
                    continue
                self.pids[rank] = pid
                # the process itself, so that a pid reused after the rank ended is never signalled
                # (an adopted run's pidfiles are old: their processes must predate them)
                proc = host_cleanup.process_of(f) if self.adopted else _process(pid)
                if proc is None:
                    self.ended.add(rank)
                else:
                    self.rank_procs[rank] = proc

    def _procs(self) -> dict[str, Any]:
        out = {}
        for r, pid in self.pids.items():
            rss, alive = None, False
            if r not in self.ended:
                p = self.rank_procs[r]
                alive = host_cleanup.running(p)
                with contextlib.suppress(psutil.Error):
                    rss = p.memory_info().rss if alive else None
            if not alive:
                self.ended.add(r)
            out[str(r)] = {"pid": pid, "alive": alive, "rss": rss}
        return out

    def tick(self) -> None:
        self._read_pids()
        procs = self._procs()  # before the files: what a rank wrote before it ended is sent below
        if self.mirror is not None:
            self.mirror.scan(self.send)
            self.send({"op": "procs", "ranks": procs, "time": time.time()})

    def finish(self) -> dict[str, Any]:
        """Kill the ranks left, send the last files, remove everything of the run."""
        self._read_pids()
        ranks = [p for r, p in self.rank_procs.items() if r not in self.ended]
        working = host_cleanup.working_in(self.run_dir) if self.run_dir else []
        survivors = host_cleanup.kill_all([*ranks, *working], KILL_WAIT_S)
        if self.mirror is not None:
            self.mirror.scan(self.send)
        removed = True
        for f in host_cleanup.launcher_files(self.root / "pids") if self.root is not None else []:
            with contextlib.suppress(OSError):
                f.unlink()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            removed = not self.root.exists()
        if self.lease is not None or self.adopted:  # an adopted run's lease died with its agent
            from harness.controller.ports import drop_idle_lease_dir

            if self.lease is not None:
                self.lease.release()
                self.lease = None
            drop_idle_lease_dir()
        self.root = None
        return {"survivors": survivors, "removed": removed}

    def serve(self) -> None:
        buf = b""
        fd = sys.stdin.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], TICK_S)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.why = "its input ended (the controller or its SSH link is gone)"
                    self.finish()
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    op = req["op"]
                    if op == "finish":
                        self.why = "asked to finish"
                        self.send({"id": req.get("id"), **self.finish()})
                        return
                    try:
                        reply = getattr(self, f"op_{op}")(req)
                    except Exception as e:  # a request that fails is answered, never fatal
                        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    self.send({"id": req.get("id"), **reply})
            self.tick()


def _process(pid: int) -> Any:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _why(e: BaseException) -> str:
    """What ended the agent, as its last stderr line says (``_exit``: a signal)."""
    code = e.code if isinstance(e, SystemExit) else None
    if isinstance(code, int) and code > 128:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(code - 128).name}"
    return f"{type(e).__name__}: {e}"


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit)
    agent = Agent()
    try:
        agent.serve()
    except BaseException as e:
        agent.why = _why(e)
        agent.finish()
        raise
    finally:
        with contextlib.suppress(OSError):
            print(f"agent: ended: {agent.why}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
