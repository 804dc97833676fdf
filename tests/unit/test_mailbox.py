"""The core's mailbox: worker events before client requests, order kept within a lane."""

from jobmesh.coordinator.runtime import Mailbox


def test_urgent_items_come_first_and_each_lane_keeps_its_order():
    box = Mailbox()
    box.put("c1")
    box.put_urgent("w1")
    box.put("c2")
    box.put_urgent("w2")
    assert len(box) == 4
    assert box.take(10) == ["w1", "w2", "c1", "c2"]
    assert len(box) == 0


def test_take_respects_the_batch_limit_across_lanes():
    box = Mailbox()
    for i in range(3):
        box.put_urgent("w%d" % i)
    for i in range(3):
        box.put("c%d" % i)
    assert box.take(4) == ["w0", "w1", "w2", "c0"]
    assert box.take(4) == ["c1", "c2"]


def test_take_all_empties_both_lanes():
    box = Mailbox()
    box.put("c")
    box.put_urgent("w")
    assert box.take_all() == ["w", "c"]
    assert len(box) == 0
