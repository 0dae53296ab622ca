"""Keep the root logger from building records that no handler prints."""

from __future__ import annotations

import logging

from faust.utils.terminal.spinners import SpinnerHandler


def drop_unprinted_debug_level(root: logging.Logger | None = None) -> None:
    """Raise the root logger to the lowest level one of its printing handlers takes.

    A Faust worker started with ``-l warn`` (or quieter) sets the root logger to DEBUG so that its start-up spinner
    turns on every record. The spinner stops once the worker is up, but the level stays: every debug call of aiokafka
    and Faust then builds a record that no handler prints, about 6 % of a busy worker's CPU in a release profile. Called
    once the app has started; a handler that prints everything (level NOTSET) leaves the level as it is.
    """
    root = root or logging.getLogger()
    levels = [handler.level for handler in root.handlers if not isinstance(handler, SpinnerHandler)]
    if levels and min(levels) > root.level:
        root.setLevel(min(levels))
