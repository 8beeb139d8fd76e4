"""`BlockTables`: a persistent `[rows, max_pages]` page table, updated in place.

Each running request owns a row while it runs. Pages are only ever appended to
a running request, so a step writes just the new pages instead of rebuilding
the table; a preempted or finished request gives its row back.
"""

from __future__ import annotations

import torch

from ..invariants import InvariantError
from ..requests import Request


class BlockTables:
    def __init__(self, max_pages_per_request: int, device: torch.device, initial_rows: int = 64) -> None:
        self.max_pages_per_request = max_pages_per_request
        self.device = device
        self.table = torch.zeros(initial_rows, max_pages_per_request, dtype=torch.int64, device=device)
        self._rows: dict[int, int] = {}  # id(request) -> row
        self._num_written: dict[int, int] = {}  # id(request) -> pages already in its row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def sync(self, request: Request) -> int:
        """Make `request`'s row match its `page_ids` (appending new pages); return the row."""
        key = id(request)
        row = self._rows.get(key)
        if row is None:
            row = self._take_row()
            self._rows[key] = row
            self._num_written[key] = 0
        written = self._num_written[key]
        num_pages = len(request.page_ids)
        if num_pages < written:
            raise InvariantError(f"{request.request_id}: page table shrank without release")
        if num_pages > self.max_pages_per_request:
            raise InvariantError(f"{request.request_id}: {num_pages=}")
        if num_pages > written:
            new_pages = torch.tensor(request.page_ids[written:], dtype=torch.int64)
            self.table[row, written:num_pages] = new_pages.to(self.device)
            self._num_written[key] = num_pages
        return row

    def release(self, request: Request) -> None:
        row = self._rows.pop(id(request), None)
        if row is not None:
            del self._num_written[id(request)]
            self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            grown = torch.zeros(
                old * 2, self.max_pages_per_request, dtype=self.table.dtype, device=self.device
            )
            grown[:old] = self.table
            self.table = grown
            self._free_rows = list(range(old * 2 - 1, old - 1, -1))
        return self._free_rows.pop()
