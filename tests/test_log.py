"""Rank-aware logging."""

import logging

from heatlike.core.log import RankFilter, get_logger


def _record(**extra):
    record = logging.LogRecord("heatlike.x", logging.INFO, __file__, 1, "hello", None, None)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_rank_filter_selects_ranks_and_adds_rank():
    f = RankFilter(frozenset({0}))
    f.rank = 0
    r = _record()
    assert f.filter(r) and r.rank == 0 and r.size >= 1
    f.rank = 3
    assert not f.filter(_record())
    assert f.filter(_record(all_ranks=True))
    f.ranks = None
    assert f.filter(_record())


def test_logger_hierarchy_and_format():
    log = get_logger("engine")
    assert log.name == "heatlike.engine"
    handler = logging.getLogger("heatlike").handlers[0]
    text = handler.format(_record(rank=2, size=4))
    assert text.startswith("[rank 2/4] heatlike.x INFO: hello")
