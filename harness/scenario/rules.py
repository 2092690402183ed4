"""The rules a scenario must satisfy beyond key names and types: value ranges, which keys go
together, and what each run may refer to. Every violation is a ``ScenarioError`` naming the
file and the key."""

from __future__ import annotations

import os
from typing import Any

from harness.scenario.checks import check_names
from harness.scenario.names import (
    ARCHS,
    BACKENDS,
    CHECKPOINT_FILES,
    COLLECTIVE_MUTATIONS,
    COLLECTIVE_OPS,
    COMPILE_MODES,
    COMPILE_SCOPES,
    DAMAGE_ACTIONS,
    DATA_FORMATS,
    DATA_MUTATIONS,
    DEVICES,
    DTYPES,
    FAULT_ACTIONS,
    FAULT_PHASES,
    FINE_TUNES,
    KINDS,
    LR_SCHEDULES,
    MUTATION_EXPECTS,
    MUTATION_NAMES,
    OPTIMIZERS,
    ORDERS,
    PRECISIONS,
    REFERENCE_MUTATIONS,
    TEXT_ARCHS,
    TIMED_MUTATION_STEP,
    VLM_ARCHS,
)
from harness.scenario.spec import (
    DataSpec,
    FaultSpec,
    RunSpec,
    Scenario,
    TrainerSpec,
    TrainSpec,
    is_behaviour_table,
    require,
    writes_checkpoints,
)
from harness.scenario.trainers import STEP_FAULTS, kinds, trainer_info, trainers, with_kind


def _one_of(value: Any, allowed: tuple[str, ...], src: str, key: str) -> None:
    require(value in allowed, src, key, f"must be one of {allowed}, got {value!r}")


def _validate_data(d: DataSpec, src: str, where: str, vision: bool) -> None:
    _one_of(d.source, ("generated", "prose", "jsonl", "images"), src, f"{where}.source")
    require(not vision or d.source != "prose", src, f"{where}.source",
            "prose rows are text: not for a vision-language model")
    require(d.source != "prose" or d.format in ("auto", "text"), src, f"{where}.format",
            "prose rows are plain text: use format = 'text' (or 'auto')")
    if d.tokenizer.startswith("bpe:"):
        size = d.tokenizer[4:]
        require(size.isdigit() and 300 <= int(size) <= 65536, src, f"{where}.tokenizer",
                f"'bpe:N' needs a vocabulary size N between 300 and 65536, got {d.tokenizer!r}")
    require(vision or d.source != "images", src, f"{where}.source",
             f"'images' needs a vision-language [model].arch {VLM_ARCHS}")
    require(not vision or d.source != "generated", src, f"{where}.source",
             "a vision-language model trains on image rows: use 'images' (generated) or 'jsonl' (local image rows)")
    require(d.image_size >= 28, src, f"{where}.image_size", "must be at least 28 pixels")
    _one_of(d.format, DATA_FORMATS, src, f"{where}.format")
    _one_of(d.order, ORDERS, src, f"{where}.order")
    require(d.source != "jsonl" or d.path is not None, src, f"{where}.path", "required when source = 'jsonl'")
    for key in ("rows", "min_chars", "max_chars", "max_seq_len"):
        require(getattr(d, key) > 0, src, f"{where}.{key}", "must be positive")
    require(d.max_seq_len >= 2, src, f"{where}.max_seq_len", "must be at least 2")
    require(d.min_chars <= d.max_chars, src, f"{where}.min_chars", "must not exceed max_chars")
    require(d.eval_rows >= 0, src, f"{where}.eval_rows", "must be >= 0")
    require(not d.streaming or d.order == "ordered", src, f"{where}.order",
             "a streaming source is read in order: use order = 'ordered'")


