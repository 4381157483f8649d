"""placement.* -> device sets (jax_rl.placement.resolve_roles) on the 8 fake CPU devices."""

import pytest

from jax_rl.config import ConfigError, load_config
from jax_rl.placement import resolve_roles
from jax_rl.runtime.resources import check_mesh


def ids(ds):
    return [d.id for d in ds]


def roles(*over):
    return resolve_roles(load_config(None, list(over)))


def test_default_is_colocated(devices):
    r = roles()
    assert ids(r.learner) == list(range(8)) and r.engines is None and r.scorer is None
    assert not r.separate_rollout


def test_counts_split_learner_first_rollout_last(devices):
    r = roles("placement.learner=4", "placement.rollout=4", "rollout.mesh.tensor=2")
    assert ids(r.learner) == [0, 1, 2, 3]
    assert [ids(e) for e in r.engines] == [[4, 5, 6, 7]]
    assert r.engine_mesh == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    assert r.separate_rollout
    # the learner defaults to what the rollout leaves
    assert ids(roles("placement.rollout=2").learner) == list(range(6))
    # two engines share the rollout set, consecutive halves
    r = roles("placement.rollout=[2,3,6,7]", "rollout.threads=2", "rollout.mesh.tensor=2")
    assert [ids(e) for e in r.engines] == [[2, 3], [6, 7]] and r.engine_mesh["data"] == 1
    assert ids(r.learner) == [0, 1, 4, 5]


def test_colocated_sharded_engine(devices):
    r = roles("rollout.mesh.tensor=2", "rollout.threads=2")
    assert ids(r.learner) == list(range(8)) and [ids(e) for e in r.engines] == [[0, 1], [0, 1]]
    assert not r.separate_rollout
    # overlapping explicit sets are allowed for learner/rollout (colocated engines)
    r = roles("placement.learner=8", "placement.rollout=[0,1]")
    assert ids(r.learner) == list(range(8)) and [ids(e) for e in r.engines] == [[0, 1]]


def test_scorer_takes_what_the_rollout_leaves(devices):
    r = roles("loss.correction=exact", "old_logits.route=dedicated", "placement.rollout=2", "placement.scorer=2",
              "rollout.mesh.tensor=2")
    assert ids(r.scorer) == [4, 5] and ids(r.learner) == [0, 1, 2, 3] and [ids(e) for e in r.engines] == [[6, 7]]


@pytest.mark.parametrize("over,msg", [
    (["placement.rollout=9"], r"placement.rollout=9 asks for 9 device\(s\); 8 are available"),
    (["placement.rollout=[1,42]"], r"placement.rollout=\[1, 42\]: no device with id\(s\) \[42\]"),
    (["placement.rollout=8"], r"placement.rollout=8 take\(s\) all 8 device\(s\); the learner needs at least one"),
    (["placement.rollout=3", "rollout.threads=2"], r"placement.rollout=3 \(3 devices\) does not split evenly over "
                                                   r"rollout.threads=2"),
    (["placement.rollout=4", "rollout.mesh.tensor=3"], r"rollout.mesh.data=-1 .*rollout.mesh.tensor=3 .* does not fit "
                                                       r"the 4 device\(s\) of each engine"),
    (["placement.rollout=2", "rollout.mesh.data=1", "rollout.mesh.tensor=4"], r"must equal it"),
    (["placement.rollout=4", "rollout.slots=6"], r"rollout.slots=6 does not split over the engine's data axis of 4"),
    (["loss.correction=exact", "old_logits.route=dedicated", "placement.learner=8", "placement.scorer=2"],
     r"placement.scorer=2 overlaps placement.learner=8 on device\(s\) \[6, 7\]"),
    (["loss.correction=exact", "old_logits.route=dedicated", "placement.rollout=[6,7]", "placement.scorer=[7]"],
     r"placement.scorer=\[7\] overlaps placement.rollout=\[6, 7\]"),
    (["placement.learner=4", "placement.rollout=4", "mesh.fsdp=8"], r"mesh.fsdp=8 .* does not fit the 4 available "
                                                                     r"device\(s\) given to the learner by "
                                                                     r"placement.learner=4 placement.rollout=4"),
])
def test_bad_placements_name_the_key(devices, over, msg):
    with pytest.raises(ConfigError, match=msg):
        check_mesh(load_config(None, over))


