"""``python -m jax_rl.config --write``: regenerate ``configs/base.yaml`` and ``docs/config.md`` from the schema
(:mod:`jax_rl.config.reference`); without ``--write``, print the base config (``python -m jax_rl.config >
configs/base.yaml``)."""

from jax_rl.config.reference import main

raise SystemExit(main(prog="python -m jax_rl.config", prints="base"))