def _validate_train(t: TrainSpec, d: DataSpec, src: str, where: str) -> None:
    require(t.steps > 0, src, f"{where}.steps", "must be positive")
    require(t.global_batch > 0, src, f"{where}.global_batch", "must be positive")
    require(t.grad_accum >= 1, src, f"{where}.grad_accum", "must be >= 1")
    require(t.global_batch % t.grad_accum == 0, src, f"{where}.grad_accum",
             f"global_batch {t.global_batch} does not divide into {t.grad_accum} micro-steps")
    require(t.learning_rate > 0, src, f"{where}.learning_rate", "must be positive")
    _one_of(t.optimizer, OPTIMIZERS, src, f"{where}.optimizer")
    _one_of(t.lr_schedule, LR_SCHEDULES, src, f"{where}.lr_schedule")
    require(0 <= t.warmup_steps <= t.steps, src, f"{where}.warmup_steps", "must be between 0 and steps")
    require(0 <= t.min_lr_ratio <= 1, src, f"{where}.min_lr_ratio", "must be between 0 and 1")
    require(t.max_grad_norm >= 0, src, f"{where}.max_grad_norm", "must be >= 0 (0: no clipping)")
    require(0 <= t.input_dropout < 1, src, f"{where}.input_dropout", "must be in [0, 1)")
    _one_of(t.compile, COMPILE_MODES, src, f"{where}.compile")
    _one_of(t.precision, PRECISIONS, src, f"{where}.precision")
    _one_of(t.device, DEVICES, src, f"{where}.device")
    _one_of(t.grad_norms, ("auto", "on", "off"), src, f"{where}.grad_norms")
    require(t.digest_every >= 0, src, f"{where}.digest_every", "must be >= 0")
    require(t.eval_every >= 0, src, f"{where}.eval_every", "must be >= 0")
    require(t.eval_batch >= 1, src, f"{where}.eval_batch", "must be >= 1")
    require(t.pad_to >= 1, src, f"{where}.pad_to", "must be >= 1 (1 pads to the longest row only)")
    require(t.checkpoint_every >= 0, src, f"{where}.checkpoint_every", "must be >= 0 (0: no periodic checkpoints)")
    require(t.keep_last >= 0, src, f"{where}.keep_last", "must be >= 0 (0: keep every checkpoint)")
    require(t.eval_every == 0 or d.eval_rows > 0 or d.eval_path is not None, src, f"{where}.eval_every",
             "needs eval rows: set [data].eval_rows or [data].eval_path")


def _validate_data_size(d: DataSpec, r: RunSpec, src: str, where: str) -> None:
    """Every rank needs rows of its own: data of fewer rows than the run has ranks is a mistake
    (rows would be repeated to fill the ranks). The rows of a local file are counted before launch
    (``harness.controller.input_checks``)."""
    if d.source != "jsonl":
        require(r.world_size <= d.rows, src, f"{where}.world_size",
                f"{r.world_size} ranks but [data].rows is {d.rows}: every rank needs rows of its own")
    if d.eval_rows and d.eval_path is None:
        require(r.world_size <= d.eval_rows, src, f"{where}.world_size",
                f"{r.world_size} ranks but [data].eval_rows is {d.eval_rows}: every rank needs eval rows of its "
                f"own")


def _validate_resume(s: Scenario, i: int, r: RunSpec, names: list[str], src: str) -> None:
    where = f"[[runs]][{i}]"
    steps = s.for_run(r).train.steps
    require(r.seed is None or r.seed >= 0, src, f"{where}.seed", "must be a non-negative integer")
    require(r.stop_after is None or 1 <= r.stop_after < steps, src, f"{where}.stop_after",
             f"must be between 1 and {steps - 1} (the run's steps - 1)")
    if r.resume_from in names:
        j = names.index(r.resume_from)
        require(j < i, src, f"{where}.resume_from", f"run {r.resume_from!r} must come before this run")
        require(writes_checkpoints(s, s.runs[j]), src, f"{where}.resume_from",
                 f"run {r.resume_from!r} writes no checkpoints (set checkpoint_every or stop_after)")
    for key in ("resume_step", "expect_resume_step"):
        value = getattr(r, key)
        require(value is None or r.resume_from is not None, src, f"{where}.{key}", "needs resume_from")
        require(value is None or 1 <= value < steps, src, f"{where}.{key}", f"must be between 1 and {steps - 1}")
    require(r.compare_to is None or (r.compare_to in names and r.compare_to != r.name), src,
             f"{where}.compare_to", f"{r.compare_to!r} is not another run's name ({', '.join(names)})")


