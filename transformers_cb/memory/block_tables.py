"""`BlockTables`: a persistent `[rows, width]` page table of one KV group, updated in place.

Rows start as wide as the workload needs (or the maximum) and widen on demand.

Each running request owns a row, keyed by its request id (never `id(request)`, which Python
recycles), while it holds pages. Logical page `i` of a request sits in column `i % width`: a
full-attention group's width covers a whole request, so that is column `i`; a sliding-window group
only ever holds a bounded run of consecutive pages, so its row is a ring that old pages leave and
new ones enter. Pages are only ever appended to a running request (speculation's rejected draft tokens give pages back
from the end, which the runner tells the table: `take_back`), so a step writes just the new
pages instead of rebuilding the table; when the scheduler frees a request's pages (preemption, or
the single `finish()` exit) the runner gives the row back (the step plan's `released`, or the
engine for requests that end outside `schedule()`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from ..invariants import InvariantError
from ..requests import Request


class BlockTables:
    """Args:
    max_pages_per_request: the widest a row may grow (the model's context, or the whole cache); for a
        sliding group, the ring's size (logical page `p` sits in column `p % max_pages_per_request`).
    initial_pages: the width allocated up front (e.g. from workload hints); rows widen on demand.
    group: the KV group whose page lists this table mirrors.
    """

    def __init__(
        self,
        max_pages_per_request: int,
        device: torch.device,
        initial_rows: int = 64,
        initial_pages: int | None = None,
        group: int = 0,
    ) -> None:
        self.max_pages_per_request = max_pages_per_request
        self.device = device
        self.group = group
        width = max_pages_per_request if initial_pages is None else min(initial_pages, max_pages_per_request)
        self.table = torch.zeros(initial_rows, max(1, width), dtype=torch.int64, device=device)
        self._rows: dict[str, int] = {}  # request id -> row
        self._num_written: dict[str, int] = {}  # request id -> logical end of the pages already in its row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def sync(self, request: Request) -> int:
        """Make `request`'s row match its page list in this group (writing new pages); return the row."""
        key = request.request_id
        row = self._rows.get(key)
        if row is None:
            row = self._take_row()
            self._rows[key] = row
            self._num_written[key] = 0
        pages = request.group_pages(self.group)
        written = self._num_written[key]
        end = pages.end_page
        if end < written:
            raise InvariantError(f"{request.request_id}: page table shrank without release")
        num_pages = len(pages.page_ids)
        if num_pages > self.max_pages_per_request:
            raise InvariantError(f"{request.request_id}: {num_pages=}")
        # Columns used so far: up to the last logical page, or the whole ring once it wrapped.
        needed_width = min(end, self.max_pages_per_request)
        if needed_width > self.table.shape[1]:
            self._widen(needed_width)
        first_new = max(written, pages.first_page)
        if end > first_new:
            new_pages = torch.tensor(pages.page_ids[first_new - pages.first_page :], dtype=torch.int64)
            new_pages = new_pages.to(self.device)
            start = first_new % self.max_pages_per_request
            if start + len(new_pages) <= self.max_pages_per_request:
                self.table[row, start : start + len(new_pages)] = new_pages
            else:  # the ring wraps around
                columns = torch.arange(first_new, end) % self.max_pages_per_request
                self.table[row, columns.to(self.device)] = new_pages
            self._num_written[key] = end
        return row

    def take_back(self, request: Request, end_page: int) -> None:
        """`request` gave pages back from the end of its list (speculation), down to `end_page`: the
        columns from there on are rewritten when pages are appended again."""
        key = request.request_id
        if key in self._num_written:
            self._num_written[key] = min(self._num_written[key], end_page)

    def release(self, request: Request) -> None:
        row = self._rows.pop(request.request_id, None)
        if row is not None:
            del self._num_written[request.request_id]
            self._free_rows.append(row)

    def check_integrity(
        self,
        running: list[Request],
        taken_back: Mapping[str, int] | None = None,
        ended: Collection[str] = (),
    ) -> None:
        """Raise `InvariantError` if a row outlives its request or disagrees with its pages. `taken_back`:
        request id -> end page of a rollback the next plan executes (`StepPlan.taken_back`): the row is
        checked as that leaves it; `ended`: requests whose rows the next plan releases (`StepPlan.released`)."""
        by_id = {request.request_id: request for request in running}
        for request_id, row in self._rows.items():
            request = by_id.get(request_id)
            if request is None and request_id in ended:
                continue
            if request is None:
                raise InvariantError(f"block-table row {row} outlives request {request_id!r}")
            pages = request.group_pages(self.group)
            written = self._num_written[request_id]
            if taken_back is not None and request_id in taken_back:
                written = min(written, taken_back[request_id])
            if written > pages.end_page:
                raise InvariantError(f"{request_id}: row holds {written} pages, request {pages.end_page}")
            # The pages still held and already written sit at column `logical page % width`.
            first = max(pages.first_page, written - self.max_pages_per_request)
            for logical in range(first, written):
                expected = pages.page_ids[logical - pages.first_page]
                if int(self.table[row, logical % self.max_pages_per_request]) != expected:
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
