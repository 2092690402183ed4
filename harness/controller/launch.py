"""Start the rank processes of one run: a plain process for world size 1, mlx.launch otherwise.

Each launch runs in its own process group (so the watchdog can kill everything it started), with
stdin from /dev/null, a hostfile (mode 0600) and all temporary files inside the run directory,
and each rank's stdout/stderr redirected to its own files from the moment the interpreter starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness import ablation, schema
from harness.controller import ring_yield, warm_ranks
from harness.controller.devices import accelerators
from harness.controller.ports import PortLease, lease_ports
from harness.controller.rank_processes import HostProcesses, LocalProcesses, RankProcesses

if TYPE_CHECKING:
    from harness.cluster_spec import Cluster

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
RANK_MODULE = "harness.rank"
CALM_LAUNCH = "harness.controller.calm_launch"
TMPDIR_VAR = "MLX_DDP_HARNESS_TMPDIR"
LAUNCHER_LOG = "launcher.log"
_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|(was killed)|(completed))")


def default_backend() -> str:
    """What mlx.launch itself would pick: nccl where CUDA is available, ring otherwise."""
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def blas_preload() -> str | None:
    """Debian's OpenBLAS to preload into Linux CPU ranks (25x the bundled BLAS), if installed.

    Off with ``MLX_DDP_HARNESS_BLAS=bundled``.
    """
    if os.environ.get("MLX_DDP_HARNESS_BLAS", "auto") == "bundled":
        return None
    if sys.platform.startswith("linux") and os.path.exists(OPENBLAS):
        return OPENBLAS
    return None


def mlx_launch() -> list[str]:
    """The ``mlx.launch`` of the running interpreter's environment, as installed."""
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def find_launcher() -> list[str]:
    """How runs start mlx.launch: through ``calm_launch`` (mlx.launch without its busy waits,
    which would take a CPU core from the ranks)."""
    return [sys.executable, "-m", CALM_LAUNCH]


@dataclass
class Launch:
    """A started run: its process (group leader), directory and leased ports."""

    proc: subprocess.Popen
    run_dir: Path
    world_size: int
    backend: str | None
    lease: PortLease | None
    ranks: RankProcesses = field(default_factory=LocalProcesses)  # where they run: here or on cluster hosts
    ring_yield: str | None = None  # the note when its ranks yield a core while they wait (``ring_yield``)
    warm: bool = False  # its ranks were forked by a warm-start server (``warm_ranks``), not the launcher

    @property
    def pgid(self) -> int:
        return self.proc.pid


# What a distributed launch sets for its ranks: never inherited from the controller's environment
# (a world-size-1 rank must not think it is part of a group). Other MLX settings, such as
# MLX_ENABLE_TF32, reach the ranks as the user set them.
DISTRIBUTED_VARS = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES",
                    "MLX_RING_VERBOSE")


