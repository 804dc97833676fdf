"""The core's mailbox (coordinator/mailbox.py): the core's own items first, then
connections served round-robin, PER_CONN events each per turn; worker connections first
but at most half of a batch while clients wait; a cost budget per batch; each
connection's events in order."""

from collections import deque

from jobmesh.coordinator.shell.mailbox import PER_CONN, Mailbox


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.inbox: deque = deque()
        self.drains = 0

    def drained(self) -> None:
        self.drains += 1


class Item:
    def __init__(self, conn, n, cost: int = 1) -> None:
        self.conn, self.n, self.cost = conn, n, cost

    def __repr__(self) -> str:
        return "%s%d" % (self.conn.name if self.conn else "own", self.n)


def names(batch) -> list[str]:
    return [repr(i) for i in batch]


def test_own_items_first_then_workers_then_clients():
    box = Mailbox()
    w, c = Conn("w"), Conn("c")
    box.put(Item(c, 1))
    box.put_urgent(Item(w, 1))
    box.put_urgent(Item(None, 1))  # the sweep
    assert len(box) == 3
    assert names(box.take(10)) == ["own1", "w1", "c1"]
    assert len(box) == 0 and w.drains == 1 and c.drains == 1


def test_connections_take_turns_and_keep_their_order():
    box = Mailbox()
    a, b = Conn("a"), Conn("b")
    for i in range(40):
        box.put(Item(a, i))
    for i in range(3):
        box.put(Item(b, i))
    batch = names(box.take(100))
    assert batch[:PER_CONN] == ["a%d" % i for i in range(PER_CONN)]
    assert batch[PER_CONN:PER_CONN + 3] == ["b0", "b1", "b2"]
    assert [x for x in batch if x.startswith("a")] == ["a%d" % i for i in range(40)]


def test_a_worker_flood_leaves_half_of_each_batch_to_clients():
    box = Mailbox()
    flood, client = Conn("w"), Conn("c")
    for i in range(5000):
        box.put_urgent(Item(flood, i))
    for i in range(300):
        box.put(Item(client, i))
    batch = box.take(512)
    assert len(batch) == 512
    assert sum(1 for x in batch if x.conn is client) >= 256 - PER_CONN
    # and without clients waiting, workers may use the whole batch
    box2, alone = Mailbox(), Conn("w2")
    for i in range(600):
        box2.put_urgent(Item(alone, i))
    assert len(box2.take(512)) == 512


def test_a_batch_stops_at_its_cost_budget_but_always_takes_one():
    box = Mailbox()
    lister, submitter = Conn("l"), Conn("s")
    for i in range(5):
        box.put(Item(lister, i, cost=251))
    for i in range(5):
        box.put(Item(submitter, i))
    first = box.take(512)
    assert sum(i.cost for i in first) <= 512
    assert names(first)[:2] == ["l0", "l1"]
    huge = Mailbox()
    huge.put(Item(Conn("l"), 9, cost=10_000))
    assert names(huge.take(512)) == ["l9"]


def test_take_all_empties_everything():
    box = Mailbox()
    w, c = Conn("w"), Conn("c")
    box.put(Item(c, 1))
    box.put_urgent(Item(w, 1))
    box.put_urgent(Item(None, 1))
    assert sorted(names(box.take_all())) == ["c1", "own1", "w1"]
    assert len(box) == 0 and not w.inbox and not c.inbox


def test_a_client_pipelining_large_dumps_leaves_room_for_the_others():
    from jobmesh.coordinator.core import events as ev
    from jobmesh.coordinator.ports.periodic import PeriodicPort
    from jobmesh.coordinator.shell.loop import MAX_BATCH
    from jobmesh.periodic import codec as pc

    box = Mailbox()
    # the core's price of a DUMP of 50k live jobs, and of a STATUS of 3 funcs (CoordinatorCore.periodic_cost)
    port = PeriodicPort(box.put, box.put_urgent, {}, 1.0,
                        cost=lambda kind: 1 + (50_000 if kind is pc.Dump else 3) // ev.LIST_ROWS_PER_COST)
    dumper, other = Conn("dumper"), Conn("other")
    for i in range(32):  # one client pipelining DUMPs of 50k live jobs
        box.put(ev.PeriodicPacket(dumper, pc.Dump(i), port.cost_of(pc.Dump(i))))
    box.put(Item(other, 1))  # a JSON client's status
    batches = [box.take(MAX_BATCH) for _ in range(3)]
    assert all(sum(type(e) is ev.PeriodicPacket for e in batch) <= 1 for batch in batches)  # one DUMP a batch
    assert any(any(getattr(e, "conn", None) is other for e in batch) for batch in batches[:2])
    assert port.cost_of(pc.Load(1, ())) == 1 and port.cost_of(pc.Status(2)) == 1
    assert port.cost_of(pc.Load(3, (pc.Job(b"f", b"n", b""),) * 400)) == 101


def test_clients_pipelining_reads_of_a_large_workflow_leave_room_for_the_others():
    from jobmesh.coordinator.core import events as ev
    from jobmesh.coordinator.shell.loop import MAX_BATCH
    from jobmesh.protocol import messages as m

    box = Mailbox()
    readers, other = [Conn("r%d" % i) for i in range(4)], Conn("other")
    # a WORKFLOW may be a frame's worth of jobs: each of these is answered with one
    reads = [m.WorkflowStatus("w"), m.WaitWorkflow("w", 0), m.WorkflowCancel("w")]
    for reader in readers:
        for i in range(16):
            box.put(ev.Request(reader, reads[i % 3]))
    box.put(ev.Request(other, m.GetJobStatus("j")))
    batch = box.take(MAX_BATCH)  # two of them a batch at most, and the other client's request beside them
    assert sum(type(e.msg) is not m.GetJobStatus for e in batch) <= 2 and any(e.conn is other for e in batch)
    assert ev.Request(other, m.GetJobStatus("j")).cost == ev.Request(other, m.SubmitJob("SLEEP", {})).cost == 1
