"""proto.memo.Memo: the one bounded memo both sides keep (validated specs, keys, found entries)."""

from proto.memo import Memo


def test_a_memo_remembers_until_full_then_forgets_everything_at_once():
    memo = Memo(limit=3)
    for n in range(3):
        memo.remember(n, str(n))
    assert memo == {0: "0", 1: "1", 2: "2"}
    memo.remember(3, "3")  # full: what it held goes, the new answer stays
    assert memo == {3: "3"}
    memo.remember(3, "three")
    assert memo == {3: "three"}