def _rank_env(run_dir: Path) -> dict[str, str]:
    """A rank's environment: this one's, less a launch's distributed variables, with the harness on
    ``PYTHONPATH`` and what the harness sets (``harness.ablation``'s ``env`` and ``preload``)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARS}
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env[ring_yield.ACTIVE_VAR] = "0"  # a rank forked from a warm server has the library mapped: not yielding
    if ablation.on("env"):
        env[TMPDIR_VAR] = tempfile.gettempdir()
        env["TMPDIR"] = str(run_dir / "tmp")
        env["PYTHONUNBUFFERED"] = "1"
    preload = blas_preload() if ablation.on("preload") else None
    if preload:
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        if ablation.on("env"):
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def write_hostfile(run_dir: Path, world_size: int, backend: str, hosts: list[dict] | None = None) -> Path:
    """A launcher hostfile of ``world_size`` local hosts (or of ``hosts``, one entry per rank),
    readable by the owner only; with an empty ``envs``, which mlx.launch before 0.32 requires."""
    path = run_dir / "hostfile.json"
    hosts = hosts or [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(world_size)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"backend": backend, "envs": [], "hosts": hosts}, f)
    return path


def start(run_dir: Path, world_size: int, backend: str | None = None) -> Launch:
    """Start the ranks of ``run_dir``'s job; the job file must already be there.

    The per-rank file names in the shell redirection below are those of ``schema.stdout_path``
    and ``schema.stderr_path``.
    """
    (run_dir / "tmp").mkdir(exist_ok=True)
    env = _rank_env(run_dir)
    common = dict(stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=str(run_dir))
    if world_size == 1:
        acc = accelerators()
        if acc.kind == "cuda" and acc.count > 1 and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = "0"  # one process, one GPU: as each rank of a run has
        warm = warm_ranks.rank_argv(run_dir, env)
        cmd = [sys.executable, *(warm or ["-m", RANK_MODULE]), str(run_dir)]
        with open(schema.stdout_path(run_dir, 0), "wb") as out, open(schema.stderr_path(run_dir, 0), "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, **common)
        return Launch(proc, run_dir, 1, None, None, warm=warm is not None)

    if not backend:
        raise ValueError("a launch of more than one rank needs a backend")
    calm = ring_yield.plan(world_size, backend)
    if calm is not None:
        env["LD_PRELOAD"] = ring_yield.with_library(env.get("LD_PRELOAD", ""))
        env[ring_yield.ACTIVE_VAR] = "1"
    lease = lease_ports(world_size + 1)  # one port per ring rank, the last for NCCL's rendezvous
    try:
        hostfile = write_hostfile(run_dir, world_size, backend)
        warm = warm_ranks.rank_argv(run_dir, env)
        # exec keeps the launcher's pidfile pointing at the Python rank itself (or its warm client).
        rank_cmd = (
            'exec "$0" ' + (warm_ranks.shell_words(warm) if warm else '-m ' + RANK_MODULE)
            + ' "$1" >"$1/rank$MLX_RANK.stdout" 2>"$1/rank$MLX_RANK.stderr"'
        )
        gpus = accelerators().count if backend != "nccl" and accelerators().kind == "cuda" else 0
        if gpus:  # ring ranks on CUDA: spread over the GPUs as nccl would (mlx.launch sets nothing)
            rank_cmd = f'export CUDA_VISIBLE_DEVICES=$((MLX_RANK % {gpus})); ' + rank_cmd
        cmd = [
            *find_launcher(),
            "--hostfile", str(hostfile),
            "--backend", backend,
            "--starting-port", str(lease.start),
            "--nccl-port", str(lease.start + world_size),
            # mlx.launch assigns CUDA_VISIBLE_DEVICES = rank % n for nccl: one GPU per rank.
            "-n", str(world_size),
            "--cwd", str(run_dir),
            "--", "sh", "-c", rank_cmd, sys.executable, str(run_dir),
        ]
        with open(run_dir / LAUNCHER_LOG, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **common)
    except BaseException:
        lease.release()
        raise
    return Launch(proc, run_dir, world_size, backend, lease, ring_yield=None if calm is None else calm.why,
                  warm=warm is not None)


# What a rank on a cluster host runs: its files under the host's mirror of the run directory
# (``D``), MLX's kernel cache inside the run's directory, its pid (and its shell's, which
# mlx.launch records in a temporary file of its own) where its host's agent finds them, and the
# yielding library where the agent linked it (``ring_yield``: the host's ranks fill its cores).
# The shell waits for the rank rather than exec it: its exit status (128 + N for signal N) is
# what SSH passes back, where a rank ended by a signal would otherwise read as SSH's own 255.
REMOTE_RANK_CMD = (
    f'R="${schema.HOST_ROOT_VAR}"; D="$R/m$1"; echo $$ >"$R/pids/shell$MLX_RANK"; '
    'export TMPDIR="$D/tmp" MLX_DDP_HARNESS_TMPDIR="$R/tmp"; '
    'if [ -z "$MLX_DDP_HARNESS_BLAS" ] && [ -f ' + OPENBLAS + ' ]; then '
    'export LD_PRELOAD=' + OPENBLAS + '${LD_PRELOAD:+:$LD_PRELOAD} '
    'OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}; fi; '
    'if [ -e "$R/ring_yield.so" ]; then export LD_PRELOAD="$R/ring_yield.so${LD_PRELOAD:+:$LD_PRELOAD}"; fi; '
    'cd "$D" || exit 126; '
    '"$0" -m ' + RANK_MODULE + ' "$D" >"$D/rank$MLX_RANK.stdout" 2>"$D/rank$MLX_RANK.stderr" & '
    'echo $! >"$R/pids/rank$MLX_RANK"; wait $!'
)
SIGNAL_STATUS = 128  # a shell's exit status for a child ended by signal N is 128 + N


def _remote_envs(cluster: Cluster, root: str) -> list[str]:
    """The environment ranks on cluster hosts get (nothing is inherited over SSH): the run's
    directory, unbuffered output, and the MLX settings the user made for the controller."""
    envs = [f"{schema.HOST_ROOT_VAR}={root}", f"TMPDIR={root}/tmp", "PYTHONUNBUFFERED=1", *cluster.envs]
    if os.environ.get("MLX_DDP_HARNESS_BLAS", "auto") == "bundled":
        envs.append("MLX_DDP_HARNESS_BLAS=bundled")
    envs += [f"{k}={v}" for k, v in sorted(os.environ.items())
             if k.startswith("MLX_") and not k.startswith("MLX_DDP_HARNESS") and k not in DISTRIBUTED_VARS]
    return envs


def start_on_cluster(run_dir: Path, world_size: int, backend: str, cluster: Cluster,
                     sync_dirs: list[Path]) -> Launch:
    """Start the ranks of ``run_dir``'s job on ``cluster``'s hosts: an agent per host (its run
    directory, ports, inputs), then mlx.launch over SSH with a hostfile of one entry per rank."""
    from harness.controller.remote import RemoteRanks

    remote = RemoteRanks(cluster, cluster.place(world_size))
    try:
        remote.start_agents(run_dir, sync_dirs)
        start = remote.lease_ports(world_size + 1)
        job = schema.read_json(run_dir / schema.JOB_FILE)
        for h, host_job in remote.ship(job, run_dir, sync_dirs).items():
            remote.links[h].put(run_dir / schema.JOB_FILE, json.dumps(host_job, indent=1, sort_keys=True).encode())
        remote.watch(run_dir, sync_dirs)
        calm = remote.ring_yield(backend)
        hosts = [{"ssh": cluster.hosts[h].ssh, "ips": cluster.hosts[h].ips} for h in remote.placement]
        path = write_hostfile(run_dir, world_size, backend, hosts)
        root = next(iter(remote.links.values())).root
        cmd = [
            *find_launcher(), "--hostfile", str(path), "--backend", backend,
            "--starting-port", str(start), "--nccl-port", str(start + world_size),
            *[a for e in _remote_envs(cluster, root) for a in ("--env", e)],
            "--", "sh", "-c", REMOTE_RANK_CMD, cluster.python, str(run_dir),
        ]
        env = _rank_env(run_dir)
        with open(run_dir / LAUNCHER_LOG, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=str(run_dir))
    except BaseException:
        remote.finish()
        raise
    return Launch(proc, run_dir, world_size, backend, None, HostProcesses(remote), ring_yield=calm)


def launcher_exits(run_dir: Path, remote: bool = False) -> dict[int, int | None]:
    """rank -> its exit status as mlx.launch logged it (negative: the signal that ended it; None:
    mlx.launch killed it, having seen another rank fail). Ranks still running are absent.
    ``remote``: the ranks ran on cluster hosts, whose statuses come through a shell (128 + N: signal N)."""
    out: dict[int, int | None] = {}
    try:
        text = (run_dir / LAUNCHER_LOG).read_text(errors="replace")
    except FileNotFoundError:
        return out
    for m in _EXIT.finditer(text):
        code = None if m.group(3) else int(m.group(2) or 0)
        if remote and code is not None and SIGNAL_STATUS < code < SIGNAL_STATUS + 65:
            code = SIGNAL_STATUS - code
        out[int(m.group(1))] = code
    return out
