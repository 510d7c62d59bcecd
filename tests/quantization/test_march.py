"""March: parsing, the process-wide setting, get_march errors and defaults, scoped overrides."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import qir
from qir.march import March, get_march, march_scope, set_march


@pytest.fixture(autouse=True)
def _restore_march() -> Iterator[None]:
    before = get_march(default=None)
    yield
    set_march(before)


def test_parse_accepts_members_and_strings_in_any_case() -> None:
    assert March.parse("bayes") is March.BAYES
    assert March.parse(" BERNOULLI2 ") is March.BERNOULLI2
    assert March.parse(March.BAYES) is March.BAYES
    assert March.BAYES == "bayes" and str(March.BERNOULLI2) == "bernoulli2"


def test_unknown_march_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown march 'bayes2'.*bernoulli2, bayes"):
        set_march("bayes2")
    with pytest.raises(ValueError, match="valid marches"):
        March.parse(3)  # type: ignore[arg-type]


def test_get_march_without_a_march_says_how_to_set_one() -> None:
    set_march(None)
    with pytest.raises(RuntimeError, match=r"qir\.set_march\(qir\.March\.BAYES\)"):
        get_march()
    assert get_march(default=None) is None
    assert get_march(default="fallback") == "fallback"


def test_set_march_is_process_wide_and_exported_at_top_level() -> None:
    qir.set_march("BAYES")
    assert qir.get_march() is qir.March.BAYES
    qir.set_march(March.BERNOULLI2)
    assert get_march() is March.BERNOULLI2


def test_march_scope_overrides_and_restores_nested() -> None:
    set_march("bayes")
    with march_scope("bernoulli2") as m:
        assert m is March.BERNOULLI2 and get_march() is March.BERNOULLI2
        with march_scope(March.BAYES):
            assert get_march() is March.BAYES
        assert get_march() is March.BERNOULLI2
    assert get_march() is March.BAYES


def test_march_scope_restores_after_an_exception() -> None:
    set_march(None)
    with pytest.raises(KeyError), march_scope("bayes"):
        raise KeyError("boom")
    assert get_march(default=None) is None


def test_march_scope_is_per_thread() -> None:
    set_march("bayes")
    seen: list[March] = []
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen.append(get_march())  # must not see the main thread's scope
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with march_scope("bernoulli2"):
        inside.set()
        release.wait(5)
        assert get_march() is March.BERNOULLI2
    t.join()
    assert seen == [March.BAYES]


def test_bayes_e_is_an_alias_of_bayes() -> None:
    assert March.BAYES_E is March.BAYES
    assert March.parse("bayes-e") is March.BAYES and March.parse("BAYES_E") is March.BAYES
    assert list(March) == [March.BERNOULLI2, March.BAYES]  # the alias is not a third march
    set_march(March.BAYES_E)
    try:
        assert get_march() is March.BAYES
    finally:
        set_march(None)


@pytest.mark.parametrize("name", ["NASH", "NASH_E", "NASH_M", "NASH_P", "BERNOULLI", "META"])
def test_the_plugins_other_marches_are_refused_by_name(name: str) -> None:
    with pytest.raises(AttributeError, match=rf"March\.{name} is not supported by qir.*bernoulli2, bayes"):
        getattr(March, name)
    assert not hasattr(March, name)
    with pytest.raises(ValueError, match=rf"March\.{name} is not supported by qir"):
        set_march(name.lower().replace("_", "-"))
    with pytest.raises(AttributeError, match="has no attribute 'NASH_X'"):
        March.NASH_X  # noqa: B018  (a name the plugin never had: the ordinary error)
