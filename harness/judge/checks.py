"""Checks: each turns collected runs into a pass/fail with its measured value and its limit.

Every check here can fail: it compares figures the ranks measured against a limit from the
scenario, and a run that is missing its figures fails the check rather than skipping it. One
that has nothing to compare on a run (the ranks of a one-rank run) says so: n/a, never a pass.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from harness.controller.outcome import RunOutcome
from harness.dtypes import FLOAT_BITS, UNIT_ROUNDOFF, coarsest
from harness.scenario import RunSpec, TrainerSpec
from harness.scenario.checks import STEP_LOCAL, CheckName, families
from harness.scenario.trainers import TrainerInfo


def median_after_first(values: list[float]) -> float | None:
    """Median of a per-step series without step 1 (graph building, first allocations)."""
    tail = values[1:] if len(values) > 1 else values
    return statistics.median(tail) if tail else None


def fastest_after_first(values: list[float]) -> float | None:
    """The largest value of a per-step series without its first step."""
    tail = values[1:] if len(values) > 1 else values
    return max(tail) if tail else None


@dataclass
class Check:
    """One judgement. ``passed`` says whether it counts as a pass; for a check the scenario
    expects to fail (``xfail``: the reason), a measured failure counts as a pass ("xfail") and a
    measured pass does not ("XPASS"). On a run with an injected bug, a failure is the check
    catching it (``caught``). A check that cannot be measured on this run (``applicable`` false,
    for example step-local parity on a run that executed no probe step) is reported as "n/a",
    never as a pass; one without the power to see a defect, from a start that was compared, is
    "INCONCLUSIVE" (``inconclusive``: it counts as neither). ``floor`` is the measured noise floor a
    limit was derived from, and ``derivation`` says how the limit was derived. An expected failure is judged with its
    behaviour (``harness.judge.behaviours``)."""

    name: str
    run: str
    passed: bool
    value: float | int | None
    limit: float | int | None
    detail: str = ""
    xfail: str | None = None
    floor: float | None = None
    derivation: str = ""
    caught: bool = False
    applicable: bool = True
    expected_state: str | None = None  # of an expected failure: "shown", "gone" or "inconclusive"
    power: float | None = None  # the smallest deviation it could detect, in its value's units
    precision: str | None = None  # what the compared runs computed at (dtype, TF32)
    no_power: bool = False  # could not have seen a defect (``harness.judge.power``): failed, or ``inconclusive``
    inconclusive: bool = False  # without power, from a start that was compared: neither pass nor fail
    noise: float | None = None  # a trajectory's floor runs' own largest deviation (``floor`` adds the absolute floor)
    defect: str | None = None  # the known DDP defect a failed step-local check matches (``harness.judge.defects``)

    def __post_init__(self) -> None:
        self.name = str(self.name)  # a CheckName member as the plain string result.json holds

    @property
    def result(self) -> str:
        if not self.applicable:
            return "n/a"
        if self.caught:
            return "caught"
        if self.inconclusive:
            return "INCONCLUSIVE"
        if self.xfail is None:
            return "pass" if self.passed else "FAIL"
        return {"gone": "XPASS", "inconclusive": "inconclusive"}.get(self.expected_state or "", "xfail")

    @property
    def ratio(self) -> float | None:
        """value / floor, for a check judged against a measured floor."""
        if self.floor is None or not isinstance(self.value, int | float):
            return None
        return self.value / self.floor if self.floor > 0 else (0.0 if self.value == 0 else math.inf)

    @property
    def margin(self) -> float:
        """How clearly a failed check failed: value / limit, or infinity for an exact criterion
        (a count or digest that must match, or a limit of 0)."""
        v, lim = self.value, self.limit
        if isinstance(v, int | float) and isinstance(lim, int | float) and lim > 0 and v > lim:
            return v / lim
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        """The check as result.json holds it (an infinite figure, e.g. the ratio to a zero floor, as null)."""
        d = {**asdict(self), "result": self.result, "ratio": self.ratio,
             "margin": self.margin if not self.passed or self.caught else None}
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


def computed_at(result: dict[str, Any], probes: bool = False) -> dict[str, Any]:
    """The precision a rank's ``result`` computed at: its training's, or (``probes``) its step-local
    probes', which compute in float32 where the training's dtype is narrower
    (``harness.rank.step_probe.in_float32``) unless the trainer cast down inside its step: each
    probe says the dtype its loss and gradient came out in, and the coarsest is what they computed at."""
    prec = result.get("precision") or {}
    records = result.get("probes") or []
    seen = coarsest(r.get("dtype") for r in records) if probes and records else None
    if seen is None or seen == prec.get("dtype"):
        return prec
    if seen == "float32" and prec.get("probe"):
        return prec["probe"]
    u = UNIT_ROUNDOFF[seen]  # coarser than its training: a reduction in a narrower dtype
    return {"dtype": seen, "u_dtype": u, "u_in": max(u, float(prec.get("u_matmul") or 0.0)), "label": seen}


def precision_label(*runs: RunOutcome, probes: bool = False) -> str:
    """What the ranks of ``runs`` computed at (``harness.rank.precision``; ``probes``: their
    step-local probes), e.g. "float32" or "float32, TF32 matmuls"; several labels joined when the
    runs differ."""
    labels = dict.fromkeys(str(computed_at(o.result or {}, probes).get("label", "unknown"))
                           for run in runs for o in run.ranks)
    label = " / ".join(labels)
    if probes and label != (trained := precision_label(*runs)):
        label += f" (probes; training {trained})"
    return label


def with_power(checks: list[Check], run: RunOutcome, base: RunOutcome) -> list[Check]:
    """Each check that carries power (its family's ``powered``: the step-local and trajectory
    checks) carries it (the smallest deviation it could detect: its limit, in its value's units)
    and the precision the compared runs used."""
    label, probed = precision_label(run, base), precision_label(run, base, probes=True)
    powered = {n for f in families() for n in f.powered}
    for c in checks:
        if c.name in powered:
            c.precision = probed if c.name in STEP_LOCAL else label
            c.power = float(c.limit) if isinstance(c.limit, int | float) else None
    return checks



LR_ULPS = 4


def lr_schedule(run: RunOutcome, ref: RunOutcome) -> Check:
    """The optimizer's learning rate at every step equals the reference's: at one global batch
    the schedule is a function of the step alone, which both runs evaluate in float32 (limit: 4
    float32 ulps, relative). A learning rate scaled by the world size fails here at once, where
    the trajectory would show it only as a drift among the noise."""
    a, b = run.result().get("learning_rates") or [], ref.result().get("learning_rates") or []
    b = b[: len(a)]
    limit = LR_ULPS * 2.0**-24
    if not a and not b:
        return Check(CheckName.lr_schedule, run.name, True, None, None, "not applicable: neither run reported its "
                     "learning rates (a script: run.step(..., lr=...))", applicable=False)
    if not a or len(a) != len(b):
        return Check(CheckName.lr_schedule, run.name, False, None, limit,
                     f"{len(a)} vs {len(b)} learning rates recorded")
    rel = [abs(x - y) / abs(y) if y else abs(x) for x, y in zip(a, b, strict=True)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    where = f"worst at step {worst + 1} ({a[worst]:.6g} vs {b[worst]:.6g})"
    detail = f"vs {ref.name}: {len(a)} steps; " + ("identical at every step" if rel[worst] == 0 else where)
    passed = rel[worst] <= limit
    scaled = None if passed else lr_scaled(a, b, run.world_size, limit)
    if scaled:
        detail += f"; matches: {scaled}"
    return Check(CheckName.lr_schedule, run.name, passed, rel[worst], limit, detail,
                 derivation=f"relative, {LR_ULPS} float32 ulps: the same schedule evaluated at the same step",
                 defect="lr_times_world" if scaled and "x world size" in scaled else None)


def lr_scaled(a: list[float], b: list[float], world_size: int, limit: float) -> str | None:
    """What a learning rate ``a`` that is the reference's ``b`` times one factor at every step is
    (None where the factor varies): "learning rate x world size N", "learning rate / world size N"
    or "learning rate x F at every step"."""
    ratios = [x / y for x, y in zip(a, b, strict=True) if y]
    if not ratios or max(ratios) - min(ratios) > 2 * limit * max(abs(r) for r in ratios):
        return None
    f = ratios[0]
    for name, want in ((f"learning rate x world size {world_size}", world_size),
                       (f"learning rate / world size {world_size}", 1 / world_size)):
        if world_size > 1 and abs(f - want) <= 2 * limit * want:
            return name
    return f"learning rate x {f:.4g} at every step"


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


ONE_RANK = "not applicable: one rank, no other to compare it with"


def replica_consistency(run: RunOutcome) -> Check:
    """Every rank's parameter digest is identical at every step that recorded one (n/a at one rank)."""
    if run.world_size == 1:
        return Check(CheckName.replica_consistency, run.name, True, None, None, ONE_RANK, applicable=False)
    per_rank = [o.result["digests"] if o.result else {} for o in run.ranks]
    steps = sorted(set().union(*per_rank), key=int)
    bad = [s for s in steps if len({d.get(s) for d in per_rank}) != 1]
    if not steps:
        return Check(CheckName.replica_consistency, run.name, False, None, 0, "no digests recorded")
    detail = f"{ranks(run.world_size)} at steps {', '.join(steps)}"
    if bad:
        detail += f"; differ at steps {', '.join(bad)}"
    return Check(CheckName.replica_consistency, run.name, not bad, len(bad), 0, detail)


def token_accounting(run: RunOutcome, ref: RunOutcome | None) -> Check:
    """Ranks' local tokens add up to the global count, which equals the reference's over the
    same steps. Tokens a resumed run restored at another world size belong to no current rank."""
    results = [o.result for o in run.ranks if o.result]
    if len(results) < run.world_size:
        return Check(CheckName.token_accounting, run.name, False, None, None, "a rank wrote no result")
    local = sum(r["tokens_local"] for r in results) + int(results[0].get("tokens_local_unattributed", 0))
    glob = {r["tokens_global"] for r in results}
    ok = len(glob) == 1 and local == next(iter(glob))
    detail = f"sum of rank tokens {local}, global {listed(sorted(glob))}"
    if ref is not None and ref is not run:
        steps, per_step = results[0]["steps"], ref.result()["tokens_global_per_step"]
        early = steps is not None and steps < len(per_step)  # a run stopped early: the reference's first steps
        ref_tokens = sum(per_step[:steps]) if early else int(ref.result().get("tokens_global", -1))
        ok = ok and ref_tokens in glob
        detail += f", {ref.name} {ref_tokens}"
    return Check(CheckName.token_accounting, run.name, ok, local, next(iter(glob)) if len(glob) == 1 else None, detail)


AGREED_FIELDS = ("steps", "losses", "stop", "evals", "compile", "tokens_global")


def ranks_agree(run: RunOutcome) -> Check:
    """Every rank reports the same steps, losses, stop, eval metrics (bitwise) and compile state;
    figures a trainer reports on rank 0 only (sent to the others after training) are not compared
    (n/a at one rank)."""
    if run.world_size == 1:
        return Check(CheckName.ranks_agree, run.name, True, None, None, ONE_RANK, applicable=False)
    results = [o.result or {} for o in run.ranks]
    sent = (results[0].get("from_rank0") or {}) if results else {}
    fields = [k for k in AGREED_FIELDS if k not in sent.get("fields", ())]
    differ = []
    for key in fields:
        values = [r.get(key) for r in results]
        if key == "evals":  # per-rank figures (local tokens and rows) legitimately differ
            values = [[{k: e[k] for k in ("step", "loss", "tokens")} for e in v or []] for v in values]
        if any(v != values[0] for v in values[1:]):
            differ.append(key)
    detail = f"{ranks(run.world_size)}; " + (f"differ in {', '.join(differ)}" if differ else
                                            f"same {', '.join(fields)}")
    if sent and run.world_size > 1:
        detail += f"; {', '.join(sent['fields'])} are rank 0's ({sent['why']})"
    return Check(CheckName.ranks_agree, run.name, not differ, len(differ), 0, detail)


def listed(values: Any) -> str:
    """``[1, 5, 10]`` as ``1, 5, 10`` (a detail holds no Python reprs)."""
    return ", ".join(map(str, values)) or "none"


def counted(counts: dict[str, int]) -> str:
    """``{'log_lines': 2, 'saves': 1}`` as ``log lines 2, saves 1``."""
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(counts.items()))


