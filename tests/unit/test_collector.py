"""CollectorPolicy: survivors are frozen out of collections, and thawed periodically."""

from __future__ import annotations

import gc
import weakref

import pytest

from jobmesh.coordinator.shell.housekeeping import YOUNG_THRESHOLD, CollectorPolicy


class Node:
    pass


@pytest.fixture
def thawed():
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_first_tick_leaves_young_collections_to_the_policy(thawed):
    gc.set_threshold(700, 10, 10)
    policy = CollectorPolicy(freeze_seconds=1.0, thaw_seconds=10.0)
    policy.tick(policy._next_freeze - 0.5)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)


def test_nothing_happens_before_the_first_period(thawed):
    policy = CollectorPolicy(freeze_seconds=1.0, thaw_seconds=10.0)
    policy.tick(policy._next_freeze - 0.5)
    assert gc.get_freeze_count() == 0


def test_survivors_are_frozen_and_a_frozen_cycle_is_freed_at_the_thaw(thawed):
    policy = CollectorPolicy(freeze_seconds=1.0, thaw_seconds=10.0)
    start = policy._next_freeze - 1.0
    # Given a reference cycle that is alive when the policy freezes
    node = Node()
    node.me = node
    ref = weakref.ref(node)
    policy.tick(start + 1.5)
    assert gc.get_freeze_count() > 0
    # When it becomes garbage, an ordinary full collection no longer sees it
    del node
    gc.collect()
    assert ref() is not None
    # Then the periodic thaw collects it
    policy.tick(start + 10.5)
    assert ref() is None


def test_a_young_cycle_is_collected_before_the_freeze(thawed):
    policy = CollectorPolicy(freeze_seconds=1.0, thaw_seconds=10.0)
    node = Node()
    node.me = node
    ref = weakref.ref(node)
    del node  # garbage before the freeze: collected by it, never frozen
    policy.tick(policy._next_freeze + 0.1)
    assert ref() is None