def _validate_mutation(s: Scenario, i: int, r: RunSpec, src: str) -> None:
    """A mutation must be able to change something in this run, or catching it proves nothing."""
    if r.mutation is None:
        return
    key = f"[[runs]][{i}].mutation"
    _one_of(r.mutation, MUTATION_NAMES, src, key)
    require(r.world_size >= 2, src, key, "a DDP mutation needs world_size >= 2")
    require(s.kind == "parity" and s.checks.reference not in (None, r.name), src, key,
            "a mutation is caught by comparison with [checks].reference in a parity scenario")
    require(r.expect_error is None and r.resume_from is None, src, key,
            "a mutated run trains from scratch and must complete (no expect_error, no resume_from)")
    t = s.for_run(r).train
    require(r.mutation != "accum_twice" or t.grad_accum >= 2, src, key, "accum_twice needs grad_accum >= 2")
    micro = t.global_batch // t.grad_accum
    require(r.mutation != "drop_uneven" or micro % r.world_size != 0, src, key,
            f"drop_uneven needs micro-batches that do not divide evenly: {micro} rows over {r.world_size} ranks do")
    require(r.mutation not in MUTATION_EXPECTS or t.steps >= TIMED_MUTATION_STEP + 2, src, key,
            f"{r.mutation} acts at step {TIMED_MUTATION_STEP} and is judged against the steps after it: it needs "
            f"[train].steps >= {TIMED_MUTATION_STEP + 2}")


def _validate_fault(f: FaultSpec, where: str, src: str) -> None:
    _one_of(f.action, FAULT_ACTIONS, src, f"{where}.action")
    _one_of(f.phase, FAULT_PHASES, src, f"{where}.phase")
    _one_of(f.file, CHECKPOINT_FILES, src, f"{where}.file")
    require(f.action != "stop" or f.phase in ("step", "eval"), src, f"{where}.phase",
             "a stop is requested after a step or after eval: use phase 'step' or 'eval'")
    require(f.action != "compile_error" or f.phase == "step", src, f"{where}.phase",
             "compile_error happens in the step phase")
    require(f.action not in DAMAGE_ACTIONS or f.phase == "checkpoint", src, f"{where}.phase",
             f"{f.action} damages a checkpoint just written: use phase 'checkpoint'")
    require(f.action != "stale_view" or f.phase == "resume", src, f"{where}.phase",
             "stale_view happens while resuming: use phase 'resume'")
    require(f.action != "allocate" or f.mb > 0, src, f"{where}.mb", "allocate needs the MB to allocate (> 0)")
    require((f.action == "wrong_result") == (f.phase == "device_check"), src, f"{where}.action",
            "wrong_result is the device_check phase's one action, and that phase's only one")
    require((f.action == "delay") == (f.phase == "record"), src, f"{where}.action",
            "delay is the record phase's one action, and that phase's only one")


def _validate_trainer_spec(t: TrainerSpec, src: str, at: str) -> None:
    """One trainer's own keys: a known kind and what it may take."""
    _one_of(t.kind, kinds(), src, f"{at}.kind")
    info = trainer_info(t.kind)
    _one_of(t.fine_tune, FINE_TUNES, src, f"{at}.fine_tune")
    takes_path = info.script or info.command
    known = trainers()
    runners = " or ".join(repr(k) for k, i in known.items() if i.script or i.command)  # they run a user's code
    scripts = " or ".join(repr(k) for k, i in known.items() if i.script)
    require(takes_path or t.path is None, src, f"{at}.path", f"only a {runners} trainer takes a path")
    require(takes_path or not t.args, src, f"{at}.args", f"only a {runners} trainer takes args")
    require(info.script or t.saves is None, src, f"{at}.saves",
            f"only a {scripts} trainer declares its saves (the others' are known)")
    for op in t.collectives:
        _one_of(op, COLLECTIVE_OPS, src, f"{at}.collectives")
    require(info.lora or t.fine_tune == "full", src, f"{at}.fine_tune",
            f"LoRA is an option of the {', '.join(map(repr, with_kind('lora')))} trainers")
    require(t.lora_rank > 0 and t.lora_scale > 0, src, f"{at}.lora_rank", "lora_rank and lora_scale must be positive")
    if info.script:
        require(t.path is not None and t.path.endswith(".py"), src, f"{at}.path",
                f"a {info.kind!r} trainer needs the path of a Python training script")
        require(os.path.isfile(t.path), src, f"{at}.path", f"not a file: {t.path}")
    if info.command:
        require(t.path is not None, src, f"{at}.path", f"a {info.kind!r} trainer needs the path of an executable")
        require(os.path.isfile(t.path) and os.access(t.path, os.X_OK), src, f"{at}.path",
                f"not an executable file: {t.path}")


