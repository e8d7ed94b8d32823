"""A forward specialised to an optional argument being None (``rewriter/specialise.py``): each
fold is checked by running the original and the specialised function on the same inputs, effects
recorded, with the argument None; the guarded method on both paths."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from transfuse.rewriter.specialise import cases, guarded, specialise


def _function(source: str) -> cst.FunctionDef:
    return cst.parse_module(textwrap.dedent(source)).body[0]


def _compiled(function: cst.FunctionDef):
    namespace: dict = {}
    exec(cst.Module(body=[function]).code, namespace)
    return namespace[function.name.value]


CASES = {
    "values of and/or": """
        def f(x, log, m=None):
            a = m is None and x
            b = m or x
            c = m is not None or x
            d = not (m is not None) and x
            return a, b, c, d
    """,
    "a selected source and a flag": """
        def f(x, log, m=None):
            is_cross = m is not None
            source = m if is_cross else x
            if is_cross and log.append("never") is None:
                return "cross"
            return source * 2, is_cross
    """,
    "effects are kept": """
        def f(x, log, m=None):
            flag = log.append("left") or m is None
            if log.append("test") or m is not None:
                log.append("body")
            return flag
    """,
    "elif chains": """
        def f(x, log, m=None):
            if m is not None:
                r = 1
            elif x > 0:
                r = 2
            else:
                r = 3
            return r
    """,
    "precedence kept": """
        def f(x, log, m=None):
            y = (x + 1 if m is None else x) * 2
            z = -(x - 1 if m is None else x)
            return y, z
    """,
    "bound in a branch: not propagated": """
        def f(x, log, m=None):
            if x > 0:
                flag = m is None
            else:
                flag = "other"
            return flag
    """,
    "nested blocks emptied": """
        def f(x, log, m=None):
            if log is not None:
                if m is not None:
                    log.append("cross")
            return x
    """,
}


@pytest.mark.parametrize("name", CASES)
def test_the_specialised_body_equals_the_original_with_the_argument_none(name):
    function = _function(CASES[name])
    assert cases(function)[0] == ("m", True)
    specialised = specialise(function, "m")
    assert specialised is not None
    original, special = _compiled(function), _compiled(specialised)
    for x in (-2, 0, 3):
        logs = [], []
        assert original(x, logs[0]) == special(x, logs[1]), (name, x)
        assert logs[0] == logs[1], (name, x)
    code = cst.Module(body=[specialised]).code
    assert "m is not None" not in code and "m is None" not in code, code


def test_the_folds_leave_what_they_should():
    code = cst.Module(body=[specialise(_function(CASES["a selected source and a flag"]), "m")]).code
    assert "source = x" in code and "return x * 2, False" in code and '"cross"' not in code
    kept = cst.Module(body=[specialise(_function(CASES["effects are kept"]), "m")]).code
    assert kept.count("log.append") == 3  # each effect is still there
    nested = cst.Module(body=[specialise(_function(CASES["nested blocks emptied"]), "m")]).code
    assert "if" not in nested and "pass" not in nested


def test_a_rebound_or_unused_argument_is_not_specialised():
    rebound = _function(
        """
        def f(x, m=None):
            if m is None:
                m = x
            return m
        """
    )
    assert specialise(rebound, "m") is None
    unused = _function(
        """
        def f(x, m=None):
            return x
        """
    )
    assert specialise(unused, "m") is None  # nothing folds


def test_keywords_and_attributes_named_like_the_argument_are_not_substituted():
    function = _function(
        """
        def f(x, m=None):
            return dict(m=x, n=m is None), type("T", (), {"m": 1}).m
        """
    )
    special = _compiled(specialise(function, "m"))
    assert special(4) == _compiled(function)(4) == ({"m": 4, "n": True}, 1)


def test_the_guarded_method_runs_each_path():
    function = _function(
        '''
        def f(x, m=None):
            """Doc."""
            is_cross = m is not None
            source = m if is_cross else x
            return source + (10 if is_cross else 0)
        '''
    )
    method = guarded(function, specialise(function, "m"), "m", True, "why")
    code = cst.Module(body=[method]).code
    assert code.splitlines()[1].strip() == '"""Doc."""' and "transfuse: where m is None" in code
    original, both = _compiled(function), _compiled(method)
    for args in ((1,), (1, 5), (2, None)):
        assert original(*args) == both(*args)


def test_an_attribute_compared_with_none_is_specialised_both_ways_unless_assigned():
    function = _function(
        """
        def f(self, x):
            if self.rank is None:
                y = x + 1
            else:
                y = x * self.rank
            return y, self.rank is not None
        """
    )
    assert cases(function) == [("self.rank", False), ("self.rank", True)]

    class Holder:
        def __init__(self, rank):
            self.rank = rank

    for rank, none in ((3, False), (None, True)):
        special = specialise(function, "self.rank", none)
        assert "if" not in cst.Module(body=[special]).code
        assert _compiled(special)(Holder(rank), 2) == _compiled(function)(Holder(rank), 2)
        both = _compiled(guarded(function, special, "self.rank", none, "why"))
        for other in (3, None):
            assert both(Holder(other), 2) == _compiled(function)(Holder(other), 2)
    assigned = _function(
        """
        def f(self, x):
            if self.rank is None:
                self.rank = 1
            return x * self.rank
        """
    )
    assert specialise(assigned, "self.rank", False) is None


def test_an_elif_decided_by_the_specialisation_stays_an_elif_or_becomes_the_else():
    """An ``elif`` sits where only an ``elif`` or an ``else`` can (older encoder-decoder attention:
    ``if ...: elif key_value_states is None: ... else: ...``): folded in place, never flattened."""
    source = (
        "def forward(self, x, kv=None):\n"
        "    if self.a:\n        y = 1\n    elif kv is None:\n        y = 2\n    else:\n        y = 3\n"
        "    if self.b:\n        w = 1\n    elif kv is not None:\n        w = 2\n    else:\n        w = 3\n"
        "    return y + w\n"
    )
    folded = specialise(cst.parse_module(source).body[0], "kv", True)
    assert cst.Module(body=[folded]).code == (
        "def forward(self, x, kv=None):\n"
        "    if self.a:\n        y = 1\n    else:\n        y = 2\n"
        "    if self.b:\n        w = 1\n    else:\n        w = 3\n"
        "    return y + w\n"
    )


def test_a_body_seen_again_is_folded_once_and_a_changed_one_again(monkeypatch):
    """A path search reaches the same body more than once (two conditions in either order, a
    class's forward edited for each of its instances): the fold runs once per body, subject and
    value, and a body whose code differs in any way is folded afresh."""
    from transfuse.rewriter import specialise as module

    folds = []
    original = module._folded
    monkeypatch.setattr(module, "_folded", lambda *args: folds.append(1) or original(*args))
    monkeypatch.setattr(module, "_SPECIALISED", {})
    source = CASES["a selected source and a flag"]
    first = specialise(_function(source), "m")
    again = specialise(_function(source), "m")  # another tree of the same code
    assert again is first and len(folds) == 1
    changed = specialise(_function(source.replace("source * 2", "source * 3")), "m")
    assert len(folds) == 2 and "return x * 3, False" in cst.Module(body=[changed]).code
    specialise(_function(source), "log")  # another subject of the same code
    assert len(folds) == 3
    monkeypatch.setattr(module, "_KEPT", 2)  # a full table is emptied, not grown
    specialise(_function(source.replace("source * 2", "source * 4")), "m")
    assert len(module._SPECIALISED) == 1