def rank0_side_effects(run: RunOutcome, trainer: TrainerSpec, info: TrainerInfo) -> Check:
    """Callbacks, log lines and saves happened on rank 0 only; and a save did happen there where
    the trainer promises one (``harness.scenario.trainers.TrainerInfo.saves``) or the script declares one
    (``[trainer] saves = true``). An external trainer reports its own saves only (the callbacks
    are the harness's). A rank that reports no side-effect counts fails the check."""
    counts = [(o.result or {}).get("side_effects") for o in run.ranks]
    unreported = [str(o.rank) for o, c in zip(run.ranks, counts, strict=True)
                  if not isinstance(c, dict) or not all(isinstance(v, int) for v in c.values())]
    if unreported:
        return Check(CheckName.rank0_side_effects, run.name, False, None, 0,
                     f"rank {', '.join(unreported)} reported no side-effect counts (side_effects)")
    main = counts[0]
    rest = [(o.rank, c) for o, c in zip(run.ranks[1:], counts[1:], strict=True) if any(c.values())]
    others = sum(sum(c.values()) for _, c in rest)
    promise = info.saves
    declared = {None: "does not declare [trainer] saves", True: "declares [trainer] saves = true",
                False: "declares [trainer] saves = false"}[trainer.saves]
    demanded = promise is not None or trainer.saves is True
    ok = others == 0 and (main.get("saves", 0) >= 1 or not demanded) and main.get("callbacks", 1) > 0
    detail = f"rank 0: {counted(main)}; other ranks: " + (
        "; ".join(f"rank {r}: {counted(c)}" for r, c in rest) if rest else "none")
    detail += f"; a save on rank 0 {'' if demanded else 'not '}demanded: {promise or f'the script {declared}'}"
    return Check(CheckName.rank0_side_effects, run.name, ok, others, 0, detail)


