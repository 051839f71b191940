"""CancelSignal: an Event whose set() also wakes those registered (no torch)."""

from __future__ import annotations

import threading

from engine.protocol import CancelSignal


def test_set_calls_what_registered_until_it_unregisters() -> None:
    cancel = CancelSignal()
    calls: list[str] = []
    cancel.on_set(lambda: calls.append("kept"))
    unregister = cancel.on_set(lambda: calls.append("gone"))
    unregister()
    unregister()  # twice is harmless: a waiter unregisters however it left
    assert isinstance(cancel, threading.Event) and not cancel.is_set()
    cancel.set()
    assert cancel.is_set() and calls == ["kept"]


def test_a_callback_registered_after_set_is_not_called() -> None:
    cancel = CancelSignal()
    cancel.set()
    calls: list[str] = []
    cancel.on_set(lambda: calls.append("late"))
    # The registrant checks is_set() after registering instead (engine.admission does).
    assert calls == [] and cancel.is_set()