def _validate_run_trainer(s: Scenario, i: int, r: RunSpec, src: str) -> None:
    """What one run's trainer can be given (its record): settings it has no way to honour are refused."""
    where = f"[[runs]][{i}]"
    eff = s.for_run(r)
    info = trainer_info(eff.trainer.kind)
    name = f"the {info.kind} trainer"
    if info.models == "vision":
        require(eff.model.vision, src, "[model].arch", f"{name} trains vision-language models ({', '.join(VLM_ARCHS)})")
    elif info.models == "text":
        require(not eff.model.vision, src, "[model].arch", f"{name} trains text models ({', '.join(TEXT_ARCHS)})")
    require(info.resumes or (r.resume_from is None and r.stop_after is None), src, f"{where}.resume_from",
            f"resume is not supported for {name} yet ({', '.join(with_kind('resumes'))} can resume)")
    require(not eff.data.streaming or info.streams, src, f"{where}.data.streaming",
            f"{name} takes an in-memory dataset ({', '.join(with_kind('streams'))} can read a stream)")
    if info.external:
        if r.mutation in DATA_MUTATIONS:
            require(info.feeds_rows is not None, src, f"{where}.mutation", f"{r.mutation} needs a trainer whose batch "
                    f"iterator the harness hands over; {name} reads its rows itself")
        else:
            require(r.mutation is None or (r.mutation in COLLECTIVE_MUTATIONS and not info.command), src,
                    f"{where}.mutation", f"{name} takes a collective mutation ({', '.join(COLLECTIVE_MUTATIONS)}); "
                    f"an executable none: the reference trainer's own bugs are planted in it alone")
        require(eff.train.input_dropout == 0, src, f"{where}.train.input_dropout", f"{name} has no input dropout")
    else:
        require(r.mutation in (None, *REFERENCE_MUTATIONS) or r.mutation not in MUTATION_NAMES, src,
                f"{where}.mutation",
                f"{name}'s all-reduce is its own: its bugs are {', '.join(REFERENCE_MUTATIONS)}")
    if info.rules is not None:
        info.rules(eff, r, src, where)
    for j, f in enumerate(eff.faults):
        require(not info.command or f.phase != "device_check", src, f"[[faults]][{j}].phase",
                f"{name} runs its own process on its own device: the harness runs no device check for it")
        if info.external and f.phase != "device_check":  # the rank runtime checks every other trainer's device
            require(f.phase == "step" and f.action in STEP_FAULTS, src, f"[[faults]][{j}]",
                    f"{name} can be faulted in the 'step' phase with {', '.join(STEP_FAULTS)}")


def _validate_trainer(s: Scenario, src: str) -> None:
    """The trainer under test (one per scenario; a throughput scenario may time several, one per
    run): an external trainer takes the scenario's model, data and settings through its own entry
    points."""
    _validate_trainer_spec(s.trainer, src, "[trainer]")
    for i, r in enumerate(s.runs):
        t = s.for_run(r).trainer
        if r.trainer:
            require(s.kind == "throughput", src, f"[[runs]][{i}].trainer",
                    "only a throughput scenario times several trainers; a parity scenario tests one")
            _validate_trainer_spec(t, src, f"[[runs]][{i}].trainer")
        _validate_run_trainer(s, i, r, src)


