"""The values a scenario's keys may take, and every built-in check's name (``CheckName``): the
lowest layer of the tree, importing nothing of the harness."""

from __future__ import annotations

from enum import StrEnum, auto

TEXT_ARCHS = ("qwen3", "llama")
VLM_ARCHS = ("qwen2_vl", "paligemma")
ARCHS = TEXT_ARCHS + VLM_ARCHS
DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("ring", "nccl", "mpi", "jaccl")
# MLX's collectives (``mx.distributed``): which a backend implements is probed (``harness.controller.backend_ops``)
COLLECTIVE_OPS = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv")
FAULT_ACTIONS = ("raise", "exit", "sigkill", "segfault", "hang", "exit0", "stop", "compile_error",
                 "truncate", "corrupt", "delete", "stale_view", "allocate", "wrong_result", "delay")
FAULT_PHASES = ("fetch", "step", "update", "eval", "checkpoint", "resume", "save", "device_check",
                "record")
DAMAGE_ACTIONS = ("truncate", "corrupt", "delete")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors", "trainer.json", "manifest.json")
DATA_FORMATS = ("auto", "text", "prompt_completion", "chat")
ORDERS = ("ordered", "shuffled", "length_sorted")
COMPILE_MODES = ("off", "strict", "best_effort")
PRECISIONS = ("auto", "full", "device")
DEVICES = ("auto", "gpu", "cpu")
KINDS = ("parity", "throughput")
COMPILE_SCOPES = ("none", "local-grad", "full-step", "fallback-eager")
LR_SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("adamw", "sgd")
FINE_TUNES = ("full", "lora")
MUTATIONS_DESCRIBED = {  # the DDP bugs a run can inject into the reference trainer (``[[runs]] mutation``)
    "mean_of_means": "loss and gradients normalised per rank (by its own token count), then averaged over ranks",
    "sum_not_average": "gradients all-summed across ranks but not divided by the world size",
    "unreduced_norms": "the normalisation weights left out of the gradient all-reduce (each rank keeps its own)",
    "same_shard": "every rank reads rank 0's shard (the sampler was not given the rank)",
    "drop_uneven": "the last rank drops its last micro-batch of a step when the split is uneven (a drop_last loop)",
    "rank_seeds": "each rank initialises its model from its own seed (seed + rank)",
    "lr_times_world": "the learning rate scaled by the world size",
    "accum_twice": "accumulated gradients divided by grad_accum although the token weighting already normalises them",
    "stale_gradient": "the previous step's gradient is all-reduced (zeros at the first step)",
}
COLLECTIVE_MUTATIONS = {  # planted in any Python trainer's gradient all-reduce (harness.rank.collective_mutations)
    "allreduce_skipped": "the gradient all-reduce skipped: each rank keeps its own gradient",
    "allreduce_not_averaged": "the gradient all-reduced but not averaged: its result N times an average",
    "rank_dropped": "the last rank's contribution left out of the gradient all-reduce",
    "straggler": "the last rank delayed inside its gradient all-reduce at step 2: the run must pass, the wait reported",
    "rank_killed": "the last rank killed (SIGKILL) inside its gradient all-reduce at step 2: named as a rank failure",
}
DATA_MUTATIONS = {  # where the harness hands a trainer its batch iterator (``TrainerInfo.feeds_rows``)
    "same_rows": "every rank given rank 0's rows: the trainer's batch iterator told it is rank 0",
}
REFERENCE_MUTATIONS = tuple(MUTATIONS_DESCRIBED)  # injected into the reference trainer's arithmetic
MUTATIONS_DESCRIBED.update(COLLECTIVE_MUTATIONS)
MUTATIONS_DESCRIBED.update(DATA_MUTATIONS)
MUTATION_NAMES = tuple(MUTATIONS_DESCRIBED)
# what a collective mutation's run must show; any other must be caught by a check that fails
MUTATION_EXPECTS = {"straggler": "pass", "rank_killed": "rank_failure"}
TIMED_MUTATION_STEP = 2  # the step at which the straggler is delayed and the rank killed
# ``[checks] mutations``: one run each (and ``DATA_MUTATIONS`` where the trainer's record says it feeds its rows)
MUTATION_SETS = {"collectives": tuple(COLLECTIVE_MUTATIONS)}

# the known DDP defects a failed step-local check is tested against (harness.rank.defects)
DEFECTS_DESCRIBED = {
    "correct": "the correct token-weighted global loss and gradient",
    "mean_of_means": "the mean of the ranks' per-rank mean losses and gradients",
    "micro_means": "the mean of every micro-batch's own mean loss and gradient",
    "no_allreduce": "no all-reduce: each rank's own mean loss and gradient",
    "no_allreduce_global": "no gradient all-reduce: each rank's own gradient sum over the global token count",
    "no_allreduce_scaled": "no gradient all-reduce: each rank's own gradient scaled for an average (x N / T) "
                           "that never happens",
    "not_divided_by_world": "the ranks' mean losses and gradients summed but not divided by the world size",
    "local_token_count": "the loss and gradient summed over the ranks but divided by the rank's own token count",
    "grad_times_world": "the gradient scaled by the world size",
    "same_rows": "every rank on the same rows (rank 0's)",
    "other_rows": "the rows each rank reads differ from the reference's batch (a shuffle or shard of its own, "
                  "or rows dropped)",
    "rank_scaled": "each rank's gradient scaled by a factor of its own before the all-reduce (a gradient clipped "
                   "on each rank before it: clip the all-reduced gradient instead)",
    "lr_times_world": "the learning rate scaled by the world size",  # named by lr_schedule
    "rank_seeds": "ranks seeded differently: they start from different weights",  # named by start_parity
}


class CheckName(StrEnum):
    """Every built-in check (its family: ``harness.scenario.checks``): a member's identifier is the
    check's name, and its value (``loss_parity = auto()`` is "loss_parity")."""

    expected_failure = auto()
    start_parity = auto()
    step_token_parity = auto()
    step_loss_parity = auto()
    step_grad_parity = auto()
    lr_schedule = auto()
    loss_parity = auto()
    param_parity = auto()
    eval_parity = auto()
    data_share_bytes = auto()
    token_accounting = auto()
    replica_consistency = auto()
    ranks_agree = auto()
    collective_agreement = auto()
    rank0_side_effects = auto()
    global_rng_untouched = auto()
    dtype_held = auto()
    compile_scope = auto()
    stop_step = auto()
    resume_step = auto()
    resume_loss_parity = auto()
    resume_param_parity = auto()
    resume_eval_parity = auto()
    resume_accounting = auto()
    memory_rss_per_rank_mb = auto()
    memory_rss_total_mb = auto()
    memory_mlx_per_rank_mb = auto()
    memory_mlx_total_mb = auto()
    wired_share = auto()
    mutation_caught = auto()