RNG_REMEDY = {"numpy": "numpy's (np.random.*): draw from np.random.default_rng(seed) instead",
              "mlx": "MLX's (mx.random.* without key=): pass key= from mx.random.key(seed), split per use"}


def global_rng_untouched(run: RunOutcome) -> Check:
    """No rank's training changed numpy's or MLX's global RNG state (all randomness is local and
    seeded); a failure names the RNG each rank changed and what to use instead."""
    changed = {o.rank: (o.result or {}).get("global_rng_changed") or ["numpy or MLX"] for o in run.ranks
               if (o.result or {}).get("global_rng_untouched") is not True}
    if not changed:
        return Check(CheckName.global_rng_untouched, run.name, True, 0, 0,
                     "numpy and MLX global RNG unchanged on every rank")
    names = sorted({n for rngs in changed.values() for n in rngs})
    per_rank = "; ".join(f"rank {r}: {', '.join(rngs)}" for r, rngs in changed.items())
    detail = f"training changed the global RNG: {per_rank}; " + "; ".join(RNG_REMEDY.get(n, n) for n in names)
    return Check(CheckName.global_rng_untouched, run.name, False, len(changed), 0, detail)


def dtype_held(run: RunOutcome) -> Check:
    """Every parameter ends training in the dtype it started in, on every rank: a bfloat16 model
    promoted to float32 by its own update (a float32 factor multiplied into its gradients, say)
    trains at twice the memory and on a GPU several times slower than the run it claims to be."""
    records = [(o.rank, (o.result or {}).get("dtype_changes")) for o in run.ranks]
    known = [(r, c) for r, c in records if c is not None]
    if len(known) < len(records):
        return Check(CheckName.dtype_held, run.name, False, None, 0,
                     f"cannot decide: rank {listed(r for r, c in records if c is None)} recorded no dtypes of the "
                     f"parameters training started from")
    unmatched = [r for r, c in known if not c["compared"]]
    if unmatched:
        return Check(CheckName.dtype_held, run.name, False, None, 0,
                     f"cannot decide: no final parameter has the path of one training started from (rank "
                     f"{listed(unmatched)})")
    changed = [(r, c) for r, c in known if c["changed_count"]]
    if not changed:
        compared = max(c["compared"] for _, c in known)
        cast = max(c.get("setup_casts", 0) for _, c in known)
        setup = f"; {cast} of them cast by the trainer's own setup before its first step, their start" if cast else ""
        return Check(CheckName.dtype_held, run.name, True, 0, 0,
                     f"{compared} parameters each in its start dtype at the end, on {ranks(run.world_size)}{setup}")
    r, c = changed[0]
    shown = ", ".join(f"{k} {a} -> {b}" for k, a, b in c["changed"])
    more = f" and {c['changed_count'] - len(c['changed'])} more" if c["changed_count"] > len(c["changed"]) else ""
    also = f"; {len(changed)} ranks in all" if len(changed) > 1 else ""
    detail = (f"{c['changed_count']} of {c['compared']} parameters ended training in another dtype than they started "
              f"in (rank {r}{also}): {shown}{more}; {DTYPE_REMEDY[widened(c['changed'])]}")
    return Check(CheckName.dtype_held, run.name, False, c["changed_count"], 0, detail)


