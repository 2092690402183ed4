"""The trainers under test, one package each (``harness.trainers.<kind>``): its ``__init__`` is
its record (``TRAINER``, with its scenario rules; base, imported by name by the registry,
``harness.scenario.trainers``), and its ``rank`` module (the record's ``module``) is what runs
inside the rank processes the controller launches (``harness.rank.entry``: ``run(ctx) -> dict``),
all reporting through the same rank protocol.
"""
