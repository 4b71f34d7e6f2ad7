"""The dashboard's pure parts: who may post (weenv.server.ui.access), the
figures (weenv.server.ui.views) and the SVG charts (weenv.server.ui.charts)."""

from __future__ import annotations

from weenv.node.data.cache import CacheStats
from weenv.server.auth import ApiKey
from weenv.server.ui.access import foreign_origin, form_token, key_source
from weenv.server.ui.charts import stacked_bars, usage_spark
from weenv.server.ui.views import age, cache_hit_rate, size

KEY = ApiKey("ab" * 20)


def test_posts_from_another_origin_or_naming_none_are_foreign():
    own = {"host": "127.0.0.1:8000"}
    assert foreign_origin({**own, "origin": "http://127.0.0.1:8000"}, "http") is None
    assert foreign_origin({**own, "referer": "http://127.0.0.1:8000/ui/"}, "http") is None
    assert "comes from http://127.0.0.1:9000" in foreign_origin({**own, "origin": "http://127.0.0.1:9000"}, "http")
    assert "comes from https://127.0.0.1:8000" in foreign_origin({**own, "origin": "https://127.0.0.1:8000"}, "http")
    assert "names no Origin" in foreign_origin(own, "http")


def test_the_key_comes_as_a_header_or_the_cookie():
    assert key_source({"x-api-key": KEY.value}, {}, KEY) == "header"
    assert key_source({}, {"weenv_key": KEY.value}, KEY) == "cookie"
    assert key_source({"x-api-key": "cd" * 20}, {"weenv_key": "cd" * 20}, KEY) is None
    assert key_source({"x-api-key": KEY.value}, {}, None) is None
    assert form_token(KEY) != form_token(ApiKey("cd" * 20)) and len(form_token(KEY)) == 32


def test_hit_rate_is_the_share_of_reads_that_found_their_chunk():
    assert cache_hit_rate(CacheStats(0, 0, 0, 0, reads_hit=3, reads_missed=1)) == 0.75
    assert cache_hit_rate(CacheStats(0, 0, 0, 0)) is None


def test_ages_and_sizes_read_as_people_write_them():
    assert [age(s) for s in (5, 300, 9000, 300000, -1)] == ["5 s", "5 min", "2.5 h", "3.5 d", "0 s"]
    assert [size(n) for n in (512, 1536, 3 << 30, None)] == ["512 B", "1.5 KiB", "3.0 GiB", "-"]


def test_charts_escape_their_text_and_stack_phases():
    svg = str(stacked_bars([("<b>it</b>", {"create": 1.0, "exec": 0.5}), ("next", {})]))
    assert "<b>" not in svg and "&lt;b&gt;it&lt;/b&gt;" in svg
    assert svg.count("<rect") == 2 + 5  # two phases of the first bar, five legend swatches
    spark = str(usage_spark([0.1, 0.2, 0.3], [0.5, 0.5, 0.5], title="a<b"))
    assert 'class="used"' in spark and 'class="limit"' in spark and "a&lt;b" in spark
    assert 'class="used"' not in str(usage_spark([], [], title="none"))
