"""A DCP load planner that records whether a load has touched live state.

    planner = TouchLoadPlanner(); dcp.load(state, storage_reader=r, planner=planner)
    planner.touched      # True once any destination tensor or value was handed out for writing

A load that fails before `touched` leaves the model and optimizer as they were, so an older checkpoint may be
tried; after it, they hold a mix of two states and the job must stop (manager.PartialLoad).
"""
from __future__ import annotations

import io

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


class TouchLoadPlanner(DefaultLoadPlanner):
    touched = False

    def resolve_tensor(self, read_item: ReadItem):
        self.touched = True  # the reader may write into this tensor before it checks the checksum
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.touched = True
        super().load_bytes(read_item, value)
