"""The rank runtime every trainer shares, inside each launched process: the entry point, the
protocol writers, failure consensus, fault injection, and the data and models trainers are fed.
The trainers themselves are in ``harness.trainers``.

Heavy libraries (mlx, mlx-lm, tokenizers) are imported inside functions, so a rank's startup
time is spent where it is measured.
"""
