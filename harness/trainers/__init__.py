"""The trainers under test, rank side: one module each (``run(ctx) -> dict``), all run inside
the rank processes the controller launches (``harness.rank.entry``), all reporting through the
same rank protocol. What the harness knows of each is its record in
``harness.scenario.trainers``.
"""