def test_ray_refuses_a_rollout_placement():
    with pytest.raises(ConfigError, match="runtime=ray runs its engines in worker processes"):
        load_config(None, ["runtime=ray", "placement.rollout=2"])


def test_ray_refuses_a_sharded_rollout_mesh():
    with pytest.raises(ConfigError, match=r"rollout.mesh=.*runtime=ray runs each engine in a worker process"):
        load_config(None, ["runtime=ray", "rollout.mesh.tensor=2"])
    load_config(None, ["runtime=ray", "rollout.mesh.data=-1"])  # the default (-1 = the engine's devices) is fine


def test_rollout_expert_axis_must_divide_the_experts():
    from jax_rl.model_builder import build_model_config

    with pytest.raises(ConfigError, match=r"^rollout.mesh.expert=3: the model's num_experts=4"):
        build_model_config(load_config(None, ["model.preset=tiny_moe", "rollout.mesh.expert=3"]))
    assert build_model_config(load_config(None, ["model.preset=tiny_moe", "rollout.mesh.expert=2"])).num_experts == 4


TAU2_USER = ["env.name=tau2", "env.tau2.user=model"]


def test_user_model_takes_what_the_rollout_and_scorer_leave(devices):
    r = resolve_roles(load_config(None, TAU2_USER + ["placement.rollout=2", "placement.user=2"]))
    assert ids(r.user) == [4, 5] and ids(r.learner) == [0, 1, 2, 3] and [ids(e) for e in r.engines] == [[6, 7]]
    # rollout.mesh of one device (the default): fsdp over the user model's devices, as the scorer's
    assert r.user_mesh == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 1}
    r = resolve_roles(load_config(None, TAU2_USER + ["loss.correction=exact", "old_logits.route=dedicated",
                                                     "placement.scorer=1", "placement.user=[5, 6]"]))
    assert ids(r.scorer) == [7] and ids(r.user) == [5, 6] and ids(r.learner) == [0, 1, 2, 3, 4]
    # an explicit rollout.mesh is laid over the user model's devices too
    r = resolve_roles(load_config(None, TAU2_USER + ["placement.rollout=2", "placement.user=4", "rollout.mesh.tensor=2"]))
    assert ids(r.user) == [2, 3, 4, 5] and r.user_mesh == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    assert roles().user is None and roles().user_mesh is None


@pytest.mark.parametrize("over,msg", [
    (["placement.user=9"], r"placement.user=9 asks for 9 device\(s\); 8 are available"),
    (["placement.user=[3, 42]"], r"placement.user=\[3, 42\]: no device with id\(s\) \[42\]"),
    (["placement.user=8"], r"placement.user=8 take\(s\) all 8 device\(s\); the learner needs at least one"),
    (["placement.learner=8", "placement.user=2"], r"placement.user=2 overlaps placement.learner=8 on device\(s\) \[6, 7\]"),
    (["placement.rollout=[6,7]", "placement.user=[7]"], r"placement.user=\[7\] overlaps placement.rollout=\[6, 7\]"),
    (["loss.correction=exact", "old_logits.route=dedicated", "placement.scorer=[5]", "placement.user=[5]"],
     r"placement.user=\[5\] overlaps placement.scorer=\[5\]"),
    (["placement.user=3", "rollout.mesh.tensor=2"], r"does not fit the 3 device\(s\) of each engine \(placement.user=3, "
                                                    r"the user model's engine\)"),
    (["placement.user=[1,2,3,4]", "rollout.mesh.data=4", "rollout.slots=6"],
     r"rollout.slots=6 does not split over the engine's data axis of 4"),
])
def test_bad_user_placements_name_the_key(devices, over, msg):
    with pytest.raises(ConfigError, match=msg):
        check_mesh(load_config(None, TAU2_USER + over))


@pytest.mark.parametrize("over,msg", [
    (["placement.user=2"], r"placement.user=2 places the tau² user simulator model, which only env.name=tau2 with "
                           r"env.tau2.user=model runs: set placement.user=null"),
    (["env.name=tau2", "placement.user=2"], r"set placement.user=null"),
    (TAU2_USER + ["placement.user=2", "runtime=ray"], r"placement.user=2 .* runtime=ray .* placement.user=null"),
])
def test_user_placement_needs_a_user_model_in_this_process(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, over)