def _validate_head(s: Scenario, src: str) -> None:
    """``[scenario]``: its name, seed, description, sets and kind."""
    require(isinstance(s.name, str) and s.name != "", src, "[scenario].name", "must be a non-empty string")
    require(isinstance(s.seed, int) and not isinstance(s.seed, bool) and s.seed >= 0, src,
            "[scenario].seed", f"must be a non-negative integer, got {s.seed!r}")
    require(isinstance(s.description, str), src, "[scenario].description", "must be a string")
    require(isinstance(s.default, bool), src, "[scenario].default", "must be true or false")
    require(isinstance(s.full, bool), src, "[scenario].full", "must be true or false")
    require(s.full or not s.default, src, "[scenario].full", "a scenario of the default set is in the full set too")
    require(s.kind in KINDS, src, "[scenario].kind", f"must be one of {', '.join(KINDS)}, got {s.kind!r}")


def validate(s: Scenario, src: str) -> None:
    """Check every rule; the first violation raises ``ScenarioError``."""
    _validate_head(s, src)
    _validate_trainer(s, src)
    _one_of(s.model.arch, ARCHS, src, "[model].arch")
    if s.model.dtype is not None:
        _one_of(s.model.dtype, DTYPES, src, "[model].dtype")
    vision = s.model.vision
    _validate_data(s.data, src, "[data]", vision)
    _validate_train(s.train, s.data, src, "[train]")
    require(len(s.runs) > 0, src, "[[runs]]", "at least one run is required")
    names = [r.name for r in s.runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    require(not twice, src, "[[runs]].name", f"run names must be unique: {', '.join(map(repr, twice))} twice")
    for i, r in enumerate(s.runs):
        where = f"[[runs]][{i}]"
        key = f"{where}.world_size"
        require(r.world_size >= 1, src, key, f"must be >= 1, got {r.world_size}")
        require(r.backend is None or r.backend in BACKENDS, src, f"{where}.backend", f"must be one of {BACKENDS}")
        require(r.expect_compile_scope is None or r.expect_compile_scope in COMPILE_SCOPES, src,
                 f"{where}.expect_compile_scope", f"must be one of {COMPILE_SCOPES}")
        eff = s.for_run(r)
        _validate_data(eff.data, src, f"{where}.data", vision)
        _validate_train(eff.train, eff.data, src, f"{where}.train")
        micro = eff.train.global_batch // eff.train.grad_accum
        require(r.world_size <= micro, src, key,
                 f"{r.world_size} exceeds the {micro} rows of each micro-step "
                 f"([train].global_batch / grad_accum): a rank would get no rows")
        _validate_data_size(eff.data, r, src, where)
        _validate_resume(s, i, r, names, src)
        _validate_mutation(s, i, r, src)
    ref = s.checks.reference
    require(ref is None or ref in names, src, "[checks].reference",
             f"{ref!r} is not a run name ({', '.join(names)})")
    if s.kind == "parity" and ref is not None:
        want = s.for_run(s.run(ref)).train.global_batch
        for i, r in enumerate(s.runs):
            got = s.for_run(r).train.global_batch
            require(got == want, src, f"[[runs]][{i}].train.global_batch",
                    f"{got} differs from the reference run's {want}: parity needs one global batch "
                    f"(a throughput comparison at other batches is [scenario].kind = \"throughput\")")
    require(s.kind == "parity" or ref is not None, src, "[checks].reference",
            "a throughput scenario needs the run its speed is measured against")
    c = s.checks
    for key in ("loss_tolerance", "param_tolerance", "eval_tolerance", "data_share_slack", "resume_tolerance"):
        require(getattr(c, key) is None or getattr(c, key) >= 0, src, f"[checks].{key}", "must be >= 0")
    for key in ("floor_ratio", "rounding_ulps", "mutation_margin"):
        require(getattr(c, key) > 0, src, f"[checks].{key}", "must be positive")
    require(c.probe_every >= 0, src, "[checks].probe_every", "must be >= 0 (0: no step-local probes)")
    keys = ["loss_tolerance", "param_tolerance", "eval_tolerance"] if s.kind == "parity" and ref else []
    if any(r.compare_to for r in s.runs):
        keys.append("resume_tolerance")
    missing = [k for k in keys if getattr(c, k) is None]
    require(c.noise_floor or not missing, src, "[checks].noise_floor",
            f"without noise-floor runs the comparisons need absolute limits: set {', '.join(missing)}")
    for key, reason in s.checks.expected_failures.items():
        if is_behaviour_table(reason):
            _validate_behaviour(s, key, reason, src)
            continue
        require(key in check_names(), src, f"[checks].expected_failures.{key}",
                 f"unknown check (known: {', '.join(check_names())}), or a behaviour table without checks")
        per_run = reason if isinstance(reason, dict) else {"": reason}
        for run, why in per_run.items():
            where = f"[checks].expected_failures.{key}" + (f".{run}" if run else "")
            require(not run or run in {r.name for r in s.runs}, src, where, f"no run named {run!r}")
            require(isinstance(why, str) and why.strip() != "", src, where,
                    "give the reason the check is expected to fail, as a string (or a table of run name -> reason)")
    require(s.limits.wall_s > 0 and s.limits.no_progress_s > 0, src, "[limits]",
             "limits must be positive")
    for key in ("hard_rss_mb", "hard_mlx_mb", "memory_budget_mb"):
        require(getattr(s.limits, key) is None or getattr(s.limits, key) > 0, src, f"[limits].{key}",
                "must be positive")
    require(s.limits.hard_memory_factor >= 1, src, "[limits].hard_memory_factor",
            "must be >= 1 (a hard limit below the ceiling would stop runs the ceiling passes)")
    require(s.limits.hard_memory_slack_mb >= 0, src, "[limits].hard_memory_slack_mb", "must be >= 0")
    require(0 < s.limits.machine_memory_fraction <= 1, src, "[limits].machine_memory_fraction",
            "must be in (0, 1]")
    for i, f in enumerate(s.faults):
        _validate_fault(f, f"[[faults]][{i}]", src)
        require(f.step >= 1, src, f"[[faults]][{i}].step", "must be >= 1")
        require(f.rank >= 0, src, f"[[faults]][{i}].rank", "must be >= 0")
        unknown = [n for n in f.runs if n not in names]
        require(not unknown, src, f"[[faults]][{i}].runs", f"unknown run names {unknown}")
        small = [r.name for r in s.runs if r.name in f.runs and f.rank >= r.world_size]
        require(not small, src, f"[[faults]][{i}].rank",
                f"rank {f.rank} is not a rank of run{'s' if len(small) > 1 else ''} {', '.join(small)} "
                f"(world size {', '.join(str(s.run(n).world_size) for n in small)})")
        require(bool(f.runs) or any(f.rank < r.world_size for r in s.runs), src, f"[[faults]][{i}].rank",
                f"rank {f.rank} is not a rank of any run (the largest world size is "
                f"{max(r.world_size for r in s.runs)})")


def _validate_behaviour(s: Scenario, key: str, table: dict[str, Any], src: str) -> None:
    """A behaviour of ``[checks.expected_failures]`` (``harness.judge.behaviours``)."""
    where = f"[checks].expected_failures.{key}"
    unknown = sorted(set(table) - {"reason", "runs", "checks"})
    require(not unknown, src, f"{where}.{unknown[0] if unknown else ''}", "unknown key (known: reason, runs, checks)")
    reason = table.get("reason")
    require(isinstance(reason, str) and reason.strip() != "", src, f"{where}.reason",
            "give the reason the behaviour is expected, as a string")
    checks = table["checks"]
    require(isinstance(checks, dict) and len(checks) > 0, src, f"{where}.checks",
            "a table of check name -> the deviation it measured (its Value), e.g. { loss_parity = 9.5e-3 }")
    for name, delta in checks.items():
        require(name in check_names(), src, f"{where}.checks.{name}",
                f"unknown check (known: {', '.join(check_names())})")
        require(isinstance(delta, int | float) and not isinstance(delta, bool) and delta > 0, src,
                f"{where}.checks.{name}", "must be the positive deviation the check measured")
    runs = table.get("runs")
    names = {r.name for r in s.runs}
    require(runs is None or (isinstance(runs, list) and all(r in names for r in runs)), src, f"{where}.runs",
            f"a list of run names (runs: {', '.join(sorted(names))})")
