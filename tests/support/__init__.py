"""What the tests share, by theme: coordinators in processes and in the test process,
raw connections and scripted peers, waiting, the CLI. Import from the module itself
(``from tests.support.inprocess import InProcessCoordinator``)."""
