"""The command's entry point (``mlx-ddp-harness``, ``python -m harness``): the command line's
module is imported under the same guard its commands run under, so that a fault while importing
it (a broken dependency, a bug at module level) exits 5 as any other fault in the harness does."""

from __future__ import annotations

from harness.exit_codes import internal_fault


def main(argv: list[str] | None = None) -> int:
    try:
        from harness.present import cli
    except Exception as e:
        return internal_fault(e, "loading the command line")
    return cli.main(argv)
