"""The root logger stops building debug records once Faust's start-up spinner is done with them."""

from __future__ import annotations

import logging

from faust.utils.terminal.spinners import Spinner, SpinnerHandler

from app.log_levels import drop_unprinted_debug_level


def make_root(*handlers: logging.Handler, level: int = logging.DEBUG) -> logging.Logger:
    root = logging.Logger("rebound-test-root", level)
    for handler in handlers:
        root.addHandler(handler)
    return root


def test_a_warn_worker_stops_building_debug_records() -> None:
    """What ``faust worker -l warn`` leaves behind: root at DEBUG, the printing handler at WARN, the spinner's."""
    printing = logging.StreamHandler()
    printing.setLevel(logging.WARNING)
    root = make_root(printing, SpinnerHandler(Spinner(), level=logging.DEBUG))
    assert root.isEnabledFor(logging.DEBUG)

    drop_unprinted_debug_level(root)

    assert root.level == logging.WARNING  # (isEnabledFor caches per logger; the real root's cache is cleared)
    assert root.getEffectiveLevel() == logging.WARNING


def test_a_handler_that_prints_everything_keeps_debug() -> None:
    root = make_root(logging.StreamHandler())  # NOTSET: prints whatever reaches it

    drop_unprinted_debug_level(root)

    assert root.level == logging.DEBUG


def test_the_lowest_printing_level_wins_and_is_never_raised_past() -> None:
    info, error = logging.StreamHandler(), logging.StreamHandler()
    info.setLevel(logging.INFO)
    error.setLevel(logging.ERROR)
    root = make_root(info, error)

    drop_unprinted_debug_level(root)
    assert root.level == logging.INFO

    quiet = make_root(error, level=logging.CRITICAL)  # already above what its handlers take: left alone
    drop_unprinted_debug_level(quiet)
    assert quiet.level == logging.CRITICAL
