"""The KV-priority ordering rule (workers/coordinator/kv_priority.py): which queued sample gates
the oldest buffer, which samples give up their KV for it, and on which instance."""

from workers.coordinator.kv_priority import gating_sample, kv_priority_interrupts, victims_for
from workers.coordinator.routing import queue_levels
from workers.coordinator.state import InstanceView, QueuedSample, RunningSample


def inst(iid, running, kv_cap=1000, max_running=8, version=5, waiting=0):
    rs = tuple(RunningSample(sid, tokens, length, v) for sid, tokens, length, v in running)
    return InstanceView(iid, version, len(rs), waiting, sum(r.length for r in rs), kv_cap, rs, max_running=max_running)


def q(sid, v_traj, length=300, tokens=10):
    return QueuedSample(sid, group_id=sid, length=length, v_traj=v_traj, tokens=tokens, last_version=v_traj)


def test_the_gating_sample_is_of_the_oldest_level_in_flight():
    insts = [inst(1, [(10, 5, 400, 3), (11, 5, 400, 4)])]
    levels = queue_levels([q(1, 4), q(2, 3)])
    assert gating_sample(insts, levels) == (3, q(2, 3))
    # an older sample still decodes: the oldest buffer waits on it, not on a queued one
    assert gating_sample([inst(1, [(10, 5, 400, 2)])], levels) is None
    # routed this cycle: what is left (buffer 4) is newer than a decoding sample (buffer 3)
    assert gating_sample(insts, levels, exclude={2}) is None


def test_victims_are_newest_buffer_first_then_fewest_tokens():
    i = inst(1, [(10, 50, 300, 3), (11, 90, 300, 5), (12, 20, 300, 5)])
    assert victims_for(i, 3, 250) == (12,)  # 900 held: one 300-token sample of buffer 5 frees room
    assert victims_for(i, 3, 550) == (12, 11)
    assert victims_for(i, 3, 850) is None  # the oldest buffer's own sample is never a victim
    assert victims_for(inst(1, [(10, 5, 300, 3)]), 3, 100) == ()  # fits already


def test_one_interrupt_on_the_instance_losing_the_least_kv():
    full_a = inst(1, [(10, 5, 500, 3), (11, 5, 500, 5)])
    full_b = inst(2, [(20, 5, 600, 3), (21, 5, 200, 5), (22, 5, 200, 5)])
    levels = queue_levels([q(1, 3, length=150)])
    (d,) = kv_priority_interrupts([full_a, full_b], levels)
    assert (d.instance_id, d.sample_ids, d.reason) == (2, (21,), "kv_priority")
    # room somewhere already, or the sample was routed this cycle: nothing
    roomy = inst(3, [(30, 5, 100, 5)])
    assert kv_priority_interrupts([full_a, full_b, roomy], levels) == []
    assert kv_priority_interrupts([full_a, full_b], levels, routed={1}) == []
