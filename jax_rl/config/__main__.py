"""``python -m jax_rl.config > configs/base.yaml``: print the commented base config rendered from the schema."""

from jax_rl.config.loading import render_base_yaml

print(render_base_yaml(), end="")
