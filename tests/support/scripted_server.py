"""A scripted coordinator for the client's unit tests: ``ScriptedServer`` plays steps (a
reply, a close, a hang, a delay, raw bytes) to whatever connects, on stdlib threads."""

from __future__ import annotations

import socket
import threading

from jobmesh.protocol.framing import FrameReader, encode_frame


CLOSE = "close"   # a ScriptedServer step: close the connection without a reply
HANG = "hang"     # a ScriptedServer step: never answer


class Delayed:
    """A ScriptedServer step that answers only after ``seconds``."""

    def __init__(self, seconds: float, step):
        self.seconds = seconds
        self.step = step


class ScriptedServer:
    """Accepts connections one after another and plays ``steps`` across them in order.

    ``port``: listen there (default: a free one); ``dies``: stop listening once the steps
    are played (connecting is refused then, as at a dead coordinator). Each step answers
    one request: a dict is sent as a frame, ``CLOSE`` closes the
    connection without a reply, ``HANG`` never answers, ``bytes`` are sent raw, and
    ``Delayed(seconds, step)`` plays ``step`` after a pause (a coordinator holding a WAIT_JOB).
    ``requests`` and ``connections`` record what arrived (stdlib threads, no patching).
    """

    def __init__(self, steps, port: int = 0, dies: bool = False):
        self.steps = list(steps)
        self.dies = dies
        self.requests: list[dict] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.05)  # before the thread starts: close() may come first
        self.port = self.listener.getsockname()[1]
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while self.steps and not self._release.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            with conn:
                reader = FrameReader(conn.recv)
                while self.steps:
                    try:
                        request = reader.read_frame()
                    except OSError:
                        break
                    if request is None:
                        break
                    self.requests.append(request)
                    step = self.steps.pop(0)
                    if self.dies and not self.steps:
                        self.listener.close()  # before this connection ends: the client sees the death whole
                    if step == CLOSE:
                        break
                    if isinstance(step, Delayed):
                        if self._release.wait(step.seconds):
                            break
                        step = step.step
                    if step == HANG:
                        self._release.wait(10)
                        break
                    conn.sendall(step if isinstance(step, bytes) else encode_frame(step))
        if self.dies:
            self.listener.close()

    def close(self):
        self._release.set()
        self.listener.close()
        self._thread.join(5)
