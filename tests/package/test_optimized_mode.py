"""Nothing in the package depends on `assert`: `python -O` strips asserts, with any work inside them.

The static check walks every module of `transformers_cb/`; the subprocess check runs the scheduler and
the integrity checks under `python -O` for real (CI also reruns the scheduler, cache and conformance
tests under `-O`, see `.ci/run`).
"""

from __future__ import annotations

import ast
import pathlib
import sys
import textwrap

import pytest

import transformers_cb
from tests.support.processes import run_process

PACKAGE = pathlib.Path(transformers_cb.__file__).parent


def test_the_package_has_no_assert_statement():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [
            f"{path.relative_to(PACKAGE)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Assert)
        ]
    assert not found, f"`assert` vanishes under python -O; use transformers_cb.invariants.check: {found}"


OPTIMIZED_SCRIPT = textwrap.dedent(
    """
    import sys
    if not sys.flags.optimize:
        sys.exit("not running under -O")
    from transformers_cb.kv.page_policies import FullAttentionPolicy
    from transformers_cb.kv.page_manager import PageManager
    from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
    from transformers_cb.kv.pool import PagePool
    from transformers_cb.invariants import InvariantError
    from transformers_cb.requests import Request, RequestStatus
    from transformers_cb.scheduler.scheduler import Scheduler
    from transformers_cb.scheduler.scheduler_settings import SchedulerSettings

    pool = PagePool(8)
    page_manager = PageManager([FullAttentionPolicy(pool, 4)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    scheduler = Scheduler(page_manager, SchedulerSettings("fifo", 0.0, 0, None), 64, 64)
    running = Request(request_id="a", prompt_ids=list(range(10, 20)), max_new_tokens=4)
    scheduler.add(running)
    batch = scheduler.schedule()
    # The allocation used to live inside an `assert`: under -O the request ran without pages.
    if running.pages[0].page_ids != [0, 1, 2] or pool.num_used_pages != 3 or batch.num_tokens != 10:
        sys.exit(f"pages not allocated under -O: {running.pages[0].page_ids=} {pool.num_used_pages=}")
    scheduler.check_integrity()
    for corrupt in ("status", "pages"):
        try:
            if corrupt == "status":
                running.set_status(RequestStatus.PENDING)  # an illegal transition
            else:
                running.pages[0].page_ids.append(7)  # a page the pool thinks is free
                scheduler.check_integrity()
        except InvariantError:
            continue
        sys.exit(f"{corrupt}: the invariant check vanished under -O")
    print("OK")
    """
)


@pytest.mark.slow  # a fresh interpreter under -O
def test_scheduler_allocates_and_checks_under_python_O():
    result = run_process(
        [sys.executable, "-O", "-c", OPTIMIZED_SCRIPT],
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stdout + result.stderr
