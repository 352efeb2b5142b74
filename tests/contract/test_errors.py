"""`detached`: an error kept as an outcome holds no frame (so no slot view) alive."""

from __future__ import annotations

import gc
import weakref

from tierkv.contract.errors import CorruptBlock, detached


class _Slot:
    """Stands for a slot view: something a frame holds that must not outlive it."""


def _fail_with(slot: _Slot) -> None:
    try:
        raise OSError(5, "Input/output error")
    except OSError as exc:
        raise CorruptBlock(f"bad block in {type(slot).__name__}") from exc


def _outcomes(slot: _Slot, keep: bool) -> list[BaseException]:
    outcomes: list[BaseException] = []
    try:
        _fail_with(slot)
    except CorruptBlock as exc:
        outcomes.append(detached(exc) if keep else exc)
    return outcomes


def _slot_outlives_outcomes(keep_detached: bool) -> bool:
    gc.collect()
    gc.disable()
    try:
        slot = _Slot()
        alive = weakref.ref(slot)
        outcomes = _outcomes(slot, keep_detached)
        del slot
        error = outcomes[0]
        assert isinstance(error, CorruptBlock) and "bad block in _Slot" in str(error)
        assert isinstance(error.__cause__, OSError)  # the chain and messages stay
        del outcomes, error
        return alive() is not None
    finally:
        gc.enable()


def test_a_detached_outcome_frees_the_frames_it_was_raised_through() -> None:
    assert _slot_outlives_outcomes(keep_detached=False), "the scenario needs the cycle"
    assert not _slot_outlives_outcomes(keep_detached=True)


def test_detached_clears_every_traceback_of_the_chain() -> None:
    try:
        _fail_with(_Slot())
    except CorruptBlock as exc:
        error = detached(exc)
    assert error.__traceback__ is None
    assert error.__cause__ is not None and error.__cause__.__traceback__ is None
