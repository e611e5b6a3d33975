"""DigestBook: SGLang's weight digests mapped onto canonical checksums, from tables."""

from __future__ import annotations

from miles.rollout.sglang_digests import UNTRANSLATED_PREFIX, DigestBook

TP1, TP2 = "tp1-dp1-pp1", "tp2-dp1-pp1"


def test_a_digest_after_a_verified_load_is_that_checkpoints_checksum_from_then_on() -> None:
    book = DigestBook()
    assert book.translate("d1", layout=TP1, loaded="C1") == "C1"
    assert book.translate("d1", layout=TP1, loaded=None) == "C1"  # a probe, a restart


def test_without_a_verified_load_a_digest_is_nobodys_checksum() -> None:
    assert DigestBook().translate("d1", layout=TP1, loaded=None) == UNTRANSLATED_PREFIX + "d1"


def test_a_second_server_must_digest_the_same_weights_alike() -> None:
    book = DigestBook()
    book.translate("d1", layout=TP1, loaded="C1")
    assert book.translate("d1", layout=TP1, loaded="C1") == "C1"
    assert book.translate("bad", layout=TP1, loaded="C1") == UNTRANSLATED_PREFIX + "bad"


def test_layouts_digest_separately() -> None:
    book = DigestBook()
    book.translate("d1", layout=TP1, loaded="C1")
    assert book.translate("d1-tp2", layout=TP2, loaded="C1") == "C1"
    assert book.translate("d1-tp2", layout=TP1, loaded=None) == UNTRANSLATED_PREFIX + "d1-tp2"


def test_a_server_that_kept_its_old_weights_reports_them() -> None:
    book = DigestBook()
    book.translate("d1", layout=TP1, loaded="C1")
    # Told to load C2, it still digests as C1: it holds C1, and the gate sees a mismatch.
    assert book.translate("d1", layout=TP1, loaded="C2") == "C1"
