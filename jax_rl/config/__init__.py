"""Run configuration: pydantic v2 schema, YAML loading with inheritance, ``key=value`` overrides.

MaxText style: ``configs/base.yaml`` holds every knob on one line (value, choices, a short meaning); run and model
files hold only deltas and name their parent with ``base_config: base.yaml``. The CLI takes
``jax-rl train CONFIG.yaml key.sub=value ...``.

Every section is a pydantic model with ``extra="forbid"``, so an unknown key is an error.
:func:`load_config` turns pydantic's errors into one :class:`ConfigError` whose message
names the dotted key, the bad value and the constraint, and suggests the closest valid key
for a typo (``loss.corection`` -> ``loss.correction``).

The package: :mod:`jax_rl.config.schema` (:class:`Config`) over the sections in :mod:`~jax_rl.config.base`,
:mod:`~jax_rl.config.model`, :mod:`~jax_rl.config.training`, :mod:`~jax_rl.config.rollout` and
:mod:`~jax_rl.config.run`, :mod:`jax_rl.config.loading` (files, overrides, errors, dump, hash) and :mod:`jax_rl.config.reference`
(``configs/base.yaml`` and ``docs/config.md`` rendered from the schema's docstrings); everything is
importable from ``jax_rl.config``. Importing or validating it does not import jax (cheap for the CLI
and tests). The package imports no learner registry (what a correction mode allows with it is the
registries' check, :func:`jax_rl.learner.correction.check_config`); it imports the env registry's knob checks
(:mod:`rollout.envs`) and :mod:`jax_rl.affinity` (:mod:`jax_rl.config.schema` says why). ``python -m jax_rl.config
--write`` regenerates both generated files.
"""

from jax_rl.config.loading import (_format_errors, _literal_choices, _section_fields, _suggest, _valid_keys,
                                   apply_overrides, config_hash, dump_config, load_config, parse_overrides,
                                   validate_config)
from jax_rl.config.reference import render_base_yaml, render_config_reference
from jax_rl.config.schema import *  # noqa: F401,F403 (the sections, Config, ConfigError, CONFIG_DIR)
from jax_rl.config.schema import __all__ as _schema_all
from jax_rl.config.schema import (MAX_EPISODE_TIMEOUT_S, MAX_TOOL_LATENCY_S, AlgoConfig, AsyncConfig, CheckpointConfig,
                                  Config, ConfigError, EnvConfig, EvalConfig, LoggingConfig, LossConfig, MeshConfig,
                                  ModelConfig, MoEConfig, OldLogitsConfig, OptimConfig, PlacementConfig,
                                  RolloutConfig, RolloutMeshConfig, RunConfig, RuntimeConfig, SFTConfig)

__all__ = [*_schema_all, "load_config", "parse_overrides", "apply_overrides", "validate_config", "dump_config",
           "config_hash", "render_base_yaml", "render_config_reference"]
