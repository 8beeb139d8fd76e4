"""`BlockTables`: a persistent `[rows, max_pages]` page table, updated in place.

Each running request owns a row, keyed by its request id (never `id(request)`, which Python
recycles), while it holds pages. Pages are only ever appended to a running request, so a step
writes just the new pages instead of rebuilding the table; the scheduler's page release (preemption,
or the single `finish()` exit) gives the row back.
"""

from __future__ import annotations

import torch

from ..invariants import InvariantError
from ..requests import Request


class BlockTables:
    """Args:
    max_pages_per_request: the widest a row may grow (the model's context, or the whole cache).
    initial_pages: the width allocated up front (e.g. from workload hints); rows widen on demand.
    """

    def __init__(
        self,
        max_pages_per_request: int,
        device: torch.device,
        initial_rows: int = 64,
        initial_pages: int | None = None,
    ) -> None:
        self.max_pages_per_request = max_pages_per_request
        self.device = device
        width = max_pages_per_request if initial_pages is None else min(initial_pages, max_pages_per_request)
        self.table = torch.zeros(initial_rows, max(1, width), dtype=torch.int64, device=device)
        self._rows: dict[str, int] = {}  # request id -> row
        self._num_written: dict[str, int] = {}  # request id -> pages already in its row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def sync(self, request: Request) -> int:
        """Make `request`'s row match its `page_ids` (appending new pages); return the row."""
        key = request.request_id
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
        if num_pages > self.table.shape[1]:
            self._widen(num_pages)
        if num_pages > written:
            new_pages = torch.tensor(request.page_ids[written:], dtype=torch.int64)
            self.table[row, written:num_pages] = new_pages.to(self.device)
            self._num_written[key] = num_pages
        return row

    def release(self, request: Request) -> None:
        row = self._rows.pop(request.request_id, None)
        if row is not None:
            del self._num_written[request.request_id]
            self._free_rows.append(row)

    def check_integrity(self, running: list[Request]) -> None:
        """Raise `InvariantError` if a row outlives its request or disagrees with its pages."""
        by_id = {request.request_id: request for request in running}
        for request_id, row in self._rows.items():
            request = by_id.get(request_id)
            if request is None:
                raise InvariantError(f"block-table row {row} outlives request {request_id!r}")
            written = self._num_written[request_id]
            if written > len(request.page_ids):
                raise InvariantError(
                    f"{request_id}: row holds {written} pages, request {len(request.page_ids)}"
                )
            if self.table[row, :written].tolist() != request.page_ids[:written]:
                raise InvariantError(f"{request_id}: block-table row {row} disagrees with its pages")
        if len(set(self._rows.values())) != len(self._rows) or set(self._rows.values()) & set(
            self._free_rows
        ):
            raise InvariantError("a block-table row is held twice, or held and free")

    def _widen(self, num_pages: int) -> None:
        width = min(self.max_pages_per_request, max(num_pages, 2 * self.table.shape[1]))
        grown = torch.zeros(self.table.shape[0], width, dtype=self.table.dtype, device=self.device)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            grown = torch.zeros(old * 2, self.table.shape[1], dtype=self.table.dtype, device=self.device)
            grown[:old] = self.table
            self.table = grown
            self._free_rows = list(range(old * 2 - 1, old - 1, -1))
        return self._free_rows.pop()
