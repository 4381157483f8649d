"""The old entry point of the configuration reference, kept for ``python -m jax_rl.config_reference --write``:
the code is :mod:`jax_rl.config.reference` (whose ``--write`` now regenerates ``configs/base.yaml`` too)."""

from jax_rl.config.reference import DOC_PATH, REGEN_COMMAND, main, render_config_reference  # noqa: F401

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(prog="python -m jax_rl.config_reference"))