DTYPE_REMEDY = {
    True: "an update in a wider dtype than its weight widens the weight (a float32 factor multiplied into a bfloat16 "
          "gradient, say): cast each gradient back to its parameter's dtype",
    False: "a weight narrowed or changed its kind after training started: cast the model before saying where "
           "training starts (run.split or run.start)"}


def widened(changed: list[list[str]]) -> bool:
    """Whether every change shown is to a floating dtype of more bits (what promotion in an update does)."""
    return all(a in FLOAT_BITS and b in FLOAT_BITS and FLOAT_BITS[b] > FLOAT_BITS[a] for _, a, b in changed)


def data_share(run: RunOutcome, ref: RunOutcome, slack: float, micro_rows: int | None = None) -> Check:
    """Each rank holds about its share of the data bytes one process holds (seed 003's criterion).

    The share is 1/N, or ceil(m/N)/m when the m rows of a micro-batch do not divide by N.
    """
    held = [int(o.result["data"]["bytes_held"] or -1) if o.result else -1 for o in run.ranks]
    whole = int(ref.result()["data"]["bytes_held"] or 0)
    m = micro_rows or run.world_size
    limit = whole * (1 + slack) * -(-m // run.world_size) / m
    worst = max(held)
    return Check(CheckName.data_share_bytes, run.name, 0 <= worst <= limit, worst, round(limit),
                 f"per rank: {', '.join(map(str, held))}; {ref.name} holds {whole}")


def expected_failure(run: RunOutcome, expect: str, every_rank: bool = False) -> Check:
    """A run that must fail: it did, with ``expect`` in its message (``every_rank``: in every
    rank's own error), and left no process behind."""
    if run.ok:
        return Check(CheckName.expected_failure, run.name, False, None, None,
                     f"run passed; expected an error with {expect!r}")
    failure = run.failure or ""
    ok = expect in failure and not run.watch.survivors
    first = failure.splitlines()[0] if failure else ""
    detail = f"expected {expect!r}; got: {first}"
    if every_rank:
        hits = sum(expect in str((o.result or {}).get("error", "")) for o in run.ranks)
        ok = ok and hits == run.world_size
        detail += f"; on {hits} of {run.world_size} ranks"
    return Check(CheckName.expected_failure, run.name, ok, None, None, detail)


def expectations(run: RunOutcome, spec: RunSpec) -> list[Check]:
    """What the scenario says every rank of this run must report (compile scope, stop step)."""
    out = []
    results = [o.result or {} for o in run.ranks]
    if spec.expect_compile_scope is not None:
        scopes = [r.get("compile", {}).get("scope") for r in results]
        reasons = {r.get("compile", {}).get("fallback_reason") for r in results}
        ok = all(sc == spec.expect_compile_scope for sc in scopes) and len(reasons) == 1
        detail = f"per rank: {', '.join(map(str, scopes))}; fallback reason: {sorted(map(str, reasons))[0]}"
        out.append(Check(CheckName.compile_scope, run.name, ok, scopes[0], spec.expect_compile_scope, detail))
    if spec.expect_stop_step is not None:
        stops = [(r.get("stop") or {}).get("step") for r in results]
        ok = all(st == spec.expect_stop_step for st in stops)
        who = (results[0].get("stop") or {}).get("requested_by")
        out.append(Check(CheckName.stop_step, run.name, ok, stops[0], spec.expect_stop_step,
                         f"per rank: {', '.join(map(str, stops))}; requested by ranks {who}"))
    return out
