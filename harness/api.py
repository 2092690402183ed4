"""The API a user's own training script reports through when the harness runs it.

A scenario with ``[trainer] kind = "script"`` and ``path = "train.py"`` launches the script in
every rank process (after the rank has joined the distributed group: ``mx.distributed.init()``
in the script returns that group). The script trains as it likes and tells the harness what it
did::

    from harness import api

    run = api.session()                  # this rank's session
    model = run.model()                  # the scenario's model (or your own, seeded: run.split(model))
    rows = run.rows()                    # the scenario's train rows: [(token ids, supervised mask)]
    optimizer = run.optimizer()          # the scenario's optimizer and learning-rate schedule
    for step in range(1, run.steps + 1):
        run.probe(step, model, global_loss_and_grad, batch)   # optional: step-local parity
        ...                              # your DDP step
        run.step(step, loss, tokens, tokens_local, lr=lr, params=model.parameters())
    if run.rank == 0:
        ...                              # your own save
        run.saved()                      # announce it (rank 0 only, if the script is correct)
    run.finish(model.parameters())       # the final parameters, judged for parity

docs/scripts.md explains every call and argument. ``split`` (which ``model`` calls) marks where
training starts: the parameters then are compared with every other run's (runs that start from
different weights fail), and from then on training must leave the global RNGs alone.

Every report is a record of the rank protocol (docs/rank-protocol.md), written to the rank's
protocol directory and read back by its rank process exactly as an executable's records are
(``harness.rank.protocol``); ``probe`` is the one call outside the protocol: it hands a function
over in the process.

A script that saves declares it with ``[trainer] saves = true``: the judge then demands a save
on rank 0 (and, declared or not, fails a save announced on any other rank).

``run.probe`` hands over, before the step's update, the function the step computes its global
loss and gradient with: ``global_loss_and_grad(batch)`` returns ``(loss, grads, tokens)``, the
global loss, the all-reduced gradient (the one the optimizer applies) and the global supervised
token count, on this rank's part of the step's batch and without updating anything. At the
steps the harness probes, it calls the function at the reference run's parameters (put into
``model`` and taken out again), so N ranks and one process are compared at identical parameters,
where only rounding separates a correct script's figures (step-local parity); at other steps it
returns at once. A script that never calls it has its step-local checks reported as n/a.

``loss`` is the step's global loss as the script computes it, ``tokens`` the step's global
supervised token count and ``tokens_local`` this rank's. In the noise-floor run (one process)
``run.model()`` returns a model whose forward computes each batch in the row chunks of the ranks
being judged (``run.split_rows`` of them), so the harness measures how far the same mathematics
moves with N ranks' rounding; a script that builds its own model passes it through
``run.split(model)``.
"""

from __future__ import annotations

from harness.rank.script_session import NotUnderHarness, Session, session

__all__ = ["NotUnderHarness", "Session", "session"]
