"""Rank side: what runs inside each launched process (entry point, trainer, data, models).

Heavy libraries (mlx, mlx-lm, tokenizers) are imported inside functions, so a rank's startup
time is spent where it is measured.
"""
