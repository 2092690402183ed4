"""Judgement: checks that turn collected runs into pass/fail with measured values and limits."""
