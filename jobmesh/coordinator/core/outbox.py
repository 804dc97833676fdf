"""The core's outbound frames, released by the runtime after the batch's commit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import OutboundConnection

# A JSON message, a Periodic frame (bytes, or Paced: written on its own), or None: close
# the connection once what is queued for it is out.
Frame = Union[m.Message, bytes, pc.Paced, None]


class Outbox:
    """Every part of the core "sends" by appending here; nothing touches a socket."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[OutboundConnection, Frame]] = []

    def send(self, conn: OutboundConnection, frame: Frame) -> None:
        self.items.append((conn, frame))

    def take(self) -> list[tuple[OutboundConnection, Frame]]:
        items, self.items = self.items, []
        return items
